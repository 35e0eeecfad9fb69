"""Cancelling a request on the ring (kafilad/node/serving/ring.py `RingMember.cancel`; issue 9 "Cancellation").

Real stages (MLX) on a ring of RingMembers in one trio process, wired by Links over in-memory
streams (the harness of test_ring_batch.py). A request cancelled mid-decode ends within 2 decode
steps, its KV rows are dropped on every member, the request batched with it goes on
token-identical, and its state says why and after how many tokens; a request cancelled while its
prefill is out ends with no token; a cancel that reaches a head before the request started there
(a remote head reading the host's `cancel` frame first) makes that request end before it starts.
"""

from __future__ import annotations

import pytest
import trio
from trio.testing import trio_test

from kafilad.errors import GenerationCancelled
from node.test_ring_batch import BOUNDS, _ignore, alone, ring_of, synth_model  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


def no_rows_left(members) -> bool:
    return all(not list(m.runner.active_requests) for m in members)


@trio_test
async def test_a_cancelled_request_ends_within_two_steps_and_frees_every_stage(synth_model):
    other_alone = (await alone(synth_model, BOUNDS, {"b": ("The cat sat", 24, None)}))["b"]
    async with ring_of(synth_model, BOUNDS) as ring:
        head = ring[0]
        states: dict = {}
        at_cancel: dict = {}

        async def cancel_at_five(ev):
            if ev["token_id"] is not None and len(head._streams["a"].generated) == 5 and "a" not in at_cancel:
                at_cancel["a"] = len(head._streams["a"].generated)
                assert head.cancel("a", "The client went away.")

        async def run(req, prompt, n, on_event):
            states[req] = await head.generate(req, prompt, max_tokens=n, temperature=0.0, on_event=on_event)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a", "Once upon a time", 200, cancel_at_five)
            nursery.start_soon(run, "b", "The cat sat", 24, _ignore)
        a, b = states["a"], states["b"]
        assert a.cancelled == "The client went away." and a.error == "The client went away."
        assert a.cancelled_at_tokens == 5 and 5 <= len(a.generated) <= 5 + 2  # ended within 2 steps
        assert b.error is None and b.generated == other_alone  # the batched neighbour went on unchanged
        assert max(b.batch_rows) == 2  # they really shared decode steps
        assert [row[0] for row in a.end_stats] == ["p0", "p1", "p2"]  # its `end` went round every member
        assert no_rows_left(ring) and not head.scheduler.requests
        assert not head.cancel("a", "again")  # finished: nothing to cancel


@trio_test
async def test_a_request_cancelled_during_its_prefill_ends_without_a_token(synth_model):
    async with ring_of(synth_model, BOUNDS) as ring:
        head = ring[0]
        state = {}

        async def run():
            state["a"] = await head.generate("a", "Once upon a time " * 20, max_tokens=50, temperature=0.0,
                                             on_event=_ignore)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            while "a" not in head._streams:  # generate has registered the request and sent its prefill
                await trio.sleep(0)
            assert head.scheduler.requests["a"].phase.value == "prefilling"
            assert head.cancel("a", "The client went away.")
        assert state["a"].cancelled and state["a"].generated == [] and state["a"].text == ""
        assert no_rows_left(ring)
        ok = await head.generate("c", "Once upon a time", max_tokens=4, temperature=0.0, on_event=_ignore)
        assert ok.error is None and len(ok.generated) == 4  # the ring serves on


@trio_test
async def test_a_cancel_that_arrives_before_the_request_ends_it_before_it_starts(synth_model):
    async with ring_of(synth_model, BOUNDS) as ring:
        head = ring[0]
        assert not head.cancel("early", "The client went away.")  # unknown and not remembered
        assert not head.cancel("early", "The client went away.", before_start=True)  # remembered
        with pytest.raises(GenerationCancelled, match="The client went away"):
            await head.generate("early", "Once", max_tokens=4, temperature=0.0, on_event=_ignore)
        assert not head.scheduler.requests and no_rows_left(ring)
        st = await head.generate("early", "Once", max_tokens=4, temperature=0.0, on_event=_ignore)
        assert st.error is None and len(st.generated) == 4  # remembered once only
