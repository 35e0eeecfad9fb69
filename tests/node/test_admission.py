"""Run-time admission at the host (kafilad/node/serving/admission.py; issue 9 "Admission at run time").

The policy (`AdmissionQueue`) is tested without trio: exact verdicts, FIFO hand-over, Retry-After,
and a hypothesis property over random arrivals and departures. Its trio driver (`Limiter`) is
tested under trio's MockClock: K holders at once, waiters served first in first out, a full queue
refused with HostBusyError, a waiter whose client leaves (or whose task is cancelled) gives its
place up, and a slot granted to a waiter that just left is handed on.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from kafilad.errors import GenerationError, HostBusyError
from kafilad.node.serving.admission import AdmissionQueue, Limiter, Verdict


# ---- the policy ----------------------------------------------------------------------------
def test_k_run_then_the_queue_fills_then_requests_are_refused():
    q = AdmissionQueue(2, queue_limit=3)
    assert [q.arrive(t, 0.0) for t in range(1, 7)] == [Verdict.RUN] * 2 + [Verdict.QUEUED] * 3 + [Verdict.REFUSED]
    assert set(q.running) == {1, 2} and list(q.waiting) == [3, 4, 5]


def test_a_freed_slot_goes_to_the_oldest_waiter_and_no_newcomer_overtakes():
    q = AdmissionQueue(1, queue_limit=2)
    assert q.arrive("a", 0.0) is Verdict.RUN
    assert q.arrive("b", 0.0) is Verdict.QUEUED
    assert q.arrive("c", 0.0) is Verdict.QUEUED
    assert q.leave("a", 4.0) == ["b"]
    assert q.arrive("d", 4.0) is Verdict.QUEUED  # a slot is not free: "c" waits ahead of it
    assert q.leave("c", 5.0) == []  # a waiter gives up: nothing starts
    assert q.leave("b", 6.0) == ["d"]
    assert list(q.running) == ["d"] and not q.waiting


def test_default_queue_is_four_per_slot_and_bad_limits_are_refused():
    assert AdmissionQueue(3).queue_limit == 12
    assert AdmissionQueue(1, queue_limit=0).arrive(1, 0) is Verdict.RUN
    with pytest.raises(ValueError, match="at least 1"):
        AdmissionQueue(0)
    with pytest.raises(ValueError, match="0 or more"):
        AdmissionQueue(1, queue_limit=-1)


def test_retry_after_follows_the_mean_hold_time_and_the_queue():
    q = AdmissionQueue(2, queue_limit=4)
    assert q.retry_after_s() == 1  # nothing measured yet
    q.arrive(1, 0.0)
    q.arrive(2, 0.0)
    q.leave(1, 10.0)  # held 10 s
    assert q.hold_s == 10.0
    for t in range(3, 7):
        q.arrive(t, 10.0)
    # 10 s mean hold x (3 waiting + the newcomer) / 2 slots
    assert len(q.waiting) == 3 and q.retry_after_s() == 20
    q.leave(2, 1000.0)  # a long hold raises the mean, and the estimate is capped at 60 s
    assert q.retry_after_s() == 60


def test_a_ticket_that_arrives_twice_is_a_driver_bug():
    q = AdmissionQueue(1)
    q.arrive(1, 0.0)
    with pytest.raises(ValueError, match="twice"):
        q.arrive(1, 0.0)


@settings(max_examples=300, deadline=None)
@given(k=st.integers(1, 4), limit=st.integers(0, 5),
       ops=st.lists(st.tuples(st.sampled_from(["arrive", "leave"]), st.integers(0, 11)), max_size=60))
def test_invariants_over_random_arrivals_and_departures(k, limit, ops):
    """Never more than K run or `limit` wait; a slot is never idle while someone waits; grants are FIFO."""
    q = AdmissionQueue(k, queue_limit=limit)
    seen, order_queued, order_granted = set(), [], []
    for now, (op, t) in enumerate(ops):
        if op == "arrive":
            if t in seen:
                continue
            seen.add(t)
            v = q.arrive(t, float(now))
            if v is Verdict.QUEUED:
                order_queued.append(t)
            elif v is Verdict.REFUSED:
                assert len(q.running) == k and len(q.waiting) == limit
        else:
            was_waiting = t in q.waiting
            granted = q.leave(t, float(now))
            if was_waiting:
                order_queued.remove(t)
            order_granted += granted
        assert len(q.running) <= k and len(q.waiting) <= limit
        assert not q.waiting or len(q.running) == k
    # the waiters that were granted a slot got it in the order they queued
    assert order_granted == sorted(order_granted, key=lambda t: _queued_at(ops, t))


def _queued_at(ops, t) -> int:
    return next(i for i, (op, x) in enumerate(ops) if op == "arrive" and x == t)


# ---- the trio driver -----------------------------------------------------------------------
def run(fn):
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def test_limiter_runs_k_at_once_and_serves_waiters_in_order():
    async def main():
        lim = Limiter(2, queue_limit=8)
        started, peak = [], [0]

        async def request(i: int) -> None:
            await trio.sleep(i * 0.01)  # arrive in order 0, 1, 2, ...
            slot = await lim.acquire()
            started.append(i)
            peak[0] = max(peak[0], lim.running)
            await trio.sleep(1.0)
            lim.release(slot)

        async with trio.open_nursery() as n:
            for i in range(7):
                n.start_soon(request, i)
            await trio.sleep(0.5)
            assert lim.counts().to_json() == {"running": 2, "queued": 5, "concurrency": 2, "queue_limit": 8}
        assert started == list(range(7)) and peak[0] == 2
        assert lim.counts().running == 0 and lim.queued == 0
    run(main)


def test_limiter_refuses_past_the_queue_with_a_sentence_and_retry_after():
    async def main():
        lim = Limiter(1, queue_limit=1)
        first = await lim.acquire()
        async with trio.open_nursery() as n:
            n.start_soon(lim.acquire)  # waits
            await trio.sleep(0.1)
            with pytest.raises(HostBusyError) as info:
                await lim.acquire()
            e = info.value
            assert isinstance(e, GenerationError) and e.running == 1 and e.queued == 1 and e.retry_after_s >= 1
            assert str(e).startswith("The host is busy: 1 request(s) are being served") and "retry in about" in str(e)
            assert "--" not in str(e)  # no command-line flags: the HTTP API shows it as is
            lim.release(first)
        assert lim.running == 1  # the waiter got the slot (and holds it: it never released)
    run(main)


def test_a_waiter_whose_client_leaves_gives_up_its_place():
    async def main():
        lim = Limiter(1, queue_limit=4)
        first = await lim.acquire()
        gone = trio.Event()
        got: dict = {}

        async def waiter(name, abandoned=None):
            got[name] = await lim.acquire(abandoned=abandoned)

        async with trio.open_nursery() as n:
            n.start_soon(waiter, "leaves", gone)
            await trio.sleep(0.1)
            n.start_soon(waiter, "stays")
            await trio.sleep(0.1)
            assert lim.queued == 2
            gone.set()
            await trio.sleep(0.1)
            assert got["leaves"] is None and lim.queued == 1
            lim.release(first)
        assert got["stays"] is not None and lim.running == 1 and lim.queued == 0
    run(main)


def test_a_cancelled_waiter_leaves_the_queue_and_a_granted_one_hands_its_slot_on():
    async def main():
        lim = Limiter(1, queue_limit=4)
        first = await lim.acquire()
        with trio.move_on_after(1.0):
            await lim.acquire()  # cancelled while it waits
        assert lim.queued == 0 and lim.running == 1
        got, scopes = {}, {}

        async def waiter(name):
            with trio.CancelScope() as scope:
                scopes[name] = scope
                got[name] = await lim.acquire(abandoned=trio.Event())

        async with trio.open_nursery() as n:
            n.start_soon(waiter, "a")
            await trio.sleep(0.1)
            n.start_soon(waiter, "b")
            await trio.sleep(0.1)
            lim.release(first)  # granted to "a" ...
            scopes["a"].cancel()  # ... which is cancelled before it leaves acquire: "b" gets the slot
            await trio.sleep(0.1)
        assert "a" not in got and got["b"] is not None
        assert lim.running == 1 and lim.queued == 0
    run(main)
