"""RingMember's batched decode (DESIGN §6 "Batched decode"; kafilad/node/serving/ring.py; proto_spec 05 §3).

Real stages (MLX) on a ring of RingMembers in one trio process; the ring edges are Links over
trio's in-memory streams, so the real frame codec runs on every hop. Concurrent requests decode
in lockstep batches and get exactly the tokens each gets alone (greedy); requests of different
lengths join and leave the batch; one request whose consumer fails, or does not read, ends alone;
a broken ring drops every member's KV caches.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest
import trio
from trio.testing import memory_stream_pair, trio_test

from kafila_testing import STORIES_PROMPT, STORIES_REFERENCE_IDS
from kafilad.errors import GenerationError
from kafilad.executor import runner as runner_mod
from kafilad.executor.stage import load_stage_from_dir
from kafilad.executor.synth import load_tokenizer, synthesize_model
from kafilad.node.paths.link import Link
from kafilad.node.serving.ring import STREAM_EVENTS, RingMember, batching_enabled


@pytest.fixture(scope="module")
def synth_model(tmp_path_factory):
    return synthesize_model(tmp_path_factory.mktemp("ringbatch") / "llama", arch="llama", seed=5,
                            num_hidden_layers=5, hidden_size=64)


def make_members(model_dir, bounds, *, batching, stream_events=STREAM_EVENTS):
    tok = load_tokenizer(model_dir)
    members = []
    for i, (a, b) in enumerate(bounds):
        stage = load_stage_from_dir(model_dir, a, b, head=(i == 0))
        members.append(RingMember(peer_id=f"p{i}", name=f"m{i}", runner=runner_mod.StageRunner(stage),
                                  mlx_lock=trio.Lock(), head=(i == 0), tokenizer=tok if i == 0 else None,
                                  executor=runner_mod, batching=batching, stream_events=stream_events))
    return members


@asynccontextmanager
async def ring_of(model_dir, bounds, *, batching=True, stream_events=STREAM_EVENTS):
    """Members wired in ring order over in-memory streams, each running as in a daemon."""
    members = make_members(model_dir, bounds, batching=batching, stream_events=stream_events)
    async with trio.open_nursery() as nursery:
        n = len(members)
        if n > 1:
            for i, m in enumerate(members):
                nxt = members[(i + 1) % n]
                a, b = memory_stream_pair()
                m.next_link = Link(a, peer_id=nxt.peer_id, peer_name=nxt.name, label="ring")
                m.next_name = nxt.name
                m.next_is_head = (i + 1) % n == 0
                nursery.start_soon(nxt.feed_from, Link(b, peer_id=m.peer_id, peer_name=m.name, label="ring"))
        for m in members:
            nursery.start_soon(m.run)
        yield members
        nursery.cancel_scope.cancel()


async def generate_all(head, jobs, *, on_event=None):
    """Run jobs {req: (prompt, max_tokens, start_after_tokens_of)} concurrently; returns req -> state.

    A job with start_after=(other, k) starts once `other` has streamed k tokens."""
    states, streamed = {}, {r: [] for r in jobs}
    started = {r: trio.Event() for r in jobs}

    async def one(req, prompt, max_tokens):
        async def ev(e):
            streamed[req].append(e)
            if on_event:
                await on_event(req, e)
            for other, (_, _, after) in jobs.items():
                if after and after[0] == req and sum(x["token_id"] is not None for x in streamed[req]) == after[1]:
                    started[other].set()
        states[req] = await head.generate(req, prompt, max_tokens=max_tokens, temperature=0.0, on_event=ev)

    async with trio.open_nursery() as nursery:
        for req, (prompt, max_tokens, after) in jobs.items():
            async def go(req=req, prompt=prompt, max_tokens=max_tokens, after=after):
                if after:
                    await started[req].wait()
                await one(req, prompt, max_tokens)
            nursery.start_soon(go)
    for req, st in states.items():
        assert [e["token_id"] for e in streamed[req] if e["token_id"] is not None] == st.generated
        assert "".join(e["text"] for e in streamed[req]) == st.text
    return states


async def alone(model_dir, bounds, jobs):
    out = {}
    async with ring_of(model_dir, bounds, batching=True) as ring:
        for req, (prompt, max_tokens, _) in jobs.items():
            st = await ring[0].generate(req, prompt, max_tokens=max_tokens, temperature=0.0, on_event=_ignore)
            assert st.error is None and max(st.batch_rows, default=1) == 1
            out[req] = st.generated
        assert ring[0].max_batch_rows == 1
    return out


async def _ignore(_e):
    return None


JOBS = {  # different prompts and lengths; "d" joins once "a" has streamed 3 tokens
    "a": ("Once upon a time", 18, None),
    "b": ("The cat", 6, None),
    "c": ("Kafila serves a model", 11, None),
    "d": ("A late joiner", 9, ("a", 3)),
}
BOUNDS = [(0, 2), (2, 3), (3, 5)]


def check_stats(states, members):
    for st in states.values():
        assert st.error is None
        rows = {s[0]: s for s in st.end_stats}
        assert list(rows) == ["p0", "p1", "p2"]  # the head's row first; the end frame gathers the rest in ring order
        for pid, steps, total_s, median_s, nbytes in st.end_stats:
            assert steps == len(st.circuit_s)  # one step per pass of this request, prefill and decode
            assert 0 < total_s and 0 < median_s and nbytes > 0
        assert set(st.hop_compute_s) == {"p0", "p1", "p2"}
    for m in members:
        assert m.runner.active_requests == [] and m.runner.batch_ids == []
        assert m.req_steps == {} and m.req_share_s == {} and m.req_bytes == {}


@trio_test
async def test_concurrent_requests_batch_and_match_alone(synth_model):
    with trio.fail_after(120):
        expected = await alone(synth_model, BOUNDS, JOBS)
        async with ring_of(synth_model, BOUNDS) as ring:
            states = await generate_all(ring[0], JOBS)
            head = ring[0]
            assert {r: st.generated for r, st in states.items()} == expected
            assert {r: len(st.generated) for r, st in states.items()} == {"a": 18, "b": 6, "c": 11, "d": 9}
            assert max(states["a"].batch_rows) >= 3 and max(states["d"].batch_rows) >= 2  # d joined a batch
            assert head.max_batch_rows >= 3 and head.decode_rows > head.decode_steps
            assert states["a"].batch_rows[-1] == 1  # a, the longest, ends alone after the others left
            check_stats(states, ring)


@trio_test
async def test_batching_off_decodes_per_request_with_the_same_tokens(synth_model):
    assert batching_enabled({"KAFILA_BATCH": "0"}) is False and batching_enabled({}) is True
    with trio.fail_after(120):
        expected = await alone(synth_model, BOUNDS, JOBS)
        async with ring_of(synth_model, BOUNDS, batching=False) as ring:
            states = await generate_all(ring[0], JOBS)
            assert {r: st.generated for r, st in states.items()} == expected
            assert ring[0].decode_steps == 0 and all(st.batch_rows == [] for st in states.values())
            check_stats(states, ring)


@trio_test
async def test_a_next_step_run_with_sampling_but_batched_is_taken_back(synth_model, monkeypatch):
    """The head runs the next step of the rows it samples with their sampling when it expects the
    same rows next (ring.py `_sample`: a request alone, or a lockstep batch of all); forced to expect
    so always, every step that goes out with other rows (a joiner, a row ended) is taken back from
    the caches (`_take_back_fused`), and each request still gets its tokens alone."""
    with trio.fail_after(120):
        expected = await alone(synth_model, BOUNDS, JOBS)
        taken_back = []
        real = RingMember._take_back_fused

        async def counting(self, req):
            taken_back.append(req)
            await real(self, req)
        monkeypatch.setattr(RingMember, "_same_rows_next", lambda self, reqs: True)
        monkeypatch.setattr(RingMember, "_take_back_fused", counting)
        async with ring_of(synth_model, BOUNDS) as ring:
            states = await generate_all(ring[0], JOBS)
            assert {r: st.generated for r, st in states.items()} == expected
            assert ring[0].max_batch_rows >= 3 and len(taken_back) >= 3
            check_stats(states, ring)


@trio_test
async def test_a_ring_of_one_batches_too(synth_model):
    jobs = {k: v for k, v in JOBS.items() if k != "d"}
    with trio.fail_after(120):
        expected = await alone(synth_model, [(0, 5)], jobs)
        async with ring_of(synth_model, [(0, 5)]) as ring:
            states = await generate_all(ring[0], jobs)
            assert {r: st.generated for r, st in states.items()} == expected
            assert ring[0].max_batch_rows == 3
            assert ring[0].runner.active_requests == []


@trio_test
async def test_a_failing_consumer_ends_only_its_request(synth_model):
    async def on_event(req, e):
        if req == "b" and len(states_seen.setdefault(req, [])) == 2:
            raise trio.BrokenResourceError("the client went away")
        states_seen.setdefault(req, []).append(e)
    states_seen = {}
    with trio.fail_after(120):
        expected = await alone(synth_model, BOUNDS, JOBS)
        async with ring_of(synth_model, BOUNDS) as ring:
            states = {}
            jobs = {r: (p, n, None) for r, (p, n, _) in JOBS.items()}
            async with trio.open_nursery() as nursery:
                for req, (prompt, n, _) in jobs.items():
                    async def go(req=req, prompt=prompt, n=n):
                        async def ev(e):
                            await on_event(req, e)
                        states[req] = await ring[0].generate(req, prompt, max_tokens=n, temperature=0.0, on_event=ev)
                    nursery.start_soon(go)
            assert states["b"].error == "The request's output stream failed: the client went away."
            assert states["b"].generated == expected["b"][:3]
            for r in ("a", "c", "d"):
                assert states[r].error is None and states[r].generated == expected[r]
            assert all(m.runner.active_requests == [] for m in ring)


@trio_test
async def test_stories260k_batch_matches_reference(stories260k):
    jobs = {"ref": (STORIES_PROMPT, 40, None), "x": ("Once upon a time there was", 25, None),
            "y": ("The dog", 12, None), "z": ("Lily", 30, ("ref", 5))}
    bounds = [(0, 2), (2, 4), (4, 5)]
    with trio.fail_after(120):
        expected = await alone(stories260k, bounds, jobs)
        assert expected["ref"] == STORIES_REFERENCE_IDS
        async with ring_of(stories260k, bounds) as ring:
            states = await generate_all(ring[0], jobs)
            assert {r: st.generated for r, st in states.items()} == expected
            assert ring[0].max_batch_rows >= 3
            check_stats(states, ring)


@trio_test
async def test_malformed_ring_frame_breaks_the_ring_naming_the_sender(synth_model):
    """A frame the stage cannot take fails the request in flight and names the previous member."""
    async with ring_of(synth_model, [(0, 2), (2, 5)]) as (head, tail):
        tail.prev_name = "m0"
        good = await head.generate("a", "Kafila", max_tokens=3, temperature=0.0, on_event=_ignore)
        assert good.error is None and len(good.generated) == 3
        # the head's next member receives garbage activations from the head
        await head.next_link.send({"t": "act", "req": "x", "sample": True, "h": {"dtype": "float32",
                                                                               "shape": [1, 1, 64], "data": b"\0"}})
        with trio.fail_after(10):
            await tail.broken_event.wait()
        assert tail.broken_member == "m0" and "malformed ring frame" in tail.broken


@trio_test
async def test_a_ring_frame_missing_a_field_breaks_the_ring_with_the_decoders_sentence(synth_model):
    """A frame the decoder refuses (proto_spec 05 §3) breaks the ring naming the sender and the field."""
    async with ring_of(synth_model, [(0, 2), (2, 5)]) as (head, tail):
        tail.prev_name = "m0"
        await head.next_link.send({"t": "end", "stats": []})
        with trio.fail_after(10):
            await tail.broken_event.wait()
        assert tail.broken == ("member m0 is unreachable: it sent a malformed ring frame (MalformedFrame: "
                               "malformed end frame: 'req' is missing)")


@trio_test
async def test_a_client_that_does_not_read_ends_only_its_request(synth_model):
    """The ring never waits for a client: a stream left unread fills its buffer and ends alone."""
    release, seen, states = trio.Event(), [], {}

    async def stuck(e):  # a client that reads one event, then stops reading
        seen.append(e)
        await release.wait()

    with trio.fail_after(120):
        expected = await alone(synth_model, BOUNDS, {"slow": ("Once upon a time", 18, None),
                                                     "c": ("Kafila serves a model", 11, None)})
        async with ring_of(synth_model, BOUNDS, stream_events=4) as ring:
            head = ring[0]
            async with trio.open_nursery() as nursery:
                async def slow():
                    states["slow"] = await head.generate("slow", "Once upon a time", max_tokens=18, temperature=0.0,
                                                         on_event=stuck)
                nursery.start_soon(slow)
                await trio.sleep(0)
                # the other request completes while the slow client still has not read on
                states["c"] = await head.generate("c", "Kafila serves a model", max_tokens=11, temperature=0.0,
                                                  on_event=_ignore)
                assert states["c"].error is None and states["c"].generated == expected["c"]
                assert "slow" not in head.scheduler.requests and "slow" not in states  # ended; its client is behind
                assert len(seen) == 1
                release.set()
            st = states["slow"]
            assert st.error == ("The client did not read its stream fast enough; the request was ended with 4 "
                                "events waiting unread, so that the other requests could go on.")
            # the client gets what was buffered: the first event, then the 4 that waited
            assert [e["token_id"] for e in seen] == expected["slow"][:5]
            assert 5 <= len(st.generated) < 18 and st.generated == expected["slow"][:len(st.generated)]
            assert [r[0] for r in st.end_stats] == ["p0", "p1", "p2"]  # it ended round the ring as any request
            assert all(m.runner.active_requests == [] for m in ring)


@trio_test
async def test_a_client_that_goes_away_ends_its_request(synth_model):
    """A caller cancelled mid-stream (its HTTP client left) closes its stream; the ring ends the request."""
    with trio.fail_after(120):
        async with ring_of(synth_model, BOUNDS) as ring:
            head = ring[0]
            with trio.move_on_after(0) as scope:  # cancelled at its first checkpoint: no event is ever read
                await head.generate("gone", "Once upon a time", max_tokens=18, temperature=0.0, on_event=_ignore)
            assert scope.cancelled_caught
            done = await head.generate("next", "The cat", max_tokens=6, temperature=0.0, on_event=_ignore)
            assert done.error is None and len(done.generated) == 6
            with trio.fail_after(10):
                while "gone" in head.scheduler.requests:
                    await trio.sleep(0.01)
            assert all(m.runner.active_requests == [] for m in ring)


@trio_test
async def test_a_broken_ring_drops_every_kv_cache(synth_model):
    """fail_all (a member lost) fails every request and frees every request's KV rows on every member."""
    reason = "it left the session (test)"
    held, streamed = {}, {"a": 0, "b": 0}

    async def on_event(e):  # once both requests have streamed 2 tokens, the session loses m1
        streamed[e["req"]] += e["token_id"] is not None
        if min(streamed.values()) >= 2 and not held:
            held.update({m.name: sorted(m.runner.active_requests) for m in ring})
            for m in ring:
                m.fail_all(reason, member="m1")

    with trio.fail_after(120):
        async with ring_of(synth_model, BOUNDS) as ring:
            states = {}
            async with trio.open_nursery() as nursery:
                for req, prompt in (("a", "Once upon a time"), ("b", "The cat")):
                    async def go(req=req, prompt=prompt):
                        states[req] = await ring[0].generate(req, prompt, max_tokens=40, temperature=0.0,
                                                             on_event=on_event)
                    nursery.start_soon(go)
            assert {r: st.error for r, st in states.items()} == {r: f"member m1 is unreachable: {reason}" for r in "ab"}
            assert held == {"m0": ["a", "b"], "m1": ["a", "b"], "m2": ["a", "b"]}  # every stage held both
            with trio.fail_after(10):  # each member's ring loop drops them on the MLX thread
                while any(m.runner.active_requests for m in ring):
                    await trio.sleep(0.01)
            assert all(m.req_steps == {} and m.req_share_s == {} and m.req_bytes == {} for m in ring)
            with pytest.raises(GenerationError, match="member m1 is unreachable"):
                await ring[0].generate("c", "x", max_tokens=2, temperature=0.0, on_event=_ignore)
