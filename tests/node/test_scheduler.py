"""The head's scheduler without MLX or sockets (kafilad/proto/scheduler.py; DESIGN §6; proto_spec 05 §3).

`Ring` stands where the driver (RingMember) and the other members stand: it executes the
scheduler's actions, keeps the acts and `end` frames it sent in ring order (a FIFO, as the ring
edges are), returns the oldest on `deliver()`, and answers `SampleTokens` with tokens the test
chooses. Unit tests check exact action lists; a hypothesis property test drives random arrivals,
lengths, cancellations, failures and a broken ring, and checks the schedule's invariants.
"""

from __future__ import annotations

import importlib.util
from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kafilad.errors import LocalProtocolError, RemoteProtocolError
from kafilad.proto.step_policy import StepPolicy
from kafilad.proto.scheduler import (PREFILL_STEP_TOKENS, EmitToken, EndRequest, EndReturned, FinishRequest,
                                    HeadScheduler, PassFailed, PassReturned, Phase, RequestArrived,
                                    RequestCancelled, RingBroken, SampleTokens, SendDecodeStep, SendPrefillChunk,
                                    StageStats, TokensSampled, prefill_chunks)

HOPS = (("p0", 0.25), ("p1", 0.5))
EOS = 0


def arrive(req, prompt, max_tokens=8, temperature=0.0, now_s=0.0):
    return RequestArrived(req, tuple(prompt), max_tokens, temperature, now_s)


def back(reqs, sample=True, now_s=0.0, hops=HOPS):
    return PassReturned(tuple(reqs), sample, hops, now_s)


def sampled(reqs, tokens, now_s=0.0):
    return TokensSampled(tuple(reqs), tuple(tokens), now_s)


class Ring:
    """The scheduler's driver and the rest of the ring, in memory (see the module docstring)."""

    def __init__(self, sched: HeadScheduler, sample=lambda req, n: 7):
        self.sched = sched
        self.sample = sample  # (req, index of its sampled token) -> token
        self.wire: deque = deque()  # ("act", reqs, sample, is_step) | ("end", req), oldest first
        self.steps: list[tuple] = []  # every lockstep decode step sent, in order
        self.groups: list[int] = []  # the micro-batch group of each step in `steps`
        self.emitted: dict[str, list] = {}
        self.finished: dict[str, list] = {}
        self.records: dict = {}
        self.ended: list[str] = []
        self.sampled_n: dict[str, int] = {}
        self.now_s = 0.0

    def feed(self, event) -> list:
        actions = self.sched.handle(event)
        self.run(actions)
        return actions

    def run(self, actions) -> None:
        for a in actions:
            if isinstance(a, SendPrefillChunk):
                self._send(("act", (a.req,), a.sample, False))
            elif isinstance(a, SendDecodeStep):
                step = self.sched.batching
                if step:
                    self.steps.append(a.reqs)
                    self.groups.append(a.group)
                self._send(("act", a.reqs, True, step))
            elif isinstance(a, SampleTokens):
                tokens = []
                for r in a.reqs:
                    n = self.sampled_n.get(r, 0)
                    self.sampled_n[r] = n + 1
                    tokens.append(self.sample(r, n))
                self.now_s += 1
                self.feed(TokensSampled(a.reqs, tuple(tokens), self.now_s))
            elif isinstance(a, EmitToken):
                assert a.token_id != EOS
                self.emitted.setdefault(a.req, []).append(a.token_id)
            elif isinstance(a, EndRequest):
                assert a.req not in self.ended, f"{a.req} ended twice"
                assert not self._in_acts(a.req), f"{a.req} ended while one of its acts was out"
                self.ended.append(a.req)
                self._send(("end", a.req))
            elif isinstance(a, FinishRequest):
                self.finished.setdefault(a.req, []).append(a.error)
                self.records[a.req] = a.request
                assert a.request.phase is Phase.DONE and a.req not in self.sched.requests

    def _in_acts(self, req) -> int:
        return sum(req in f[1] for f in self.wire if f[0] == "act")

    def _send(self, frame) -> None:
        if frame[0] == "act":
            for r in frame[1]:
                assert not self._in_acts(r), f"{r} in two acts at once"
            if frame[3]:
                out = sum(1 for f in self.wire if f[0] == "act" and f[3])
                assert out < (self.sched.policy.pinned or 1), f"{out + 1} decode steps in flight"
        self.wire.append(frame)

    def deliver(self, *, fail: bool = False) -> list:
        """Return the oldest frame to the head (or fail its pass there)."""
        frame = self.wire.popleft()
        self.now_s += 1
        if frame[0] == "end":
            return self.feed(EndReturned(frame[1], (("p0", 1, 0.1, 0.1, 10), ("p1", 1, 0.2, 0.2, 20))))
        if fail:
            return self.feed(PassFailed(frame[1], "the stage could not run this pass"))
        return self.feed(PassReturned(frame[1], frame[2], HOPS, self.now_s))

    def drain(self) -> None:
        while self.wire:
            self.deliver()


# ---- prefill ----------------------------------------------------------------------------------
def test_prefill_sends_prompt_but_last_in_chunks_then_samples_the_last_token():
    s = HeadScheduler(batching=True)
    prompt = list(range(1, 5001))
    assert s.handle(arrive("r", prompt, temperature=0.7, now_s=10.0)) == [SendPrefillChunk("r", tuple(prompt[:2048]), False)]
    assert s.requests["r"].phase is Phase.PREFILLING
    assert s.handle(back(["r"], sample=False, now_s=11.0)) == [SendPrefillChunk("r", tuple(prompt[2048:4096]), False)]
    assert s.handle(back(["r"], sample=False, now_s=13.0)) == [SendPrefillChunk("r", tuple(prompt[4096:4999]), False)]
    assert s.handle(back(["r"], sample=False, now_s=16.0)) == [SendPrefillChunk("r", (5000,), True)]
    assert s.handle(back(["r"], sample=True, now_s=20.0)) == [SampleTokens(("r",), (0.7,))]
    rec = s.requests["r"]
    assert rec.phase is Phase.SAMPLING and rec.circuit_s == [1.0, 2.0, 3.0, 4.0]
    assert rec.hop_compute_s == {}  # prefill passes carry more than one token: not a decode stage time
    assert rec.started_s == 10.0 and rec.first_token_s is None


def test_prefill_chunks_split_as_generate_step():
    assert PREFILL_STEP_TOKENS == 2048
    assert prefill_chunks([5]) == [(5,)]
    assert prefill_chunks([1, 2, 3, 4, 5, 6], 2) == [(1, 2), (3, 4), (5,), (6,)]
    assert prefill_chunks([1, 2, 3, 4, 5], 2) == [(1, 2), (3, 4), (5,)]
    with pytest.raises(ValueError, match="at least one token"):
        prefill_chunks([])
    with pytest.raises(ValueError, match="at least 1"):
        prefill_chunks([1], 0)


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="the executor's split needs mlx")
@settings(deadline=None)
@given(st.lists(st.integers(0, 99), min_size=1, max_size=40), st.integers(1, 9))
def test_prefill_chunks_equal_the_executors(ids, step):
    from kafilad.executor.runner import prefill_chunks as executor_chunks

    assert [list(c) for c in prefill_chunks(ids, step)] == executor_chunks(ids, step)


# ---- lockstep decode --------------------------------------------------------------------------
def test_lockstep_keeps_the_previous_order_and_appends_newcomers():
    s = HeadScheduler(eos_token_ids={EOS}, batching=True)
    assert s.handle(arrive("a", [1, 2, 3], max_tokens=5, now_s=0.0)) == [SendPrefillChunk("a", (1, 2), False)]
    assert s.handle(back(["a"], sample=False, now_s=1.0)) == [SendPrefillChunk("a", (3,), True)]
    assert s.handle(arrive("b", [4], max_tokens=2, temperature=0.5, now_s=1.5)) == [SendPrefillChunk("b", (4,), True)]
    assert s.handle(back(["a"], now_s=2.0)) == [SampleTokens(("a",), (0.0,))]
    # nothing in flight: a's first decode step goes at once, alone, in the single form
    assert s.handle(sampled(["a"], [11], now_s=2.5)) == [EmitToken("a", 11), SendDecodeStep(("a",), (11,))]
    assert s.handle(back(["b"], now_s=3.0)) == [SampleTokens(("b",), (0.5,))]
    assert s.handle(sampled(["b"], [21], now_s=3.5)) == [EmitToken("b", 21)]  # a's step is out: b waits
    assert s.decode_ready == ("b",) and s.decode_in_flight == ("a",)
    assert s.handle(arrive("c", [5], max_tokens=4, now_s=3.6)) == [SendPrefillChunk("c", (5,), True)]
    assert s.handle(back(["c"], now_s=4.0)) == [SampleTokens(("c",), (0.0,))]
    assert s.handle(sampled(["c"], [31], now_s=4.5)) == [EmitToken("c", 31)]
    assert s.handle(back(["a"], now_s=5.0)) == [SampleTokens(("a",), (0.0,))]
    assert s.handle(sampled(["a"], [12], now_s=5.5)) == [EmitToken("a", 12), SendDecodeStep(("a", "b", "c"), (12, 21, 31))]
    assert s.handle(back(["a", "b", "c"], now_s=6.0)) == [SampleTokens(("a", "b", "c"), (0.0, 0.5, 0.0))]
    # b reaches max_tokens: its end goes before the next step
    assert s.handle(sampled(["a", "b", "c"], [13, 22, 32], now_s=6.5)) == [
        EmitToken("a", 13), EmitToken("b", 22), EndRequest("b"), EmitToken("c", 32), SendDecodeStep(("a", "c"), (13, 32))]
    assert s.requests["b"].phase is Phase.ENDING
    # d becomes ready while (a, c) is out, before a and c do: still a, c first, then d
    assert s.handle(arrive("d", [6], max_tokens=3, now_s=6.6)) == [SendPrefillChunk("d", (6,), True)]
    assert s.handle(back(["d"], now_s=7.0)) == [SampleTokens(("d",), (0.0,))]
    assert s.handle(sampled(["d"], [41], now_s=7.5)) == [EmitToken("d", 41)]
    assert s.handle(back(["a", "c"], now_s=8.0)) == [SampleTokens(("a", "c"), (0.0, 0.0))]
    assert s.handle(sampled(["a", "c"], [14, 33], now_s=8.5)) == [
        EmitToken("a", 14), EmitToken("c", 33), SendDecodeStep(("a", "c", "d"), (14, 33, 41))]
    assert (s.decode_steps, s.decode_rows, s.max_batch_rows) == (4, 1 + 3 + 2 + 3, 3)
    assert s.requests["a"].batch_rows == [1, 3, 2, 3] and s.requests["d"].batch_rows == [3]
    # a's decode circuits run from the sampling of its previous token to the step's return
    assert s.requests["a"].circuit_s == [1.0, 1.0, 2.5, 0.5, 1.5]
    assert s.requests["a"].hop_compute_s == {"p0": [0.25] * 3, "p1": [0.5] * 3}
    assert s.requests["a"].first_token_s == 2.5 and s.requests["b"].first_token_s == 3.5
    # b's end returns with every member's row: it finishes
    (fin,) = s.handle(EndReturned("b", (("p0", 3, 0.1, 0.05, 10), ("p1", 3, 0.2, 0.1, 20))))
    assert fin == FinishRequest("b", None, fin.request) and "b" not in s.requests
    assert fin.request.end_stats == [["p0", 3, 0.1, 0.05, 10], ["p1", 3, 0.2, 0.1, 20]]
    assert fin.request.generated == [21, 22] and fin.request.phase is Phase.DONE


def test_order_of_the_previous_step_wins_over_readiness_order():
    ring = Ring(HeadScheduler(batching=True))
    for r in "ab":
        ring.feed(arrive(r, [1], max_tokens=9))
    ring.deliver()  # a sampled: step (a,)
    ring.deliver()  # b sampled: waits
    ring.deliver()  # (a,) back: step (a, b)
    ring.feed(arrive("c", [1], max_tokens=9))
    ring.deliver()  # (a, b) is first in the FIFO: back, but c is not ready yet -> step (a, b)
    ring.deliver()  # c sampled while (a, b) is out: c is ready before a and b
    assert ring.sched.decode_ready == ("c",)
    ring.deliver()  # (a, b) back: a, b become ready after c; the step keeps a, b first
    assert ring.steps == [("a",), ("a", "b"), ("a", "b"), ("a", "b", "c")]


def test_three_micro_batches_fill_free_groups_and_a_returning_group_takes_the_newcomer():
    ring = Ring(HeadScheduler(batching=True, policy=StepPolicy(stages=3, pinned=3)))
    for r in "abcd":
        ring.feed(arrive(r, [1], max_tokens=9))
    for _ in range(4):
        ring.deliver()  # a, b, c, d sampled: a, b, c each go out in a free group; d waits (3 in flight)
    assert list(zip(ring.steps, ring.groups)) == [(("a",), 0), (("b",), 1), (("c",), 2)]
    assert ring.sched.decode_ready == ("d",) and ring.sched.steps_in_flight == {0: ("a",), 1: ("b",), 2: ("c",)}
    ring.deliver()  # (a,) back: group 0 goes again with a first, then the newcomer d
    assert (ring.steps[-1], ring.groups[-1]) == (("a", "d"), 0)
    ring.deliver()  # (b,) back: b alone again in group 1
    assert (ring.steps[-1], ring.groups[-1]) == (("b",), 1)
    assert ring.sched.max_steps_in_flight == 3 and ring.sched.decode_in_flight == ("a", "d", "b", "c")
    ring.drain()
    assert ring.finished == {r: [None] for r in "abcd"} and all(ring.emitted[r] == [7] * 9 for r in "abcd")


def test_when_m_falls_to_one_the_groups_merge_into_one_step():
    policy = StepPolicy(stages=3, pinned=2)
    ring = Ring(HeadScheduler(batching=True, policy=policy))
    for r in "abc":
        ring.feed(arrive(r, [1], max_tokens=9))
    for _ in range(3):
        ring.deliver()
    assert list(zip(ring.steps, ring.groups)) == [(("a",), 0), (("b",), 1)]
    policy.pinned = 1
    ring.deliver()  # (a,) back: group 1 is out, so a and c wait for it
    ring.deliver()  # (b,) back: one step with everyone, a's group first
    assert (ring.steps[-1], ring.groups[-1]) == (("a", "c", "b"), 0)
    ring.drain()
    assert ring.finished == {r: [None] for r in "abc"}


def test_batching_off_decodes_each_request_in_its_own_passes():
    s = HeadScheduler(eos_token_ids={EOS}, batching=False)
    s.handle(arrive("a", [1], max_tokens=3))
    s.handle(arrive("b", [2], max_tokens=3))
    assert s.handle(back(["a"], now_s=1.0)) == [SampleTokens(("a",), (0.0,))]
    assert s.handle(sampled(["a"], [11], now_s=1.5)) == [EmitToken("a", 11), SendDecodeStep(("a",), (11,))]
    assert s.handle(back(["b"], now_s=2.0)) == [SampleTokens(("b",), (0.0,))]
    # a's pass is out, yet b's own pass goes at once: passes are pipelined, not batched
    assert s.handle(sampled(["b"], [21], now_s=2.5)) == [EmitToken("b", 21), SendDecodeStep(("b",), (21,))]
    assert s.handle(back(["a"], now_s=3.0)) == [SampleTokens(("a",), (0.0,))]
    assert s.handle(sampled(["a"], [12], now_s=3.5)) == [EmitToken("a", 12), SendDecodeStep(("a",), (12,))]
    assert s.decode_in_flight is None and s.decode_ready == ()
    assert (s.decode_steps, s.decode_rows, s.max_batch_rows) == (0, 0, 0)
    assert s.requests["a"].batch_rows == [] and s.requests["a"].circuit_s == [1.0, 1.5]


# ---- ending -----------------------------------------------------------------------------------
def test_eos_ends_without_streaming_it_and_max_tokens_ends_after_streaming():
    s = HeadScheduler(eos_token_ids={EOS, 99}, batching=True)
    s.handle(arrive("e", [1], max_tokens=10))
    s.handle(arrive("m", [2], max_tokens=1))
    s.handle(back(["e"]))
    assert s.handle(sampled(["e"], [5])) == [EmitToken("e", 5), SendDecodeStep(("e",), (5,))]
    s.handle(back(["m"]))
    assert s.handle(sampled(["m"], [6])) == [EmitToken("m", 6), EndRequest("m")]
    s.handle(back(["e"]))
    assert s.handle(sampled(["e"], [99])) == [EndRequest("e")]  # an EOS id: not streamed, not counted
    assert s.requests["e"].generated == [5] and s.requests["m"].generated == [6]
    assert s.decode_in_flight is None and s.decode_ready == ()
    (fin,) = s.handle(EndReturned("m", (("p0", 1, 0.1, 0.1, 10),)))
    assert (fin.req, fin.error, fin.request.end_stats) == ("m", None, [["p0", 1, 0.1, 0.1, 10]])
    assert [a.req for a in s.handle(EndReturned("e", ()))] == ["e"] and s.requests == {}


def test_a_request_cancelled_mid_batch_ends_at_the_steps_return_and_the_others_go_on():
    ring = Ring(HeadScheduler(batching=True))
    for r in "abc":
        ring.feed(arrive(r, [1], max_tokens=9))
    for _ in range(4):
        ring.deliver()
    assert ring.steps == [("a",), ("a", "b", "c")] and ring.sched.decode_in_flight == ("a", "b", "c")
    assert ring.sched.handle(RequestCancelled("b", "The client went away.")) == []  # its row is out
    actions = ring.deliver()
    assert actions == [EndRequest("b"), SampleTokens(("a", "b", "c"), (0.0, 0.0, 0.0))]
    assert ring.steps[-1] == ("a", "c") and ring.emitted["b"] == [7]  # b's second token was not taken
    ring.deliver()  # (a, c) back -> step (a, c)
    ring.deliver()  # b's end returns
    assert ring.finished["b"] == ["The client went away."] and ring.records["b"].generated == [7]
    ring.drain()
    assert ring.finished == {"a": [None], "b": ["The client went away."], "c": [None]}
    assert ring.emitted["a"] == [7] * 9 and ring.emitted["c"] == [7] * 9


def test_a_decode_ready_request_cancelled_ends_at_once():
    s = HeadScheduler(batching=True)
    for r in "ab":
        s.handle(arrive(r, [1], max_tokens=9))
    s.handle(back(["a"]))
    s.handle(sampled(["a"], [3]))
    s.handle(back(["b"]))
    s.handle(sampled(["b"], [4]))
    assert s.decode_ready == ("b",)
    assert s.handle(RequestCancelled("b", "The client stopped reading.")) == [EndRequest("b")]
    assert s.decode_ready == () and s.requests["b"].error == "The client stopped reading."
    assert s.handle(RequestCancelled("b", "A second reason.")) == []  # ending: the first reason stays
    (fin,) = s.handle(EndReturned("b", ()))
    assert (fin.req, fin.error, fin.request.generated) == ("b", "The client stopped reading.", [4])


def test_a_request_cancelled_during_prefill_sends_no_more_chunks():
    s = HeadScheduler(prefill_step_tokens=2)
    s.handle(arrive("p", [1, 2, 3, 4, 5]))
    s.handle(RequestCancelled("p", "gone"))
    assert s.handle(back(["p"], sample=False)) == [EndRequest("p")]
    assert s.requests["p"].pending_prefill == [(3, 4), (5,)]


def test_a_pass_failing_at_the_head_finishes_its_rows_and_the_next_step_goes():
    ring = Ring(HeadScheduler(batching=True))
    for r in "ab":
        ring.feed(arrive(r, [1], max_tokens=9))
    ring.deliver()  # step (a,)
    ring.deliver()  # b ready
    ring.deliver()  # step (a, b)
    ring.feed(arrive("c", [1], max_tokens=2))
    actions = ring.deliver(fail=True)  # the step (a, b) fails: c, still prefilling, is not in it
    assert [(type(a).__name__, a.req, a.error) for a in actions] == [
        ("FinishRequest", "a", "the stage could not run this pass"),
        ("FinishRequest", "b", "the stage could not run this pass")]
    assert ring.sched.decode_in_flight is None
    ring.drain()
    assert ring.finished["c"] == [None] and ring.emitted["c"] == [7, 7] and ring.steps[-1] == ("c",)


def test_fail_all_finishes_every_request_and_stops_the_schedule():
    ring = Ring(HeadScheduler(batching=True))
    for r in "abc":
        ring.feed(arrive(r, [1, 2], max_tokens=9))
    for _ in range(5):
        ring.deliver()
    ring.sched.stats.note_step(["a"], 0.5)
    reason = "member m1 is unreachable: the link closed"
    actions = ring.feed(RingBroken(reason))
    assert [(a.req, a.error) for a in actions] == [("a", reason), ("b", reason), ("c", reason)]
    assert ring.sched.requests == {} and ring.sched.decode_in_flight is None and ring.sched.stats.steps_s == {}
    ring.drain()  # what was out comes back: nothing is sent again
    assert ring.wire == deque() and ring.sched.broken == reason
    late = ring.sched.handle(arrive("d", [1]))
    assert [(a.req, a.error) for a in late] == [("d", reason)] and ring.sched.requests == {}
    assert {r: len(v) for r, v in ring.finished.items()} == {"a": 1, "b": 1, "c": 1}


# ---- frames the head did not send --------------------------------------------------------------
def test_frames_the_schedule_cannot_explain_are_refused_and_change_nothing():
    s = HeadScheduler(batching=True)
    s.handle(arrive("a", [1, 2]))
    with pytest.raises(RemoteProtocolError, match="sample=True, which the head did not send"):
        s.handle(back(["a"], sample=True))
    with pytest.raises(RemoteProtocolError, match="twice"):
        s.handle(back(["a", "a"], sample=False))
    with pytest.raises(RemoteProtocolError, match="had not ended it"):
        s.handle(EndReturned("a", ()))
    assert s.requests["a"].circuit_s == [] and s.requests["a"].phase is Phase.PREFILLING
    s.handle(back(["a"], sample=False))
    s.handle(back(["a"]))
    s.handle(sampled(["a"], [3]))  # step (a,) out
    s.handle(arrive("b", [1]))
    s.handle(back(["b"]))
    s.handle(sampled(["b"], [4]))  # b decode-ready
    with pytest.raises(RemoteProtocolError, match="none of its passes was out"):
        s.handle(back(["a", "b"]))
    assert s.decode_in_flight == ("a",) and s.decode_ready == ("b",)
    assert s.handle(back(["zz"])) == []  # an unknown (finished) request's pass: ignored
    with pytest.raises(LocalProtocolError, match="already in flight"):
        s.handle(arrive("a", [1]))
    with pytest.raises(LocalProtocolError, match="2 tokens were sampled for 1 rows"):
        s.handle(sampled(["a"], [1, 2]))


# ---- statistics -------------------------------------------------------------------------------
def test_stage_stats_rows_share_batched_steps():
    stats = StageStats()
    stats.note_step(["a"], 0.5)  # a's prefill pass
    stats.note_sent(["a"], 100)
    stats.note_step(["a", "b"], 0.2)
    stats.note_sent(["a", "b"], 50)
    stats.note_step(["a", "b"], 0.4)
    stats.note_sent(["a", "b"], 52)
    assert stats.steps_total == 3
    assert stats.take_row("p0", "a") == ["p0", 3, pytest.approx(0.5 + 0.1 + 0.2), pytest.approx(0.3), 151]
    assert stats.take_row("p0", "b") == ["p0", 2, pytest.approx(0.3), 0.4, 51]
    assert stats.take_row("p0", "gone") == ["p0", 0, 0.0, 0.0, 0]
    stats.note_step(["c"], 0.7)
    assert stats.take_row("p1", "c") == ["p1", 1, 0.7, 0.7, 0]  # one step: the median is that step
    stats.note_step(["d"], 0.1)
    stats.clear()
    assert stats.steps_s == {} and stats.share_s == {} and stats.sent_bytes == {}


# ---- property ---------------------------------------------------------------------------------
OPS = st.sampled_from(["arrive", "arrive", "deliver", "deliver", "deliver", "deliver", "cancel", "fail", "break"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.booleans(), st.integers(1, 3))
def test_random_arrivals_every_request_ends_once_in_a_stable_lockstep(data, batching, micro_batches):
    sched = HeadScheduler(eos_token_ids={EOS}, batching=batching, prefill_step_tokens=3,
                          policy=StepPolicy(stages=3, pinned=micro_batches))
    ring = Ring(sched, sample=lambda req, n: data.draw(st.integers(0, 4), label=f"token {req}#{n}"))
    arrived: dict[str, RequestArrived] = {}
    cancelled: dict[str, str] = {}
    streamed_before_cancel: dict[str, int] = {}
    for i in range(data.draw(st.integers(1, 60), label="ops")):
        op = data.draw(OPS, label="op")
        if op == "arrive":
            ev = arrive(f"r{i}", data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=8), label="prompt"),
                        data.draw(st.integers(1, 6), label="max_tokens"), now_s=ring.now_s)
            arrived[ev.req] = ev
            ring.feed(ev)
        elif op in ("deliver", "fail") and ring.wire:
            ring.deliver(fail=op == "fail" and data.draw(st.integers(0, 4), label="fail?") == 0)
        elif op == "cancel" and sched.requests:
            req = data.draw(st.sampled_from(sorted(sched.requests)), label="cancel")
            if req not in cancelled:
                cancelled[req] = f"{req} went away"
                streamed_before_cancel[req] = len(ring.emitted.get(req, []))
            ring.feed(RequestCancelled(req, f"{req} went away"))
        elif op == "break" and data.draw(st.integers(0, 9), label="break?") == 0:
            ring.feed(RingBroken("member m1 is unreachable: it left"))
        check_invariants(ring)
    ring.drain()
    check_invariants(ring)
    # every request finished exactly once; nothing is left in the schedule
    assert {r: len(v) for r, v in ring.finished.items()} == {r: 1 for r in arrived}
    assert sched.requests == {} and sched.decode_ready == () and sched.decode_in_flight is None
    for req, ev in arrived.items():
        rec, (error,) = ring.records[req], ring.finished[req]
        assert ring.emitted.get(req, []) == rec.generated and len(rec.generated) <= ev.max_tokens
        assert EOS not in rec.generated
        if error is None:  # completed: by EOS or max_tokens, after its end gathered the rows
            assert req not in cancelled and [r[0] for r in rec.end_stats] == ["p0", "p1"]
            ended_by_eos = len(rec.generated) < ev.max_tokens
            assert ended_by_eos == (ring.sampled_n[req] == len(rec.generated) + 1)
            chunks = len(prefill_chunks(ev.prompt_ids, 3))
            assert len(rec.circuit_s) == chunks + ring.sampled_n[req] - 1  # one per pass
            assert rec.first_token_s is not None and len(rec.batch_rows) == (ring.sampled_n[req] - 1 if batching else 0)
        elif req in cancelled and sched.broken is None:
            assert error == cancelled[req]
        if req in cancelled:  # a cancelled request streams nothing more
            assert len(rec.generated) == streamed_before_cancel[req]
    if batching and micro_batches == 1:  # lockstep rows: the previous step's order kept, newcomers after
        for prev, nxt in zip(ring.steps, ring.steps[1:]):
            kept = [r for r in nxt if r in prev]
            assert list(nxt[:len(kept)]) == kept == [r for r in prev if r in nxt]
    if batching:
        assert sched.decode_steps == len(ring.steps) and sched.decode_rows == sum(map(len, ring.steps))
        assert sched.max_steps_in_flight <= micro_batches
    else:
        assert ring.steps == [] and sched.decode_steps == 0


def check_invariants(ring: Ring) -> None:
    sched = ring.sched
    acts = [f for f in ring.wire if f[0] == "act"]
    assert sum(f[3] for f in acts) <= (sched.policy.pinned or 1)  # never more than M decode steps in flight
    for rows in sched.steps_in_flight.values():
        assert any(f[1] == rows for f in acts)
    for req, rec in sched.requests.items():
        out = sum(req in f[1] for f in acts)
        assert out == (1 if rec.phase in (Phase.PREFILLING, Phase.DECODING) else 0), (req, rec.phase)
        assert (req in sched.decode_ready) == (rec.phase is Phase.DECODE_READY)
        assert rec.phase is not Phase.SAMPLING  # the ring samples at once


# ---- progress deadline ------------------------------------------------------------------------
def test_a_step_that_does_not_return_within_its_deadline_fails_its_rows_and_the_others_go_on():
    from kafilad.proto.scheduler import PROGRESS_FACTOR, PROGRESS_FLOOR_S, PassTimedOut

    ring = Ring(HeadScheduler(batching=True, policy=StepPolicy(stages=3, pinned=2)))
    for r in "abc":
        ring.feed(arrive(r, [1], max_tokens=50, now_s=ring.now_s))
    for _ in range(3):
        ring.deliver()  # a, b sampled: steps (a,) in group 0, (b,) in group 1; c waits
    assert ring.sched.overdue(ring.now_s) == []
    lost = ring.wire.popleft()  # (a,) is lost on an edge that went silent
    assert lost[1] == ("a",)
    sent_s = ring.sched._sent_s[0]
    for _ in range(20):  # b and c go on, returning 1 s per pass
        ring.deliver()
    expected = ring.sched._decode_circuit_s
    bound = max(PROGRESS_FLOOR_S, PROGRESS_FACTOR * expected)
    assert ring.sched.overdue(sent_s + bound - 0.01) == []
    (o,) = ring.sched.overdue(sent_s + bound + 1.0)
    assert (o.reqs, o.kind, o.bound_s) == (("a",), "decode step", pytest.approx(bound))
    assert ring.sched.overdue(sent_s + bound + 2.0) == []  # reported once
    actions = ring.feed(PassTimedOut(o.reqs, "Request a made no progress."))
    assert [type(a).__name__ for a in actions][:2] == ["EndRequest", "FinishRequest"]
    assert ring.finished["a"] == ["Request a made no progress."] and "a" not in ring.sched.requests
    ring.drain()
    assert ring.finished["b"] == [None] and ring.finished["c"] == [None] and len(ring.emitted["b"]) == 50


def test_a_prefill_chunk_is_bounded_by_its_tokens_before_and_after_measurement():
    from kafilad.proto.scheduler import PROGRESS_COLD_S_PER_TOKEN, PROGRESS_FLOOR_S

    s = HeadScheduler(batching=True, prefill_step_tokens=1000)
    s.handle(arrive("p", list(range(1, 2502)), now_s=0.0))  # chunks of 1000, 1000, 500, then 1
    cold = max(PROGRESS_FLOOR_S, 1000 * PROGRESS_COLD_S_PER_TOKEN)
    assert s.overdue(cold - 0.1) == []
    s.handle(back(["p"], sample=False, now_s=2.0))  # 2 ms a token measured; the next chunk goes at 2.0
    (o,) = s.overdue(2.0 + max(PROGRESS_FLOOR_S, 20 * 2.0) + 0.5)
    assert o.kind == "prefill chunk of 1000 tokens" and o.expected_s == pytest.approx(2.0)


def test_a_drafted_batched_step_streams_each_rows_accepted_tokens_and_is_not_fitted():
    """A batched speculative pass (proto_spec 05 §3.1): each row's accepted drafts stream before its
    next token, a row whose accepted drafts reach max_tokens ends there, and its times (positions
    > 1) do not enter the step policy's cost fit, which a plain step's do."""
    def two_decoding(max_b):
        s = HeadScheduler(eos_token_ids={EOS}, batching=True)
        for i, r in enumerate(("a", "b")):
            s.handle(arrive(r, [1], max_tokens=6 if r == "a" else max_b, now_s=i))
            s.handle(back([r], now_s=i + 0.5))
        s.handle(sampled(["a"], [11], now_s=2.0))  # a decodes alone first
        s.handle(sampled(["b"], [21], now_s=2.1))
        s.handle(back(["a"], now_s=2.5))
        assert s.handle(sampled(["a"], [12], now_s=2.6))[-1] == SendDecodeStep(("a", "b"), (12, 21))
        return s, s.policy.snapshot()["stage_ms"]

    slow = (("p0", 9.0), ("p1", 9.0))
    s, fitted = two_decoding(3)
    s.handle(PassReturned(("a", "b"), True, slow, 3.0, positions=4))
    assert s.policy.snapshot()["stage_ms"] == fitted  # nothing fitted from the drafted step
    acts = s.handle(TokensSampled(("a", "b"), (15, 24), 3.1, accepted=((13, 14), (22, 23))))
    assert acts == [EmitToken("a", 13), EmitToken("a", 14), EmitToken("a", 15),
                    EmitToken("b", 22), EmitToken("b", 23), EndRequest("b"), SendDecodeStep(("a",), (15,))]
    assert s.requests["a"].generated == [11, 12, 13, 14, 15] and s.requests["b"].generated == [21, 22, 23]
    s, fitted = two_decoding(6)
    s.handle(PassReturned(("a", "b"), True, slow, 3.0))
    assert s.policy.snapshot()["stage_ms"] != fitted  # a plain step's times are fitted
