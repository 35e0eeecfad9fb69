"""One member's part of the serving ring (DESIGN §2 "ring", §6 "Batched decode"; proto_spec 05 §3).

A token leaves the head, passes through every member's block range in ring order and returns to
the head for sampling. Frames on a ring edge (all inside Noise, proto_spec 05 §3), typed as
kafilad/proto/ring_frames.py's `Act`, `BatchAct` and `End` and read once, by `decode_ring_frame`, as
the ring loop takes them from its inbox (a malformed one breaks the ring naming the sender):

```
{"t": "act", "req": str, "sample": bool, "h": array | null, "hops": [[peer_id, compute_s], ...],
 "from"?: str, "reuse"?: int, "evict"?: [str]}           a request's first chunk: its prompt-cache start
{"t": "act", "reqs": [str, ...], "sample": true, "h": array (B, L, D), "hops": [[peer_id, compute_s], ...]}
 "trim"?: int / "trims"?: [int]                          positions to take back first (speculation, proto_spec 05 §3.1)
{"t": "end", "req": str, "stats": [[peer_id, steps, compute_s_total, decode_compute_s_median, bytes_sent], ...],
 "keep"?: int, "evict"?: [str]}                          keep its caches as a prompt-cache entry
```
The prompt cache (kafilad/executor/prefix.py): the head names in a request's first act the kept
entry its prompt starts from and how many tokens it reuses, and in an `end` how many positions of
the request's caches every stage keeps as an entry named by the request; either may list entries
to evict. The head decides, every member follows, in ring order.
The edge's own frames (`path_ready`, `path_switched`, `edge_ack`: proto_spec 07 §7) never reach the
ring: kafilad/node/paths/edgelink.py's ends keep them.
`h` is the hidden state in the frame layer's array encoding: (1, L, D) for a single act, (B, L, D)
for a batched act whose row i belongs to `reqs[i]` (L = 1 but for a speculative pass). The head runs its blocks, sends `act` to its
next member; every other member runs its blocks (`run` for a single act, `run_batch` for a batched
one) and forwards; when the act returns to the head, the head samples if `sample` is set (the last
prefill chunk and every decode step), or starts the next prefill chunk. `end` frees every member's
KV cache for the request and gathers per-member statistics on its way round.

The head's serving policy (prefill chunks, the lockstep decode order, `KAFILA_BATCH=0`, when a
request ends, its statistics) is the pure `kafilad.proto.scheduler.HeadScheduler`, whose docstring
states it. `RingMember` is its driver: it feeds it what happened (a request added, an act or an
`end` returned, rows sampled, a client gone, a link lost) and executes its actions (run the head's
blocks and send an act, sample, stream a token, drop caches and send `end`, finish a request).

Statistics of a batched step (proto_spec 05 §3): a stage's step time `dt` for a batch of B rows is
what each of its requests waited at that stage, so `hops` carry `dt` and the per-request step list
(its count and its decode median, `decode_compute_s_median`, which is the measured stage time the
host reports against the planner's) holds `dt` for every row. `compute_s_total` and `bytes_sent`
are shares: `dt / B` and the frame's bytes / B per row, so that over all requests they add up to
the member's busy time and the link's bytes (`scheduler.StageStats`). A request's `circuit_s` entry
for a decode step runs from the sampling of its previous token to the return of the step, so it
includes any wait for the step in flight (the token interval the client sees).

Speculative decoding (issue 24 item 1; proto_spec 05 §3.1; kafilad/node/serving/drafts.py): for a
request sampled by temperature alone that decodes in the single form, the head decides at each
sampling how many drafts its next pass carries (`_plan_next`; 0 leaves the fused sample-and-run
path, `FusedStep`, to run it), sends the token and the drafts as one single-form act, and on its
return accepts them (`_verify`, runner `head_verify`), streaming every accepted token; the
positions it rejected go out as the request's next act's `trim` (or `trims`, batched), which
every member applies before running it. A batched step of such requests (lockstep, or each
micro-batch group's) speculates as one (`_plan_next_batch` at each batched sampling,
`_batch_drafts_for`, `_verify_batch`, runner `head_verify_batch`): every row carries the same k
drafts, each accepts its own count, and the next batched act's `trims` cut each row back.

Streaming: the ring loop never waits for a client. Each request's events go into its own bounded
memory channel (`stream_events`, default STREAM_EVENTS) that `generate()` drains into the caller's
`on_event` in the caller's task. A request whose channel is full ends alone ("The client did not
read its stream fast enough; ..."), as does one whose `on_event` raises or whose caller stopped
reading; the other requests go on. `cancel(req, reason)` ends a request whose client went away
without waiting or interrupting anything: the ring loop feeds the scheduler a `RequestCancelled`
after the frame it is handling, so the request ends within one pass and its `end` frees its KV
rows on every member (the host calls it, or a remote head on the host's `cancel` frame, proto_spec
05 §2.4; never a trio cancellation, which could cut a link send mid-frame and break the ring).

A broken ring (`fail_all`) finishes every request with a message naming the member, and drops every
request's KV rows from this member's runner, on the MLX thread.
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable, Optional, Sequence, Union

import attrs
import trio

from kafilad.errors import INVALID_LOGIT_BIAS, GenerationCancelled, GenerationError, MalformedFrame, RemoteProtocolError
from kafilad.node.serving.drafts import Drafter, speculation_setting
from kafilad.node.paths.link import Link, LinkClosed
from kafilad.proto.scheduler import (PREFILL_STEP_TOKENS, Phase, PROGRESS_FACTOR, PROGRESS_FLOOR_S, EmitToken, EndRequest,
                                    EndReturned, FinishRequest, HeadScheduler, PassFailed, PassReturned,
                                    PassTimedOut, RequestArrived,
                                    RequestCancelled, RingBroken, SampleTokens, SendDecodeStep, SendPrefillChunk,
                                    StageStats, TokensSampled)
from kafilad.proto.step_policy import StepPolicy
from kafilad.step_timeline import TIMELINE
from kafilad.node.serving.ring_state import FusedStep, RequestState, WireStage, _plain, _recent, run_on_mlx_thread
from kafilad.node.serving.schedule_settings import batching_enabled, pinned_micro_batches
from kafilad.proto.ring_frames import Act, BatchAct, End, decode_ring_frame

log = logging.getLogger("kafilad.ring")

__all__ = ["PREFILL_STEP_TOKENS", "RingMember"]

INBOX_FRAMES = 256
#: events a request's stream holds for its client before the request is ended (backpressure).
STREAM_EVENTS = 256
#: cancels remembered for requests not yet started (a remote head's race, `cancel(before_start=True)`)
EARLY_CANCELS = 64
#: how often the head's ring loop checks the progress deadline when no frame arrives (s)
PROGRESS_CHECK_S = 0.5
#: put in the inbox by `fail_all` to wake the ring loop, which then drops every KV cache.
_WAKE: dict = {"t": "wake"}


class RingMember:
    """Drives this member's stage on the ring (and, on the head, the HeadScheduler).

    Args:
        peer_id: this member's peer id.
        runner: kafilad.executor.runner.StageRunner for this member's blocks.
        mlx_lock: serialises MLX work of this process (one thread at a time).
        tokenizer: mlx-lm TokenizerWrapper, on the head only.
        batching: batch decode steps (module docstring); None reads `KAFILA_BATCH` (default on).
        stream_events: events a request's stream may hold unread before that request is ended.
    Attributes (head, for status and tests):
        scheduler: the HeadScheduler (None on other members);
        decode_steps: decode steps sent; decode_rows: requests they carried in all;
        max_batch_rows: the largest step sent.
    """

    def __init__(self, *, peer_id: str, name: str, runner, mlx_lock: trio.Lock, head: bool,
                 tokenizer=None, executor=None, batching: Optional[bool] = None, stream_events: int = STREAM_EVENTS):
        self.peer_id = peer_id
        self.name = name
        self.runner = runner
        self.mlx_lock = mlx_lock
        self.head = head
        self.tokenizer = tokenizer
        self.ex = executor
        self.wire = WireStage(runner, executor)  # the stage's calls in the wire form
        self.batching = batching_enabled() if batching is None else batching
        self.stream_events = stream_events
        self.next_link: Optional[Link] = None  # None: the ring is this member alone
        self.next_is_head = head
        self.prev_name: str = "?"
        self.next_name: str = "?"
        self.ring_names: list[str] = []  # every member's name in ring order, head first (attach_ring)
        self.stalls: list[dict] = []  # head: the last passes failed by the progress deadline, for status
        self._inbox_send, self._inbox_recv = trio.open_memory_channel(INBOX_FRAMES)
        self.scheduler: Optional[HeadScheduler] = None
        if head:
            eos = tokenizer.eos_token_ids if tokenizer is not None else ()
            self.scheduler = HeadScheduler(eos_token_ids=eos, batching=self.batching,
                                           policy=StepPolicy(stages=1, pinned=pinned_micro_batches()))
        self.stats = self.scheduler.stats if self.scheduler is not None else StageStats()
        #: head: speculative decoding's state (kafilad/node/serving/drafts.py); None on other members
        self.drafter: Optional[Drafter] = None
        if head:
            stage = getattr(runner, "stage", None)
            self.drafter = Drafter(speculation_setting(), getattr(stage, "speculation_refusal", None)
                                   if stage is not None else "this member's runner holds no stage")
        #: head: a draft model proposing the drafts instead of prompt lookup (`host --draft-model`;
        #: kafilad/executor/draft.py DraftModel, run on the MLX thread)
        self.draft_model = None
        self._streams: dict[str, RequestState] = {}  # head: requests not yet finished
        self.broken: Optional[str] = None
        self.broken_member: Optional[str] = None
        self.broken_event = trio.Event()  # set once the ring cannot serve; sessions report it
        self._dropped = trio.Event()  # set (and replaced) each time requests leave the runner: `wait_idle`
        self._drop_caches = False  # fail_all asked the ring loop to drop every KV cache
        self._cancels: dict[str, str] = {}  # head: req -> reason, for the ring loop (`cancel`)
        self._early_cancels: dict[str, str] = {}  # head: cancelled before `generate` started (bounded)
        #: head: a next decode step run with its sampling (`_sample`), sent by `_send_decode_step`
        #: or taken back (`_take_back_fused`)
        self._fused: Optional[FusedStep] = None
        self._returned_group = 0  # head: the micro-batch group of the batched act being sampled
        self._returned_positions = 1  # head: the positions a row of the act being sampled carries

    # ---- read-only views for `status` and tests: the head scheduler's step counts (None off the head)
    # and the per-request statistics --------------------------------------------------------------
    @property
    def decode_steps(self) -> int:
        return self.scheduler.decode_steps if self.scheduler is not None else 0

    @property
    def decode_rows(self) -> int:
        return self.scheduler.decode_rows if self.scheduler is not None else 0

    @property
    def max_batch_rows(self) -> int:
        return self.scheduler.max_batch_rows if self.scheduler is not None else 0

    @property
    def steps_total(self) -> int:
        return self.stats.steps_total

    @property
    def req_steps(self) -> dict:
        """req -> step time (s) of every pass, on this member."""
        return self.stats.steps_s

    @property
    def req_share_s(self) -> dict:
        """req -> its share of this member's compute (s)."""
        return self.stats.share_s

    @property
    def req_bytes(self) -> dict:
        """req -> its share of the bytes sent to the next member."""
        return self.stats.sent_bytes

    # ---- plumbing -----------------------------------------------------------------------
    async def feed_from(self, link: Link) -> None:
        """Read frames from the previous member into the inbox until the link ends."""
        try:
            while True:
                frame = await link.receive()
                TIMELINE.mark("rx")
                await self._inbox_send.send(frame)
        except LinkClosed as e:
            self.fail_all(f"the ring link from {link.peer_name} closed: {e.reason}", member=link.peer_name)

    async def _send_next(self, frame: Union[Act, BatchAct, End]) -> None:
        wire = frame.to_wire()
        if self.next_link is None:
            await self._inbox_send.send(wire)
            return
        TIMELINE.mark("tx")
        try:
            n = await self.next_link.send(wire)
        except LinkClosed as e:
            self.fail_all(f"{e.reason}", member=self.next_name)
            return
        TIMELINE.mark("sent")
        if not isinstance(frame, End):  # an `end` goes after its request's statistics were taken
            self.stats.note_sent(list(frame.reqs), n)

    async def _compute(self, fn, *args):
        """Run `fn(*args)` on the MLX thread; return (result, seconds `fn` itself took).

        The time is taken inside the worker thread, so it is the stage's compute (what the
        planner predicts, DESIGN §5.1), not the hand-off between trio and the worker.
        """
        def timed():
            t0 = time.perf_counter()
            out = fn(*args)
            t1 = time.perf_counter()
            if TIMELINE.enabled:
                TIMELINE.marks += [(t0, "c0"), (t1, "c1")]
            return out, t1 - t0

        async with self.mlx_lock:
            result = await run_on_mlx_thread(timed)
        TIMELINE.mark("back")
        return result

    async def run(self) -> None:
        """Process the inbox until cancelled; on the head, check the progress deadline every
        PROGRESS_CHECK_S (kafilad/proto/scheduler.py `HeadScheduler.overdue`)."""
        while True:
            frame = _WAKE
            try:
                if self.scheduler is None:
                    frame = await self._inbox_recv.receive()
                else:
                    with trio.move_on_after(PROGRESS_CHECK_S):
                        frame = await self._inbox_recv.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return
            if frame is not _WAKE:
                await self._on_frame(frame)
            if self.scheduler is not None and not self.broken:
                await self._check_progress()
            while self._cancels and self.scheduler is not None:
                req, reason = self._cancels.popitem()
                await self._execute(self.scheduler.handle(RequestCancelled(req, reason)))
            if self._drop_caches:
                self._drop_caches = False
                await self.runner_drop_all()

    async def _on_frame(self, raw: dict) -> None:
        try:
            frame = decode_ring_frame(raw)
        except MalformedFrame as e:  # the previous member cannot be trusted to carry requests on
            log.warning("ring: malformed frame from %s: %s", self.prev_name, e)
            self.fail_all(f"it sent a malformed ring frame ({type(e).__name__}: {e})", member=self.prev_name)
            return
        try:
            if isinstance(frame, (Act, BatchAct)):
                await self._on_act(frame)
            elif isinstance(frame, End):
                await self._on_end(frame)
            else:  # UnknownRingFrame, or an edge's own frame on a bare link
                log.warning("ring: ignoring a %r frame", getattr(frame, "t", None) or type(frame).T)
        except (KeyError, TypeError, ValueError, IndexError, RemoteProtocolError) as e:
            # a well-formed frame our stage cannot take (activations of another shape, a prompt-cache
            # entry it does not hold): the ring breaks, naming the sender
            log.warning("ring: %s frame from %s not taken: %r", frame.T, self.prev_name, e)
            self.fail_all(f"it sent a malformed ring frame ({type(e).__name__}: {e})", member=self.prev_name)
        except GenerationError as e:
            if self.scheduler is not None:
                await self._execute(self.scheduler.handle(PassFailed(tuple(frame.reqs), str(e))))

    async def _check_progress(self) -> None:
        """Fail the rows of every pass past its progress deadline with a sentence (issue 11)."""
        for o in self.scheduler.overdue(time.perf_counter()):
            ring = " → ".join(self.ring_names + self.ring_names[:1]) if self.ring_names else "of this session"
            basis = (f"{PROGRESS_FACTOR:g}x the measured {o.expected_s * 1e3:.0f} ms per pass"
                     if o.expected_s is not None else "no pass of this kind was measured yet")
            who = ", ".join(o.reqs)
            reason = (f"Request {who} made no progress for {o.waited_s:.1f} s: its {o.kind} did not come back "
                      f"round the ring {ring} within {o.bound_s:.1f} s ({basis}, at least {PROGRESS_FLOOR_S:g} s). "
                      "A ring edge stalled without closing; `kafila-ctl status` shows each edge's path.")
            log.warning("ring: %s", reason)
            self.stalls.append({"reqs": list(o.reqs), "kind": o.kind, "waited_s": round(o.waited_s, 3),
                                "bound_s": round(o.bound_s, 3), "at": time.time()})
            del self.stalls[:-8]
            await self._execute(self.scheduler.handle(PassTimedOut(o.reqs, reason)))

    # ---- every member ---------------------------------------------------------------------
    async def _on_act(self, frame: Union[Act, BatchAct]) -> None:
        TIMELINE.mark("on_act")
        if self.head:
            await self._head_on_return(frame)
            return
        if self.broken:
            return
        h_wire = frame.h
        hops = frame.hops
        if isinstance(frame, BatchAct):
            rids = list(frame.reqs)
            group = frame.mb
            trims = frame.row_trims()
            out, dt = await self._compute(self.wire.run_batch, rids, h_wire, group, trims)
            self.stats.note_step(rids, dt)
            # the rows' trims go round to every member with the act (proto_spec 05 §3.1)
            await self._send_next(attrs.evolve(frame, sample=True, h=out, hops=hops + ((self.peer_id, dt),)))
            return
        req = frame.req
        if h_wire is None:
            raise RemoteProtocolError(f"An act of request {req} for this member's blocks carries no activation.")
        entry, reuse, evict = frame.from_entry, frame.reuse, list(frame.evict)
        trim = frame.trim
        if evict:
            await self._compute(self.runner.prefix_evict, evict)
        if entry is not None:
            await self._compute(self.runner.prefix_start, req, entry, reuse)
        out, dt = await self._compute(self.wire.run_blocks, req, h_wire, trim)
        self.stats.note_step([req], dt)
        sample = frame.sample
        if self.next_is_head and not sample:
            out = None  # an unsampled prefill chunk only fills caches: its output is not needed
        # the prompt cache's start (from, reuse, evict) and the trim go round to every member with the act
        await self._send_next(attrs.evolve(frame, h=out, hops=hops + ((self.peer_id, dt),)))

    async def _on_end(self, frame: End) -> None:
        req = frame.req
        if self.head:
            await self._execute(self.scheduler.handle(EndReturned(req, frame.stats)))
            return
        keep, evict = frame.keep, list(frame.evict)
        if keep is not None:
            await self._compute(self.runner.prefix_keep, req, keep)
        else:
            await self._compute(self.runner.drop, req)
        if evict:
            await self._compute(self.runner.prefix_evict, evict)
        await self._send_next(attrs.evolve(frame, stats=frame.stats + (tuple(self.stats.take_row(self.peer_id, req)),)))
        self._wake_idle()  # after the end went on: a member waiting to rejoin must not cut it off
        TIMELINE.flush()

    # ---- head -------------------------------------------------------------------------------
    async def generate(self, req: str, prompt: str, *, max_tokens: int, temperature: float,
                       on_event: Callable[[dict], Awaitable[None]], sampling=None,
                       continue_ids: Sequence[int] = ()) -> RequestState:
        """Start a generation; stream its events {"t": "token", ...} to `on_event`; return at the end.

        `on_event` runs in the caller's task, fed from the request's own bounded stream, so a slow
        or failing consumer ends only its own request (`RequestState.error` says why).
        `sampling` (kafilad.proto.sampling.Sampling) replaces `temperature` when given; a token event
        of a request that asked for `logprobs` carries "logprob" and "top_logprobs" ([[id, logprob]]).
        `continue_ids`: tokens the request already generated (a stream resumed after a loss,
        proto_spec 05 §2 `gen` "cont"): prefilled after the prompt's in one pass; the events and the
        result's text and tokens are those after them (its `prompt_tokens` counts them).

        Raises:
            GenerationError: the ring broke (the message names the member), an empty prompt, or a
                continued token outside the vocabulary.
        """
        ids = list(await trio.to_thread.run_sync(self.tokenizer.encode, prompt))  # a long prompt: off the loop
        vocab = getattr(getattr(self.runner, "stage", None), "config", {}).get("vocab_size")
        if continue_ids:
            bad = [t for t in continue_ids if not isinstance(t, int) or isinstance(t, bool) or t < 0
                   or (isinstance(vocab, int) and t >= vocab)]
            if bad:
                raise GenerationError(f"The request continues after token {bad[0]!r}, outside this model's "
                                      f"vocabulary.")
        prompt_ids, ids = ids, ids + list(continue_ids)
        if self.broken:
            raise GenerationError(self.broken)
        early = self._early_cancels.pop(req, None)
        if early is not None:
            raise GenerationCancelled(early)
        if not ids:
            raise GenerationError("The prompt encodes to no tokens.")
        if sampling is not None:
            temperature = sampling.temperature
            bad = [t for t, _ in sampling.logit_bias if isinstance(vocab, int) and t >= vocab]
            if bad:
                raise GenerationError(f"'logit_bias' names token {bad[0]}, outside this model's vocabulary of "
                                      f"{vocab} tokens.", INVALID_LOGIT_BIAS)
        entry, reuse, evict = None, 0, []
        index = self.runner.prefix_index
        if index is not None:  # the prompt cache (kafilad/executor/prefix.py): start from the longest kept prefix
            entry, reuse, evict = index.claim(tuple(ids), running=len(self.scheduler.requests) + 1)
            if evict:
                await self._compute(self.runner.prefix_evict, evict)
        actions = self.scheduler.handle(RequestArrived(req, tuple(ids), max_tokens, temperature,
                                                       now_s=time.perf_counter(), sampling=sampling,
                                                       from_entry=entry, reuse_tokens=reuse, evict=tuple(evict)))
        send, recv = trio.open_memory_channel(self.stream_events)
        st = RequestState(req=req, detok=self.tokenizer.continuation_detokenizer(prompt_ids),
                          events=send, record=self.scheduler.requests.get(req))
        st.detok.reset()
        for t in continue_ids:  # the text goes on as it would have: a character split across the pause included
            st.detok.add_token(t)
        st.detok.last_segment  # noqa: B018 - read: their text was streamed by the earlier run
        self._streams[req] = st
        async with recv:  # closed on the way out: an abandoned stream ends its request at the next event
            with trio.CancelScope(shield=True):  # the first chunk goes whole, or the request would never return
                await self._execute(actions)
            failed = False
            async for event in recv:  # until the request finishes (FinishRequest closes `send`)
                if failed:
                    continue
                try:
                    await on_event(event)
                except Exception as e:  # noqa: BLE001 - e.g. the client went away; the other requests go on
                    failed = True
                    log.warning("ring: request %s could not stream its output (%r); ending it", req, e)
                    self._note_cancel(st, f"The request's output stream failed: {e or type(e).__name__}.")
                    with trio.CancelScope(shield=True):  # its `end` frame goes whole
                        await self._execute(self.scheduler.handle(
                            RequestCancelled(req, f"The request's output stream failed: {e or type(e).__name__}.")))
        return st

    async def _execute(self, actions: list, *, h_wire: Optional[dict] = None, batched: bool = False) -> None:
        """Carry out the scheduler's actions in order. `h_wire`, `batched`: the act being sampled."""
        for a in actions:
            if isinstance(a, SendPrefillChunk):
                if not self.broken:
                    if a.from_entry is not None:
                        await self._compute(self.runner.prefix_start, a.req, a.from_entry, a.reuse_tokens)
                    out, dt = await self._compute(self.wire.head_embed, a.req, list(a.ids))
                    self.stats.note_step([a.req], dt)
                    await self._send_next(Act(req=a.req, sample=a.sample, h=out, hops=((self.peer_id, dt),),
                                              from_entry=a.from_entry,
                                              reuse=a.reuse_tokens if a.from_entry is not None else 0,
                                              evict=tuple(a.evict)))
            elif isinstance(a, SendDecodeStep):
                if not self.broken:
                    await self._send_decode_step(list(a.reqs), list(a.tokens), a.group)
            elif isinstance(a, SampleTokens):
                await self._sample(a, h_wire, batched)
            elif isinstance(a, EmitToken):
                st = self._streams.get(a.req)
                if st is not None:
                    st.detok.add_token(a.token_id)
                    segment = st.detok.last_segment
                    st.text += segment
                    event = {"t": "token", "req": a.req, "token_id": a.token_id, "text": segment}
                    if a.logprob is not None:
                        event["logprob"], event["top_logprobs"] = a.logprob[0], [list(p) for p in a.logprob[1]]
                    await self._deliver(st, event)
                    TIMELINE.mark("emit")
            elif isinstance(a, EndRequest):
                await self._end_request(a.req)
            elif isinstance(a, FinishRequest):
                self._finish(a)
            else:
                raise AssertionError(f"unknown scheduler action {a!r}")

    async def _send_decode_step(self, rids: list[str], tokens: list[int], group: int = 0) -> None:
        fused, self._fused = self._fused, None
        if fused is not None and fused.matches(rids, tokens, group):
            self.stats.note_step(rids, fused.dt_s)  # run with its sampling (`_sample`)
            hops = ((self.peer_id, fused.dt_s),)
            await self._send_next(self._with_trims(
                Act(req=rids[0], sample=True, h=fused.out, hops=hops) if fused.group is None
                else BatchAct(reqs=tuple(rids), mb=group, sample=True, h=fused.out, hops=hops)))
            return
        if fused is not None:
            await self._take_back_fused(fused)
        if len(rids) == 1:  # the single form: a lone request decodes exactly as generate_step
            drafts = await self._drafts_for(rids[0], tokens[0])  # speculative decoding (kafilad/node/serving/drafts.py)
            out, dt = await self._compute(self.wire.head_embed, rids[0], tokens + drafts)
            frame = Act(req=rids[0], sample=True, h=out, hops=((self.peer_id, dt),))
        else:  # each row its token, or its token and the batch's k drafts (`_batch_drafts_for`)
            rows = await self._batch_drafts_for(rids, tokens, group)
            out, dt = await self._compute(self.wire.head_embed_batch, rids, rows, group)
            frame = BatchAct(reqs=tuple(rids), mb=group, sample=True, h=out, hops=((self.peer_id, dt),))
        self.stats.note_step(rids, dt)
        await self._send_next(self._with_trims(frame))

    def use_draft_model(self, draft_model) -> None:
        """Head: `draft_model` (kafilad/executor/draft.py DraftModel) proposes the drafts from now on."""
        self.draft_model = draft_model
        if self.drafter is not None:
            self.drafter.source = f"draft model {draft_model.name}"

    async def _drafts_for(self, req: str, token: int) -> list[int]:
        """The drafts the request's next pass carries after `token` (kafilad/node/serving/drafts.py; [] for
        none): looked up in the prompt and output, or proposed by the draft model on the MLX thread."""
        rec = self.scheduler.requests.get(req) if self.drafter is not None else None
        if rec is None or not rec.generated or rec.generated[-1] != token:
            return []
        history = tuple(rec.prompt_ids) + tuple(rec.generated)
        room = rec.max_tokens - len(rec.generated) - 1
        if self.draft_model is None:
            return self.drafter.drafts(req, history, room)
        k = self.drafter.take_k(req, room)
        proposed = (await self._compute(self.draft_model.propose, req, history, k))[0] if k > 0 else []
        return self.drafter.record(req, proposed, k)

    async def _batch_drafts_for(self, rids: list[str], tokens: list[int], group: int) -> list:
        """The rows of micro-batch `group`'s batched step: `tokens` (one a row), or, when the
        drafter planned k for exactly these rows (`_plan_next_batch`), each row's token followed
        by its k drafts (looked up, or proposed by the draft model on the MLX thread;
        kafilad/node/serving/drafts.py)."""
        if self.drafter is None:
            return tokens
        recs = [self.scheduler.requests.get(r) for r in rids]
        if any(rec is None or not rec.generated or rec.generated[-1] != t for rec, t in zip(recs, tokens)):
            self.drafter.take_batch_k(rids, [0], group)
            return tokens
        histories = [tuple(rec.prompt_ids) + tuple(rec.generated) for rec in recs]
        rooms = [rec.max_tokens - len(rec.generated) - 1 for rec in recs]
        if self.draft_model is None:
            drafts = self.drafter.batch_drafts(rids, histories, rooms, group)
        else:
            k = self.drafter.take_batch_k(rids, rooms, group)
            proposed = (await self._compute(lambda: [self.draft_model.propose(r, h, k) for r, h in zip(rids, histories)])
                        )[0] if k > 0 else []
            drafts = self.drafter.record_batch(rids, proposed, k, tokens, group) if k > 0 else []
        return [[t] + d for t, d in zip(tokens, drafts)] if drafts else tokens

    def _with_trims(self, frame: Union[Act, BatchAct]) -> Union[Act, BatchAct]:
        """`frame` with the positions each row's stages take back first: `trim` (single form) or
        `trims` (batched), only when any is due (proto_spec 05 §3.1)."""
        if self.drafter is None:
            return frame
        trims = tuple(self.drafter.take_trim(r) for r in frame.reqs)
        if not any(trims):
            return frame
        return attrs.evolve(frame, trims=trims) if isinstance(frame, BatchAct) else attrs.evolve(frame, trim=trims[0])

    def _plan_next(self, req: str) -> int:
        """Decide k for a request's next single-form pass (0: no drafts; `Drafter.plan`): only a
        request sampled by temperature alone. Its drafts go if that pass is single-form (the
        request decodes alone, per request, or in a micro-batch of its own)."""
        if self.drafter is None or not self.drafter.on or not self._may_speculate(req):
            return 0
        return self.drafter.plan(req)

    def _plan_next_batch(self, reqs, group: int) -> int:
        """Decide k for micro-batch `group`'s next batched pass (0: plain; `Drafter.plan_batch`): only
        when every row is sampled by temperature alone; its drafts go if that pass carries the
        same rows."""
        if self.drafter is None or not self.drafter.on or len(reqs) < 2 \
                or not all(self._may_speculate(r) for r in reqs):
            return 0
        return self.drafter.plan_batch(reqs, group)

    def _may_speculate(self, req: str) -> bool:
        """Whether `req` is sampled by temperature alone (speculation's rules cover only that)."""
        rec = self.scheduler.requests.get(req)
        return rec is not None and (rec.sampling is None or rec.sampling.plain)

    async def _verify(self, a: SampleTokens, h_wire: Optional[dict], sent: tuple) -> None:
        """A speculative pass returned: accept its drafts (runner `head_verify`), stream the tokens."""
        req = a.reqs[0]
        tokens, _ = await self._compute(self.wire.head_verify, req, h_wire, list(sent), a.temperatures[0])
        now = time.perf_counter()
        self.drafter.verified(req, len(tokens) - 1, now)
        rec = self.scheduler.requests.get(req)
        if rec is not None:
            rec.drafted += len(sent)
            rec.accepted += len(tokens) - 1
        self._plan_next(req)
        await self._execute(self.scheduler.handle(TokensSampled(a.reqs, (tokens[-1],), now_s=now,
                                                                accepted=(tuple(tokens[:-1]),))))

    async def _verify_batch(self, a: SampleTokens, h_wire: Optional[dict], sent: tuple) -> None:
        """A batched speculative pass returned: accept the drafts of each row still being sampled
        (runner `head_verify_batch`; a row that ended while the pass was out, e.g. its client went
        away, has no caches left here and gets no token), stream the tokens."""
        group = self._returned_group
        live = [i for i, r in enumerate(a.reqs) if (rec := self.scheduler.requests.get(r)) is not None
                and rec.phase is Phase.SAMPLING and rec.error is None]
        rids = [a.reqs[i] for i in live]
        outs_live: list = []
        if rids:
            outs_live, _ = await self._compute(self.wire.head_verify_batch, rids, h_wire, [list(sent[i]) for i in live],
                                               [a.temperatures[i] for i in live], group,
                                               None if len(live) == len(a.reqs) else live)
        now = time.perf_counter()
        self.drafter.batch_verified(rids, [len(o) - 1 for o in outs_live], now, group=group)
        outs = [[0]] * len(a.reqs)  # an ended row's token is not taken (`TokensSampled` skips it)
        for i, o in zip(live, outs_live):
            outs[i] = o
            rec = self.scheduler.requests[a.reqs[i]]
            rec.drafted += len(sent[i])
            rec.accepted += len(o) - 1
        if len(live) == len(a.reqs):
            self._plan_next_batch(a.reqs, group)
        await self._execute(self.scheduler.handle(TokensSampled(a.reqs, tuple(o[-1] for o in outs), now_s=now,
                                                                accepted=tuple(tuple(o[:-1]) for o in outs))))

    async def _sample(self, a: SampleTokens, h_wire: Optional[dict], batched: bool) -> None:
        if not batched and len(a.reqs) == 1 and self.drafter is not None and self._may_speculate(a.reqs[0]):
            sent = self.drafter.returned(a.reqs[0], time.perf_counter())
            if sent:  # a speculative pass (proto_spec 05 §3.1)
                await self._verify(a, h_wire, sent)
                return
        if batched and self.drafter is not None:  # (its live rows are verified even if a row ended meanwhile)
            sent = self.drafter.batch_returned(a.reqs, time.perf_counter(), group=self._returned_group,
                                               measure=all(self._may_speculate(r) for r in a.reqs))
            if sent:  # a batched speculative pass
                await self._verify_batch(a, h_wire, sent)
                return
        if batched and self._returned_positions != 1:  # the head sent this step one token a row
            raise RemoteProtocolError(f"A batched decode step of one token a row came back with "
                                      f"{self._returned_positions} positions a row.")
        recs = [self.scheduler.requests.get(r) for r in a.reqs]
        samplings = [rec.sampling if rec is not None else None for rec in recs]
        logprobs: tuple = ()
        if all(s is None or s.plain for s in samplings):  # temperature only: the token-identical path
            k_next = self._plan_next_batch(a.reqs, self._returned_group) if batched else self._plan_next(a.reqs[0])
            if batched and k_next == 0 and self._may_run_next(a.reqs) and not any(a.temperatures):  # one MLX call for both
                group = self._returned_group
                (tokens, out), dt = await self._compute(self.wire.head_sample_batch_and_run, list(a.reqs), h_wire,
                                                        group)
                if out is not None:
                    self._fused = FusedStep(tuple(a.reqs), tuple(tokens), out, dt, group)
            elif batched:
                tokens, _ = await self._compute(self.wire.head_sample_batch, list(a.reqs), h_wire,
                                                list(a.temperatures))
            elif k_next == 0 and self._may_run_next(a.reqs):  # sample and run the next step in one MLX call
                (token, out), dt = await self._compute(self.wire.head_sample_and_run, a.reqs[0], h_wire,
                                                       a.temperatures[0])
                tokens = [token]
                if out is not None:
                    self._fused = FusedStep((a.reqs[0],), (token,), out, dt, None)
            else:  # k drafts planned for the next pass (`_plan_next`), or it may not run now
                token, _ = await self._compute(self.wire.head_sample, a.reqs[0], h_wire, a.temperatures[0])
                tokens = [token]
        else:  # each row with its own Sampling (kafilad/proto/sampling.py)
            histories = [_recent(rec, s.penalty_context_tokens) if rec is not None and s is not None
                         and s.needs_history else None for rec, s in zip(recs, samplings)]
            samplings = [s if s is not None else _plain(rec) for rec, s in zip(recs, samplings)]
            try:
                rows, _ = await self._compute(self.wire.head_sample_rows, list(a.reqs), h_wire, samplings, histories)
            except ValueError as e:  # a request's parameters the model cannot take (a logit_bias id)
                raise GenerationError(str(e)) from None
            tokens = [t for t, _ in rows]
            logprobs = tuple(lp for _, lp in rows)
        actions = self.scheduler.handle(TokensSampled(a.reqs, tuple(tokens), now_s=time.perf_counter(),
                                                      logprobs=logprobs))
        if self._fused is not None:  # a step run with its sampling goes out before its token is streamed
            ready = [x for x in actions if isinstance(x, SendDecodeStep) and x.reqs == self._fused.reqs]
            actions = ready + [x for x in actions if x not in ready]
        await self._execute(actions)
        if self._fused is not None:  # its step was not sent (it waits, or goes out otherwise): take it back
            fused, self._fused = self._fused, None
            await self._take_back_fused(fused)

    def _may_run_next(self, reqs) -> bool:
        """Whether the head runs the next decode step of these rows with their sampling (`_sample`):
        every row is being sampled and goes on after this token, and `_same_rows_next`."""
        recs = [self.scheduler.requests.get(r) for r in reqs]
        return all(rec is not None and rec.phase is Phase.SAMPLING and rec.error is None and rec.req not in self._cancels
                   and len(rec.generated) + 1 < rec.max_tokens for rec in recs) and self._same_rows_next(reqs)

    def _same_rows_next(self, reqs) -> bool:
        """As far as the head knows now, the next decode step carries these rows: a request alone, or
        a lockstep batch of every request."""
        if len(reqs) == 1:
            return not self.scheduler.batching or len(self.scheduler.requests) == 1
        return len(self.scheduler.requests) == len(reqs) and self.scheduler.policy.current == 1

    async def _take_back_fused(self, fused: FusedStep) -> None:
        """Take a next step run by `_sample` but not sent back out of the caches here."""
        if fused.group is None:
            await self._compute(self.runner.trim_last, fused.reqs[0])
        else:
            await self._compute(self.runner.trim_last_group, fused.group)

    async def _head_on_return(self, frame: Union[Act, BatchAct]) -> None:
        batched = isinstance(frame, BatchAct)
        shape = frame.h.get("shape") if isinstance(frame.h, dict) else None
        positions = shape[1] if isinstance(shape, list) and len(shape) == 3 and isinstance(shape[1], int) else 1
        actions = self.scheduler.handle(PassReturned(tuple(frame.reqs), frame.sample, frame.hops,
                                                     now_s=time.perf_counter(), positions=positions))
        self._returned_group = frame.mb if batched else 0
        self._returned_positions = positions
        await self._execute(actions, h_wire=frame.h, batched=batched)

    async def _deliver(self, st: RequestState, event: dict) -> None:
        """Queue one event on the request's stream; a full or abandoned stream ends that request only."""
        try:
            st.events.send_nowait(event)
            return
        except trio.WouldBlock:
            reason = (f"The client did not read its stream fast enough; the request was ended with "
                      f"{self.stream_events} events waiting unread, so that the other requests could go on.")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            reason = "The client stopped reading the request's stream."
        log.warning("ring: request %s: %s", st.req, reason)
        self._note_cancel(st, reason)
        await self._execute(self.scheduler.handle(RequestCancelled(st.req, reason)))

    def cancel(self, req: str, reason: str, *, before_start: bool = False) -> bool:
        """End request `req` early (its client went away); returns False if it is not in flight here.

        Never waits and never interrupts a send: the request is marked, and the ring loop feeds
        `RequestCancelled` to the scheduler after the frame it is handling, so the request ends at
        once if it waits for a decode step, else when its pass in flight returns (within one
        step); its `end` frame frees its KV rows on every member, and `generate` returns with
        `RequestState.cancelled` set. With `before_start`, a request not yet started here is
        remembered (the last EARLY_CANCELS of them), and `generate` for it raises GenerationCancelled
        (a remote head may read the host's `cancel` before its `gen` task has started).
        """
        st = self._streams.get(req)
        if st is None or self.scheduler is None or req not in self.scheduler.requests:
            if before_start and st is None:
                self._early_cancels[req] = reason
                while len(self._early_cancels) > EARLY_CANCELS:
                    self._early_cancels.pop(next(iter(self._early_cancels)))
            return False
        self._note_cancel(st, reason)
        st.cancel_requested = True
        self._cancels.setdefault(req, reason)
        try:
            self._inbox_send.send_nowait(_WAKE)
        except trio.WouldBlock:
            pass  # the inbox is full: the ring loop sees the cancel after its next frame
        return True

    def _note_cancel(self, st: RequestState, reason: str) -> None:
        if st.cancelled is None:
            st.cancelled = reason
            st.cancelled_at_tokens = len(st.generated) if st.record is not None else 0
            log.info("ring: request %s cancelled after %d tokens: %s", st.req, st.cancelled_at_tokens, reason)

    async def _end_request(self, req: str) -> None:
        """Flush the request's last text, drop its KV rows here, send its `end` with our stats row."""
        if self._fused is not None and self._fused.holds_only(req):
            self._fused = None  # its caches are dropped below
        if self.drafter is not None:
            self.drafter.forget(req)
        if self.draft_model is not None:
            self.draft_model.forget(req)
        st = self._streams.get(req)
        if st is not None:
            st.detok.finalize()
            tail = st.detok.last_segment
            if tail:
                st.text += tail
                await self._deliver(st, {"t": "token", "req": req, "token_id": None, "text": tail})
        rec = self.scheduler.requests.get(req)
        if rec is not None:
            log.info("ring: request %s ended after %d tokens; its decode steps carried up to %d requests",
                     req, len(rec.generated), max(rec.batch_rows, default=1))
        keep, evict = None, []
        index = self.runner.prefix_index
        if index is not None and rec is not None and rec.error is None:
            # every stage holds at least the prompt and all but the last generated token (module docstring)
            held = (tuple(rec.prompt_ids) + tuple(rec.generated))[:len(rec.prompt_ids) + len(rec.generated) - 1]
            kept, evict = index.keep(req, held, running=len(self.scheduler.requests) - 1)
            keep = len(held) if kept else None
        if keep is not None:  # off the trio thread: a prefill may hold the runner
            await self._compute(self.runner.prefix_keep, req, keep)
        else:
            await self._compute(self.runner.drop, req)
        if evict:
            await self._compute(self.runner.prefix_evict, evict)
        row = self.stats.take_row(self.peer_id, req)
        if not self.broken:
            await self._send_next(End(req=req, stats=(tuple(row),), keep=keep, evict=tuple(evict)))
        self._wake_idle()
        TIMELINE.flush()

    def _finish(self, a: FinishRequest) -> None:
        st = self._streams.pop(a.req, None)
        if st is not None:
            st.record = a.request
            st.done.set()
            st.events.close()

    def fail_all(self, reason: str, *, member: Optional[str]) -> None:
        """Fail every request in flight (every row of a batch) with `reason` naming `member` (None: the
        reason is already the whole sentence); the ring is then broken, and the ring loop drops every
        request's KV rows from the runner."""
        msg = reason if member is None else f"member {member} is unreachable: {reason}"
        if self.broken is None:
            self.broken = msg
            self.broken_member = member
            self.broken_event.set()
            log.warning("ring broken: %s", msg)
        if self.scheduler is not None:
            for a in self.scheduler.handle(RingBroken(msg)):
                self._finish(a)
        self.stats.clear()
        self._drop_caches = True
        try:
            self._inbox_send.send_nowait(_WAKE)
        except trio.WouldBlock:
            pass  # the inbox is full: the ring loop sees `_drop_caches` after its next frame

    async def runner_drop_all(self) -> None:
        """Drop every request's KV rows (single and batched) from the runner, on the MLX thread, and
        forget their statistics."""
        self.stats.clear()
        self._fused = None
        if self.drafter is not None:
            self.drafter.forget_all()
        if self.draft_model is not None:
            self.draft_model.forget_all()
        await self._compute(self._drop_every_request)
        self._wake_idle()

    def _wake_idle(self) -> None:
        """Wake `wait_idle`: requests left the runner (and their `end` went on round the ring)."""
        self._dropped.set()
        self._dropped = trio.Event()

    async def wait_idle(self) -> None:
        """Return once no request holds a KV cache on this stage (every request that went through it
        has ended or was dropped); wakes on each drop, no polling. Callers bound it (trio.move_on_after)."""
        while self.runner.active_requests:
            await self._dropped.wait()

    def _drop_every_request(self) -> None:
        for req in self.runner.active_requests:
            self.runner.drop(req)
        # the prompt cache goes too: every stage forgets its entries when the ring breaks, so the
        # head's index and every stage's entries stay the same (kafilad/executor/prefix.py)
        self.runner.prefix_evict(list(self.runner.prefix.entries))
        if self.runner.prefix_index is not None:
            self.runner.prefix_index.tokens.clear()

