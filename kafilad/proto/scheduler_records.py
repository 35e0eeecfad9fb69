"""The head scheduler's records, events and actions (kafilad/proto/scheduler.py; DESIGN §6; proto_spec 05 §3).

Plain data, no I/O: a request's `Phase` and the table of its allowed moves (`_TRANSITIONS`), the
events a driver feeds `HeadScheduler.handle`, the actions it returns, `Overdue` (a pass past its
progress deadline), the scheduler's `Request` record and a member's `StageStats`. The scheduler's
module docstring states what each means in the schedule; kafilad.proto.scheduler re-exports every
name here.
"""

from __future__ import annotations

import enum
import statistics
from typing import Optional, Union

import attrs


class Phase(enum.Enum):
    """Where a request is at the head."""

    PREFILLING = "prefilling"  # one of its prefill chunks is round the ring
    SAMPLING = "sampling"  # its sampled pass returned; the driver is sampling its row
    DECODE_READY = "decode_ready"  # its token is sampled; it waits for the next lockstep step
    DECODING = "decoding"  # it is in the decode step (or, batching off, its own pass) in flight
    ENDING = "ending"  # its `end` frame is round the ring, freeing caches and gathering statistics
    DONE = "done"  # finished, with or without an error; the scheduler forgets it


_TRANSITIONS: dict[Optional[Phase], frozenset[Phase]] = {
    None: frozenset({Phase.PREFILLING, Phase.DONE}),
    Phase.PREFILLING: frozenset({Phase.PREFILLING, Phase.SAMPLING, Phase.ENDING, Phase.DONE}),
    Phase.SAMPLING: frozenset({Phase.DECODE_READY, Phase.DECODING, Phase.ENDING, Phase.DONE}),
    Phase.DECODE_READY: frozenset({Phase.DECODING, Phase.ENDING, Phase.DONE}),
    Phase.DECODING: frozenset({Phase.SAMPLING, Phase.ENDING, Phase.DONE}),
    Phase.ENDING: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


# ---- events (driver → scheduler) -------------------------------------------------------------
@attrs.frozen
class RequestArrived:
    """A generation starts at the head. `now_s`: the driver's monotonic clock (s). `sampling`: its
    kafilad.proto.sampling.Sampling (None: `temperature` alone), kept on the record for the driver."""

    req: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    now_s: float
    sampling: Optional[object] = None
    #: the prompt cache (kafilad/executor/prefix.py): the entry its first `reuse_tokens` come from
    #: (None: none), and the entries the head evicts as it starts; only the rest is prefilled
    from_entry: Optional[str] = None
    reuse_tokens: int = 0
    evict: tuple[str, ...] = ()


@attrs.frozen
class PassReturned:
    """An `act` came back to the head: `reqs` its rows in order, `hops` its [peer_id, compute_s];
    `positions` per row (1, or 1 + k for a speculative pass, proto_spec 05 §3.1: its times are not
    a decode step's, so the step policy does not fit its costs to them)."""

    reqs: tuple[str, ...]
    sample: bool
    hops: tuple[tuple[str, float], ...]
    now_s: float
    positions: int = 1


@attrs.frozen
class TokensSampled:
    """The driver sampled the rows a `SampleTokens` asked for: tokens[i] belongs to reqs[i];
    logprobs[i], when given, is what row i reports (runner `TokenLogprobs`), passed on in EmitToken."""

    reqs: tuple[str, ...]
    tokens: tuple[int, ...]
    now_s: float
    logprobs: tuple = ()
    #: per row, the drafts a speculative pass accepted before tokens[i] (proto_spec 05 §3.1); () for none
    accepted: tuple = ()


@attrs.frozen
class EndReturned:
    """A request's `end` frame came back with every member's statistics row (proto_spec 05 §3)."""

    req: str
    stats: tuple[tuple, ...]


@attrs.frozen
class RequestCancelled:
    """The request's consumer failed or fell behind; `reason` is the user's sentence."""

    req: str
    reason: str


@attrs.frozen
class PassFailed:
    """The pass carrying `reqs` failed at the head for these requests only."""

    reqs: tuple[str, ...]
    reason: str


@attrs.frozen
class PassTimedOut:
    """The pass carrying `reqs` did not come back within its progress deadline (`HeadScheduler.overdue`);
    `reason` is the sentence its requests fail with."""

    reqs: tuple[str, ...]
    reason: str


@attrs.frozen
class RingBroken:
    """The ring cannot serve (a link or member was lost); `reason` names the member."""

    reason: str


Event = Union[RequestArrived, PassReturned, TokensSampled, EndReturned, RequestCancelled, PassFailed, PassTimedOut,
              RingBroken]


@attrs.frozen
class Overdue:
    """A pass out longer than its progress deadline: its rows, `kind` ("decode step", "prefill chunk of
    N tokens"), how long it has been out and the bound (s), and the expected circuit it is based on
    (s, None before any was measured)."""

    reqs: tuple[str, ...]
    kind: str
    waited_s: float
    bound_s: float
    expected_s: Optional[float]


# ---- actions (scheduler → driver), executed in order ----------------------------------------
@attrs.frozen
class SendPrefillChunk:
    """Embed `ids` for `req`, run the head's blocks, send a single-form act with `sample`. The
    request's first chunk carries its prompt-cache start (`from_entry`, `reuse_tokens`, `evict`)."""

    req: str
    ids: tuple[int, ...]
    sample: bool
    from_entry: Optional[str] = None
    reuse_tokens: int = 0
    evict: tuple[str, ...] = ()


@attrs.frozen
class SendDecodeStep:
    """Embed one token per request and send the step: the single form when len(reqs) == 1.
    `group`: the micro-batch it is (the stages keep one batch KV cache per group, proto_spec 05 §3)."""

    reqs: tuple[str, ...]
    tokens: tuple[int, ...]
    group: int = 0


@attrs.frozen
class SampleTokens:
    """Sample every row of the act that just returned (temperatures[i] for reqs[i]); then feed
    TokensSampled. Rows of requests that ended meanwhile are sampled too and ignored."""

    reqs: tuple[str, ...]
    temperatures: tuple[float, ...]


@attrs.frozen
class EmitToken:
    """Stream `token_id` (never an EOS) to the request's client, with its `logprob` report if any."""

    req: str
    token_id: int
    logprob: Optional[tuple] = None


@attrs.frozen
class EndRequest:
    """Flush the request's text, drop its KV rows here, send its `end` frame with our stats row."""

    req: str


@attrs.frozen
class FinishRequest:
    """The request is over (`error` None: it completed); `request` is its final record."""

    req: str
    error: Optional[str]
    request: "Request" = attrs.field(eq=False, repr=False)


Action = Union[SendPrefillChunk, SendDecodeStep, SampleTokens, EmitToken, EndRequest, FinishRequest]


@attrs.define(eq=False)
class Request:
    """The scheduler's record of one request; its statistics are read by the host's result."""

    req: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    started_s: float
    sampling: Optional[object] = None  # kafilad.proto.sampling.Sampling, read by the driver's sampler
    phase: Optional[Phase] = None
    pending_prefill: list = attrs.field(factory=list)  # chunks still to send, the sampled one last
    generated: list = attrs.field(factory=list)  # token ids streamed (EOS excluded)
    first_token_s: Optional[float] = None
    pass_started_s: float = 0.0
    pass_tokens: int = 0  # tokens its pass out carries (a prefill chunk's length; 1 for decode)
    circuit_s: list = attrs.field(factory=list)  # one per pass: its start (or last sample) to its return
    hop_compute_s: dict = attrs.field(factory=dict)  # peer_id -> [decode compute_s]
    batch_rows: list = attrs.field(factory=list)  # B of every lockstep step it took part in
    error: Optional[str] = None
    end_stats: list = attrs.field(factory=list)  # the `end` frame's rows, head first
    reused_tokens: int = 0  # prompt tokens taken from the prompt cache, not prefilled
    decode_passes: int = 0  # decode passes returned (fewer than its tokens when drafts were accepted)
    drafted: int = 0  # drafts its speculative passes carried (kafilad/proto/speculation.py)
    accepted: int = 0  # of which accepted


@attrs.define
class StageStats:
    """One member's statistics per request, for its row of the `end` frame (proto_spec 05 §3).

    `steps_s[req]` is the stage time `dt` of every pass the request took part in; `share_s[req]`
    and `sent_bytes[req]` are its shares (dt / B, frame bytes / B) of the member's compute and of
    the act bytes sent to the next member.
    """

    steps_s: dict = attrs.field(factory=dict)
    share_s: dict = attrs.field(factory=dict)
    sent_bytes: dict = attrs.field(factory=dict)
    steps_total: int = 0

    def note_step(self, reqs: list[str], dt_s: float) -> None:
        """One pass of `dt_s` seconds carrying `reqs` (B = len(reqs) rows)."""
        for req in reqs:
            self.steps_s.setdefault(req, []).append(dt_s)
            self.share_s[req] = self.share_s.get(req, 0.0) + dt_s / len(reqs)
        self.steps_total += 1

    def note_sent(self, reqs: list[str], n_bytes: int) -> None:
        """An act of `n_bytes` carrying `reqs` went to the next member."""
        for req in reqs:
            self.sent_bytes[req] = self.sent_bytes.get(req, 0) + n_bytes / len(reqs)

    def take_row(self, peer_id: str, req: str) -> list:
        """Pop the request's row: [peer_id, steps, compute_s_total, decode_stage_s_median, bytes_sent].

        The median skips the first step (the sampled prefill pass) when there are decode steps.
        """
        steps = self.steps_s.pop(req, [])
        median = statistics.median(steps[1:]) if len(steps) > 1 else (steps[0] if steps else 0.0)
        return [peer_id, len(steps), self.share_s.pop(req, 0.0), median, int(round(self.sent_bytes.pop(req, 0)))]

    def clear(self) -> None:
        """Forget every request (the ring broke)."""
        self.steps_s.clear()
        self.share_s.clear()
        self.sent_bytes.clear()
