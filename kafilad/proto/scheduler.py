"""The head's serving policy on the ring, with no I/O (DESIGN §6 "Batched decode"; proto_spec 05 §3).

`HeadScheduler` decides what the head sends round the ring, when a request's token streams, and
when a request ends and finishes. It imports no trio, MLX or sockets: its driver
(kafilad/node/serving/ring.py `RingMember`) feeds it typed events and executes the actions it returns, in
order (h11 / aioquic style, STYLE.md)::

    driver                                     HeadScheduler
    generate() ───────── RequestArrived ─────▶ SendPrefillChunk
    an act returns ───── PassReturned ───────▶ SendPrefillChunk | EndRequest* SampleTokens | SendDecodeStep
    rows sampled ─────── TokensSampled ──────▶ (EmitToken | EndRequest | SendDecodeStep)* SendDecodeStep*
    an end returns ───── EndReturned ────────▶ FinishRequest
    client gone ──────── RequestCancelled ───▶ EndRequest now, or when its pass returns
    stage error ──────── PassFailed ─────────▶ FinishRequest* SendDecodeStep
    ring broken ──────── RingBroken ─────────▶ FinishRequest for every request

A request's life (`Phase`; `_TRANSITIONS` is the whole table)::

    PREFILLING ─(last chunk back)─▶ SAMPLING ─▶ DECODE_READY ─(step sent)─▶ DECODING ─(back)─▶ SAMPLING ...
      └─(chunk back: next chunk)       └──(EOS, max tokens, cancelled)──▶ ENDING ─(end back)─▶ DONE
    (any phase ─▶ DONE when its pass fails or the ring breaks)

Policy (DESIGN §6, §9 item 4: a batch of 4 costs about one of 1 on a CPU; measured again here,
a 4-row step of 8 Llama blocks at hidden 512 took 1.05x a 1-row step, 13.2 vs 12.3 ms):
- Prefill is split exactly as mlx-lm's `generate_step` splits it: prompt[:-1] in chunks of
  PREFILL_STEP_TOKENS, then the last prompt token alone, the first *sampled* pass, so greedy
  output is token-identical to single-process mlx-lm; with the prompt cache (kafilad/executor/
  prefix.py) the reused prefix is skipped and the rest split so. Prefill stays per request: each request's
  chunks go round alone, as soon as it arrives, and may overlap the decode step in flight.
- Decode runs in micro-batches: up to M decode steps are in flight at once, each a *group* whose
  rows the stages keep in one `BatchKVCache` (`SendDecodeStep.group`, the act's `mb`). M comes
  from `policy` (kafilad/proto/step_policy.py `StepPolicy`: the measured stage times, the throughput
  model, a measured trial before leaving lockstep); M = 1 is lockstep. A request whose token was
  just sampled is *decode-ready*. While fewer than M steps are out, the head sends a step with
  ceil(ready / free groups) decode-ready requests: the rows of the first ready request's previous
  group in their previous order (so the stages' batch rows need no permutation), then the others
  in the order they became ready (newcomers join the first group that returns). When a step
  returns, the head samples every row, streams each request's token, ends the finished ones (EOS
  or max tokens; their `end` frames go before the next step) and at once sends the next steps.
  With M = 1 a step carries every decode-ready request, as before micro-batches existed.
  A step of one request is sent in the single form, so a lone request decodes as generate_step.
- With batching off (`KAFILA_BATCH=0`), every request decodes in its own one-request passes,
  pipelined round the ring; they are not counted as decode steps.
- A request is never in two acts at once. A request cancelled (its client went away or read too
  slowly) while one of its passes is out ends when that pass returns; its row is not sampled.

Statistics: per request, `circuit_s` holds one entry per pass (from the pass's start, or for a
decode step from the sampling of the previous token, to its return: the token interval the
client sees), `hop_compute_s` every stage's `dt` of its decode steps, `batch_rows` the B of
every lockstep step it took part in; `StageStats` keeps each member's rows of the `end` frame
(proto_spec 05 §3 "Statistics of a batched step": `dt / B` and bytes / B shares).
"""

from __future__ import annotations

from typing import Iterable, Optional

import attrs

from kafilad.errors import LocalProtocolError, RemoteProtocolError
from kafilad.proto.step_policy import StepPolicy
from kafilad.proto.scheduler_records import (  # noqa: F401 - re-exported: drivers and tests import them from here
    Phase, _TRANSITIONS, RequestArrived, PassReturned, TokensSampled, EndReturned, RequestCancelled, PassFailed,
    PassTimedOut, RingBroken, Event, Overdue, SendPrefillChunk, SendDecodeStep, SampleTokens, EmitToken,
    EndRequest, FinishRequest, Action, Request, StageStats)

#: mlx-lm's generate_step default prefill chunk (tokens); the head splits prompts by it.
PREFILL_STEP_TOKENS = 2048
#: progress deadline (issue 11; proto_spec 05 §3): a pass may take this many times its expected
#: circuit (measured: a decode pass's moving average, a prefill chunk's tokens x the measured
#: seconds per prefill token) before its requests fail, but never less than PROGRESS_FLOOR_S
PROGRESS_FACTOR = 20.0
PROGRESS_FLOOR_S = 10.0
#: a prefill chunk's bound before any prefill was measured: this much per token (s), over the floor
PROGRESS_COLD_S_PER_TOKEN = 0.05


def prefill_chunks(ids: Iterable[int], step_tokens: int = PREFILL_STEP_TOKENS) -> list[tuple[int, ...]]:
    """Split a prompt as mlx-lm's generate_step does: prompt[:-1] by `step_tokens`, then (last,).

    Args:
        ids: the prompt's token ids. step_tokens: the largest chunk (tokens).
    Returns:
        Non-empty chunks whose concatenation is `ids`; the last is the one token to be sampled.
    Raises:
        ValueError: an empty prompt or a non-positive chunk size.
    """
    ids = tuple(ids)
    if not ids:
        raise ValueError("A prompt needs at least one token.")
    if step_tokens < 1:
        raise ValueError("step_tokens must be at least 1.")
    body = ids[:-1]
    return [body[i:i + step_tokens] for i in range(0, len(body), step_tokens)] + [ids[-1:]]


class HeadScheduler:
    """The head's prefill queue, decode micro-batches, ending and statistics (module docstring).

    Args:
        eos_token_ids: the tokenizer's end-of-sequence ids (never streamed; they end a request).
        batching: batched decode (default) or per-request passes (`KAFILA_BATCH=0`).
        prefill_step_tokens: the prefill chunk size (tokens).
        policy: the StepPolicy choosing M (default: one stage, so lockstep until told the stages).
    Attributes:
        requests: req -> Request, every request not yet DONE, in arrival order.
        decode_steps: decode steps sent; decode_rows: rows they carried in all;
        max_batch_rows: the largest step sent; max_steps_in_flight: the most steps out at once.
        stats: the head's own StageStats. broken: the reason the ring broke, or None.
    """

    def __init__(self, *, eos_token_ids: Iterable[int] = (), batching: bool = True,
                 prefill_step_tokens: int = PREFILL_STEP_TOKENS, policy: Optional[StepPolicy] = None):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.batching = batching
        self.prefill_step_tokens = prefill_step_tokens
        self.policy = policy if policy is not None else StepPolicy(stages=1)
        self.requests: dict[str, Request] = {}
        self.stats = StageStats()
        self.broken: Optional[str] = None
        self.decode_steps = 0
        self.decode_rows = 0
        self.max_batch_rows = 0
        self.max_steps_in_flight = 0
        self._ready: dict[str, int] = {}  # decode-ready request -> its last token, in the order they became ready
        self._steps: dict[int, tuple[str, ...]] = {}  # group -> rows of its decode step, out or being sampled
        self._sent_s: dict[int, float] = {}  # group -> when its step was decided (s)
        self._returned_s: dict[int, float] = {}  # group -> when its step returned (s), while it is sampled
        self._last_order: dict[int, tuple[str, ...]] = {}  # group -> its previous step's rows
        self._group_of: dict[str, int] = {}  # request -> the group of its last step
        self._overlapped: set[int] = set()  # groups whose step shared the ring with another step
        self._drafted: set[int] = set()  # groups whose returned step carried drafts (PassReturned.positions)
        self._decode_circuit_s: Optional[float] = None  # moving average of a decode pass's circuit
        self._prefill_s_per_token: Optional[float] = None  # the slowest prefill seconds per token seen
        self._timed_out: set[tuple[str, ...]] = set()  # passes reported by `overdue`

    @property
    def decode_in_flight(self) -> Optional[tuple[str, ...]]:
        """Rows of every decode step in flight (until its tokens are sampled), by group; None if none."""
        if not self._steps:
            return None
        return tuple(r for g in sorted(self._steps) for r in self._steps[g])

    @property
    def steps_in_flight(self) -> dict[int, tuple[str, ...]]:
        """group -> rows of its decode step in flight (until sampled)."""
        return dict(self._steps)

    @property
    def decode_ready(self) -> tuple[str, ...]:
        """Requests waiting for a decode step, in the order they became ready."""
        return tuple(self._ready)

    def handle(self, event: Event) -> list[Action]:
        """Feed one event; return the actions to execute, in order.

        Raises:
            RemoteProtocolError: a returned frame that the head's own schedule cannot explain (a
                member sent a pass or an `end` for a request that has none in flight); nothing changed.
            LocalProtocolError: the driver broke the protocol (a request id already in flight,
                tokens that do not match their rows, an unknown event); nothing changed.
        """
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise LocalProtocolError(f"HeadScheduler cannot handle {type(event).__name__}.")
        return handler(self, event)

    # ---- transitions ---------------------------------------------------------------------
    def _enter(self, rec: Request, phase: Phase) -> None:
        if phase not in _TRANSITIONS[rec.phase]:
            raise LocalProtocolError(f"Request {rec.req} cannot go from {rec.phase} to {phase}.")
        rec.phase = phase

    def _on_arrived(self, ev: RequestArrived) -> list[Action]:
        if ev.req in self.requests:
            raise LocalProtocolError(f"Request {ev.req!r} is already in flight at the head.")
        if not 0 <= ev.reuse_tokens < len(ev.prompt_ids):
            raise LocalProtocolError(f"Request {ev.req!r} reuses {ev.reuse_tokens} of its {len(ev.prompt_ids)} "
                                     "prompt tokens; at least the last one must be prefilled.")
        chunks = prefill_chunks(ev.prompt_ids[ev.reuse_tokens:], self.prefill_step_tokens)
        rec = Request(req=ev.req, prompt_ids=tuple(ev.prompt_ids), max_tokens=ev.max_tokens,
                      temperature=ev.temperature, started_s=ev.now_s, sampling=ev.sampling,
                      pending_prefill=chunks, reused_tokens=ev.reuse_tokens)
        if self.broken is not None:
            return [self._finish(rec, self.broken)]
        self.requests[ev.req] = rec
        self._enter(rec, Phase.PREFILLING)
        first = self._next_chunk(rec, ev.now_s)
        if ev.from_entry is not None or ev.evict:
            first = attrs.evolve(first, from_entry=ev.from_entry, reuse_tokens=ev.reuse_tokens, evict=tuple(ev.evict))
        return [first]

    def _next_chunk(self, rec: Request, now_s: float) -> SendPrefillChunk:
        ids = rec.pending_prefill.pop(0)
        self._enter(rec, Phase.PREFILLING)
        rec.pass_started_s = now_s
        rec.pass_tokens = len(ids)
        return SendPrefillChunk(rec.req, tuple(ids), sample=not rec.pending_prefill)

    def _on_returned(self, ev: PassReturned) -> list[Action]:
        if len(set(ev.reqs)) != len(ev.reqs):
            raise RemoteProtocolError(f"An act returned to the head listing a request twice: {list(ev.reqs)}.")
        rows = [(r, self.requests.get(r)) for r in ev.reqs]
        for r, rec in rows:  # check first: a frame we cannot explain changes nothing
            if rec is None or rec.phase in (Phase.ENDING, Phase.DONE):
                continue  # it ended or finished while this pass was out: its row is dropped
            if rec.phase not in (Phase.PREFILLING, Phase.DECODING):
                raise RemoteProtocolError(
                    f"An act for request {r} returned to the head while none of its passes was out.")
            if rec.error is None and ev.sample != (rec.phase is Phase.DECODING or len(rec.pending_prefill) == 0):
                raise RemoteProtocolError(f"An act for request {r} returned with sample={ev.sample}, which the head "
                                          "did not send.")
        group = self._group_by_rows(ev.reqs)
        if group is not None:
            if ev.positions > 1:
                self._drafted.add(group)
            self.policy.note_step(len(ev.reqs), ev.hops, ev.now_s - self._sent_s.get(group, ev.now_s),
                                  alone=group not in self._overlapped and group not in self._drafted)
            self._returned_s[group] = ev.now_s
        actions: list[Action] = []
        live: list[Request] = []
        for r, rec in rows:
            if rec is None or rec.phase in (Phase.ENDING, Phase.DONE):
                continue
            if rec.error is not None:  # cancelled while its pass was out: end it now, before any next step
                actions.append(self._end(rec))
                continue
            rec.circuit_s.append(ev.now_s - rec.pass_started_s)
            self._note_circuit(rec, ev.now_s, group)
            if rec.generated:  # decode passes only: a prefill pass carries more tokens
                rec.decode_passes += 1
                for pid, dt in ev.hops:
                    rec.hop_compute_s.setdefault(pid, []).append(dt)
            live.append(rec)
        if not ev.sample:  # an unsampled prefill chunk filled the caches: send the next one
            return actions + [self._next_chunk(rec, ev.now_s) for rec in live]
        if live:
            for rec in live:
                self._enter(rec, Phase.SAMPLING)
            temps = tuple(self.requests[r].temperature if r in self.requests else 0.0 for r in ev.reqs)
            return actions + [SampleTokens(ev.reqs, temps)]
        if group is not None:
            self._free(group)
        return actions + self._next_steps(ev.now_s)

    def _on_sampled(self, ev: TokensSampled) -> list[Action]:
        if len(ev.tokens) != len(ev.reqs):
            raise LocalProtocolError(f"{len(ev.tokens)} tokens were sampled for {len(ev.reqs)} rows.")
        if ev.logprobs and len(ev.logprobs) != len(ev.reqs):
            raise LocalProtocolError(f"{len(ev.logprobs)} log-probability reports came for {len(ev.reqs)} rows.")
        if ev.accepted and len(ev.accepted) != len(ev.reqs):
            raise LocalProtocolError(f"{len(ev.accepted)} accepted-draft lists came for {len(ev.reqs)} rows.")
        actions: list[Action] = []
        for i, (r, token) in enumerate(zip(ev.reqs, ev.tokens)):
            rec = self.requests.get(r)
            if rec is None or rec.phase is not Phase.SAMPLING:
                continue
            if rec.error is not None:  # cancelled while it was being sampled: its token is not streamed
                actions.append(self._end(rec))
            else:
                for early in (ev.accepted[i] if ev.accepted else ()):  # a speculative pass's accepted drafts
                    if early in self.eos_token_ids or len(rec.generated) + 1 >= rec.max_tokens:
                        token = early  # it ends the request: the later tokens are not taken
                        break
                    rec.generated.append(int(early))
                    actions.append(EmitToken(rec.req, int(early), None))
                    if rec.first_token_s is None:
                        rec.first_token_s = ev.now_s
                actions += self._take_token(rec, int(token), ev.now_s, ev.logprobs[i] if ev.logprobs else None)
        group = self._group_by_rows(ev.reqs)
        if group is not None:
            returned = self._returned_s.get(group)
            if returned is not None:
                self.policy.note_sampling(len(ev.reqs), ev.now_s - returned,
                                          alone=group not in self._overlapped and group not in self._drafted)
            made = sum(isinstance(x, EmitToken) for x in actions)  # the tokens it streamed, accepted drafts too
            self.policy.note_tokens(made, len(self._ready) + sum(map(len, self._steps.values())), ev.now_s)
            self._free(group)
        return actions + self._next_steps(ev.now_s)

    def _take_token(self, rec: Request, token: int, now_s: float, logprob: Optional[tuple] = None) -> list[Action]:
        """Stream a sampled token (with its log-probability report); end the request, or queue its
        next decode pass."""
        if rec.first_token_s is None:
            rec.first_token_s = now_s
        eos = token in self.eos_token_ids
        out: list[Action] = []
        if not eos:
            rec.generated.append(token)
            out.append(EmitToken(rec.req, token, logprob))
        if eos or len(rec.generated) >= rec.max_tokens:
            out.append(self._end(rec))
        elif self.batching:
            self._enter(rec, Phase.DECODE_READY)
            self._ready[rec.req] = token
            rec.pass_started_s = now_s
        else:
            self._enter(rec, Phase.DECODING)
            rec.pass_started_s = now_s
            out.append(SendDecodeStep((rec.req,), (token,)))
        return out

    # ---- progress deadline --------------------------------------------------------------------
    def _note_circuit(self, rec: Request, now_s: float, group: Optional[int]) -> None:
        """Fold a returned pass into the expected circuits (decode: from its sending; prefill: per token)."""
        if rec.phase is Phase.DECODING or rec.pass_tokens <= 1:
            sent = self._sent_s.get(group, rec.pass_started_s) if group is not None else rec.pass_started_s
            x = max(0.0, now_s - sent)
            self._decode_circuit_s = x if self._decode_circuit_s is None else self._decode_circuit_s + 0.2 * (
                x - self._decode_circuit_s)
        else:
            x = max(0.0, now_s - rec.pass_started_s) / rec.pass_tokens
            self._prefill_s_per_token = x if self._prefill_s_per_token is None else max(x, self._prefill_s_per_token)

    def overdue(self, now_s: float) -> list[Overdue]:
        """Passes out longer than their progress deadline (module constants), each reported once.

        A decode step's rows are one pass; a prefill chunk or a per-request decode pass is its
        request's. The driver fails them with `PassTimedOut`.
        """
        out: list[Overdue] = []
        seen: set[str] = set()
        for group, rows in self._steps.items():
            if group in self._returned_s or rows in self._timed_out:
                continue
            seen.update(rows)
            out += self._check(rows, "decode step", now_s - self._sent_s.get(group, now_s), self._decode_circuit_s)
        for rec in self.requests.values():
            if rec.req in seen or rec.phase not in (Phase.PREFILLING, Phase.DECODING) or (rec.req,) in self._timed_out:
                continue
            if rec.phase is Phase.DECODING or rec.pass_tokens <= 1:
                out += self._check((rec.req,), "decode step" if rec.generated else "first token",
                                   now_s - rec.pass_started_s, self._decode_circuit_s)
            else:
                per = self._prefill_s_per_token
                out += self._check((rec.req,), f"prefill chunk of {rec.pass_tokens} tokens", now_s - rec.pass_started_s,
                                   None if per is None else per * rec.pass_tokens,
                                   cold_s=PROGRESS_COLD_S_PER_TOKEN * rec.pass_tokens)
        for o in out:
            self._timed_out.add(o.reqs)
        return out

    @staticmethod
    def _check(reqs, kind, waited_s, expected_s, cold_s: float = 0.0) -> list[Overdue]:
        bound = max(PROGRESS_FLOOR_S, cold_s if expected_s is None else PROGRESS_FACTOR * expected_s)
        return [Overdue(tuple(reqs), kind, waited_s, bound, expected_s)] if waited_s > bound else []

    def _on_timed_out(self, ev: PassTimedOut) -> list[Action]:
        """Fail the rows of a pass that did not come back: each ends (its `end` follows the lost pass on
        the same edges, freeing the members' caches if the pass ever arrives) and finishes at once."""
        actions: list[Action] = []
        self._timed_out.discard(tuple(ev.reqs))
        group = self._group_by_rows(ev.reqs)
        for r in ev.reqs:
            rec = self.requests.get(r)
            if rec is None or rec.phase not in (Phase.PREFILLING, Phase.DECODING):
                continue
            rec.error = rec.error or ev.reason
            actions += [self._end(rec), self._finish(rec, ev.reason)]
        if group is not None:
            self._free(group)
            actions += self._next_steps()
        return actions

    def _group_by_rows(self, reqs: tuple[str, ...]) -> Optional[int]:
        for g, rows in self._steps.items():
            if rows == reqs:
                return g
        return None

    def _free(self, group: int) -> None:
        self._steps.pop(group, None)
        self._overlapped.discard(group)
        self._drafted.discard(group)
        self._sent_s.pop(group, None)
        self._returned_s.pop(group, None)

    def _next_steps(self, now_s: Optional[float] = None) -> list[Action]:
        """Decode steps for the decode-ready requests while fewer than M are in flight (module docstring).

        M comes from the policy for the K requests decoding (ready + in steps). Each step takes
        ceil(ready / free groups) rows: the rows of the first ready request's previous group, in
        their previous order, then the others in the order they became ready; it goes out as that
        group when the group is free (its stages' batch caches are reused as they are), else as the
        lowest free group.
        """
        if not self.batching or not self._ready or self.broken is not None:
            return []
        in_steps = sum(len(rows) for rows in self._steps.values())
        m = max(1, self.policy.choose(len(self._ready) + in_steps, now_s if now_s is not None else 0.0))
        actions: list[Action] = []
        while self._ready and len(self._steps) < m:
            free_groups = m - len(self._steps)
            size = -(-len(self._ready) // free_groups)
            first = next(iter(self._ready))
            group = self._group_of.get(first)
            if group is None or group in self._steps:
                group = next(g for g in range(len(self._steps) + 1) if g not in self._steps)
            prev = [r for r in self._last_order.get(group, ()) if r in self._ready]
            rids = tuple((prev + [r for r in self._ready if r not in prev])[:size])
            tokens = tuple(self._ready.pop(r) for r in rids)
            if self._steps:  # it overlaps the steps out, and they it: none of them measures a stage alone
                self._overlapped.update(self._steps)
                self._overlapped.add(group)
            self._steps[group] = self._last_order[group] = rids
            self._sent_s[group] = now_s if now_s is not None else max(
                (self.requests[r].pass_started_s for r in rids), default=0.0)
            self.decode_steps += 1
            self.decode_rows += len(rids)
            self.max_batch_rows = max(self.max_batch_rows, len(rids))
            self.max_steps_in_flight = max(self.max_steps_in_flight, len(self._steps))
            for r in rids:
                rec = self.requests[r]
                rec.batch_rows.append(len(rids))
                self._group_of[r] = group
                self._enter(rec, Phase.DECODING)
            actions.append(SendDecodeStep(rids, tokens, group))
        return actions

    def _end(self, rec: Request) -> EndRequest:
        self._enter(rec, Phase.ENDING)
        self._ready.pop(rec.req, None)
        return EndRequest(rec.req)

    def _finish(self, rec: Request, error: Optional[str]) -> FinishRequest:
        rec.error = rec.error or error
        self._enter(rec, Phase.DONE)
        self.requests.pop(rec.req, None)
        self._ready.pop(rec.req, None)
        self._group_of.pop(rec.req, None)
        return FinishRequest(rec.req, rec.error, rec)

    def _on_end_returned(self, ev: EndReturned) -> list[Action]:
        rec = self.requests.get(ev.req)
        if rec is None:
            return []
        if rec.phase is not Phase.ENDING:
            raise RemoteProtocolError(
                f"An end frame for request {ev.req} returned to the head, which had not ended it.")
        rec.end_stats = [list(row) for row in ev.stats]
        return [self._finish(rec, None)]

    def _on_cancelled(self, ev: RequestCancelled) -> list[Action]:
        rec = self.requests.get(ev.req)
        if rec is None:
            return []
        rec.error = rec.error or ev.reason
        if rec.phase is Phase.DECODE_READY:
            return [self._end(rec)]
        return []  # ENDING: it finishes with the error; otherwise it ends when its pass returns

    def _on_failed(self, ev: PassFailed) -> list[Action]:
        actions: list[Action] = [self._finish(self.requests[r], ev.reason) for r in ev.reqs if r in self.requests]
        group = self._group_by_rows(ev.reqs)
        if group is not None:
            self._free(group)
            actions += self._next_steps()
        return actions

    def _on_broken(self, ev: RingBroken) -> list[Action]:
        if self.broken is None:
            self.broken = ev.reason
        actions: list[Action] = [self._finish(rec, ev.reason) for rec in list(self.requests.values())]
        self._ready.clear()
        self._steps.clear()
        self._overlapped.clear()
        self._drafted.clear()
        self._sent_s.clear()
        self._returned_s.clear()
        self.stats.clear()
        return actions


_HANDLERS = {
    RequestArrived: HeadScheduler._on_arrived,
    PassReturned: HeadScheduler._on_returned,
    TokensSampled: HeadScheduler._on_sampled,
    EndReturned: HeadScheduler._on_end_returned,
    RequestCancelled: HeadScheduler._on_cancelled,
    PassFailed: HeadScheduler._on_failed,
    PassTimedOut: HeadScheduler._on_timed_out,
    RingBroken: HeadScheduler._on_broken,
}
