"""Speculative decoding on a ring of RingMembers (issue 24 item 1; kafilad/node/serving/drafts.py, ring.py;
proto_spec 05 §3.1).

Real stages on three members in one trio process, the real frame codec on every hop. A lone
greedy request gets the same tokens with speculation on (`KAFILA_SPECULATE` unset: adaptive k, or
a fixed k) as with it off, while drafts are accepted (the head's counters and the request's record
say so); requests that speculated alone and then decode in a batch with others keep their tokens
(their stages trim before the batch merges them); a model whose caches cannot be trimmed is off,
with the reason in the status.
"""

from __future__ import annotations

import pytest
import trio
from trio.testing import trio_test

from kafila_testing import STORIES_PROMPT
from kafilad.node.serving.drafts import SPECULATE_ENV, speculation_setting
from kafilad.node.serving.ring_state import WireStage
from tests.node.test_ring_batch import _ignore, generate_all, ring_of

BOUNDS = [(0, 2), (2, 4), (4, 5)]
_RUN_BATCH = WireStage.run_batch


def record_trims(monkeypatch) -> list:
    """Record each batched act's `trims` as a member runs it (WireStage.run_batch); returns the list."""
    trims: list = []

    def recording(self, rids, h_wire, group=0, trims_=()):
        trims.append(tuple(trims_))
        return _RUN_BATCH(self, rids, h_wire, group, trims_)
    monkeypatch.setattr(WireStage, "run_batch", recording)
    return trims


@pytest.fixture(scope="module")
def repeat_prompt(stories260k):
    """The model's own greedy continuation of the story prompt, then the prompt again: it tells the
    story much as it did, so lookup drafts well."""
    import os
    kept = os.environ.get(SPECULATE_ENV)
    os.environ[SPECULATE_ENV] = "0"
    try:
        st, _ = trio.run(_one, stories260k, STORIES_PROMPT, 64)
    finally:
        os.environ.pop(SPECULATE_ENV) if kept is None else os.environ.__setitem__(SPECULATE_ENV, kept)
    return f"{STORIES_PROMPT}{st.text}\n{STORIES_PROMPT}"


async def _one(model_dir, prompt, max_tokens, temperature=0.0):
    async with ring_of(model_dir, BOUNDS, batching=True) as ring:
        st = await ring[0].generate("r", prompt, max_tokens=max_tokens, temperature=temperature, on_event=_ignore)
        await trio.sleep(0.05)  # the end frame goes round
        assert all(not m.runner.active_requests for m in ring)
        return st, ring[0].drafter.status()


@pytest.mark.parametrize("setting", ["auto", "k=4"])
@trio_test
async def test_speculation_keeps_greedy_tokens_and_accepts_drafts(stories260k, repeat_prompt, monkeypatch, setting):
    with trio.fail_after(120):
        monkeypatch.setenv(SPECULATE_ENV, "0")
        off, off_status = await _one(stories260k, repeat_prompt, 48)
        monkeypatch.setenv(SPECULATE_ENV, setting)
        on, status = await _one(stories260k, repeat_prompt, 48)
    assert off.error is None and on.error is None
    assert on.generated == off.generated and on.text == off.text
    assert len(on.generated) == 48
    assert off_status["passes"] == 0 and off_status["on"] is False and "KAFILA_SPECULATE=0" in off_status["why"]
    assert status["on"] is True and status["accepted"] > 0 and status["passes"] > 0
    assert on.accepted == status["accepted"] and on.drafted == status["drafted"]
    assert on.decode_passes < off.decode_passes  # fewer round trips for the same tokens


@trio_test
async def test_a_miss_prompt_backs_off_to_plain_passes(stories260k, monkeypatch):
    monkeypatch.setenv(SPECULATE_ENV, "auto")
    with trio.fail_after(120):
        on, status = await _one(stories260k, STORIES_PROMPT, 40)
    monkeypatch.setenv(SPECULATE_ENV, "0")
    with trio.fail_after(120):
        off, _ = await _one(stories260k, STORIES_PROMPT, 40)
    assert on.generated == off.generated
    assert status["plain_passes"] > status["passes"]  # k went to 0 for most passes


@trio_test
async def test_requests_that_speculated_alone_keep_their_tokens_in_a_batch(stories260k, repeat_prompt, monkeypatch):
    monkeypatch.setenv(SPECULATE_ENV, "0")
    jobs = {"a": (repeat_prompt, 40, None), "b": (STORIES_PROMPT, 24, ("a", 12)), "c": (repeat_prompt, 20, ("b", 3))}
    with trio.fail_after(180):
        async with ring_of(stories260k, BOUNDS) as ring:
            ref = {r: (await ring[0].generate(r, p, max_tokens=n, temperature=0.0, on_event=_ignore)).generated
                   for r, (p, n, _) in jobs.items()}
        monkeypatch.setenv(SPECULATE_ENV, "k=4")
        trims = record_trims(monkeypatch)
        async with ring_of(stories260k, BOUNDS) as ring:
            states = await generate_all(ring[0], jobs)
            status = ring[0].drafter.status()
    assert {r: st.generated for r, st in states.items()} == ref
    assert trims  # batched acts ran (whether one carried a trim depends on timing: see the test below)
    assert status["accepted"] > 0  # "a" speculated alone before the others joined
    assert max(states["b"].batch_rows, default=1) > 1  # and they did decode together


@trio_test
async def test_sampled_speculation_streams_its_tokens(stories260k, repeat_prompt, monkeypatch):
    monkeypatch.setenv(SPECULATE_ENV, "k=4")
    with trio.fail_after(120):
        st, status = await _one(stories260k, repeat_prompt, 32, temperature=0.7)
    assert st.error is None and len(st.generated) == 32 and status["passes"] > 0


def test_setting_parses_and_refuses_bad_values():
    assert speculation_setting({}) is None
    assert speculation_setting({SPECULATE_ENV: "off"}) == 0
    assert speculation_setting({SPECULATE_ENV: "k=3"}) == 3
    for bad in ("k=0", "fast", "k=x", "-1"):
        with pytest.raises(ValueError, match=SPECULATE_ENV):
            speculation_setting({SPECULATE_ENV: bad})


@trio_test
async def test_a_member_trims_rows_before_a_batched_act_and_forwards_the_field(stories260k):
    import mlx.core as mx

    from kafilad.executor import runner as runner_mod
    from tests.node.test_ring_batch import make_members
    head, member = make_members(stories260k, [(0, 2), (2, 5)], batching=True)
    from kafilad.node.serving.ring_state import run_on_mlx_thread

    def setup():  # on the MLX thread, where the member's calls run
        for rid, n in (("a", 9), ("b", 6)):
            member.runner.run(rid, head.runner.head_embed_and_run(rid, list(range(1, n + 1))))
        return runner_mod.array_to_wire(mx.zeros((2, 1, 64))), runner_mod.array_to_wire(mx.zeros((1, 1, 64)))
    h, h1 = await run_on_mlx_thread(setup)
    await member._on_frame({"t": "act", "reqs": ["a", "b"], "mb": 0, "sample": True, "h": h, "hops": [],
                            "trims": [3, 0]})
    fwd = member._inbox_recv.receive_nowait()
    assert fwd["trims"] == [3, 0] and fwd["reqs"] == ["a", "b"]
    lengths = await run_on_mlx_thread(lambda: [member.runner.cache_length(r) for r in ("a", "b")])
    assert lengths == [9 - 3 + 1, 6 + 1]  # (cache_length takes a row out of its batch: on the MLX thread)
    await member._on_frame({"t": "act", "req": "a", "sample": True, "h": h1, "hops": [], "trim": 2})
    assert member._inbox_recv.receive_nowait()["trim"] == 2
    assert await run_on_mlx_thread(member.runner.cache_length, "a") == 7 - 2 + 1
    member.prev_name = "m0"
    await member._on_frame({"t": "act", "req": "b", "sample": True, "h": h, "hops": [], "trim": -1})
    assert member.broken is not None and "malformed" in member.broken and "m0" in member.broken


@pytest.mark.parametrize("setting,micro_batches", [("auto", "1"), ("k=4", "1"), ("k=4", "2"), ("k=4", "3")])
@trio_test
async def test_batches_and_micro_batches_speculate_and_keep_every_rows_tokens(stories260k, repeat_prompt,
                                                                              monkeypatch, setting, micro_batches):
    """Three requests decoding together draft in every pass: in one lockstep batch (every row the
    same k, each accepting its own count, the members trimming rows in place), in two micro-batches
    (a batch and a request in the single form) and in three (each request its own single-form
    passes). Each request's tokens are those it gets with speculation off, with fewer steps."""
    jobs = {"a": (repeat_prompt, 40, None), "b": (repeat_prompt + " Once", 36, None),
            "c": (STORIES_PROMPT, 32, None)}
    monkeypatch.setenv("KAFILA_MICRO_BATCHES", micro_batches)
    runs = {}
    for mode in ("0", setting):
        monkeypatch.setenv(SPECULATE_ENV, mode)
        trims = record_trims(monkeypatch)
        with trio.fail_after(180):
            async with ring_of(stories260k, BOUNDS) as ring:
                states = await generate_all(ring[0], jobs)
                await trio.sleep(0.05)
                runs[mode] = (states, ring[0].drafter.status(), ring[0].decode_steps, trims,
                              [list(m.runner.active_requests) for m in ring])
    (off, _, off_steps, _, _), (on, status, on_steps, trims, left) = runs["0"], runs[setting]
    assert {r: st.generated for r, st in on.items()} == {r: st.generated for r, st in off.items()}
    assert all(st.error is None and len(st.generated) == jobs[r][1] for r, st in on.items())
    widest = max(max(st.batch_rows) for st in on.values())
    assert widest == {"1": 3, "2": 2, "3": 1}[micro_batches]  # how they decoded together
    assert status["passes"] > 0 and status["accepted"] > 0
    assert on["a"].accepted > 0 and on["b"].accepted > 0
    if micro_batches == "1":
        assert any(any(t) for t in trims)  # rows were trimmed in a batched act
    assert (status["batch_passes"] > 0) is (micro_batches != "3")  # three micro-batches are single-form
    assert on_steps < off_steps
    assert left == [[], [], []]


@pytest.mark.parametrize("micro_batches", ["1", "2"])
@trio_test
async def test_a_client_gone_while_a_drafted_batch_is_out_ends_only_its_request(stories260k, repeat_prompt,
                                                                                monkeypatch, micro_batches):
    """A client that stops reading its stream (a full stream ends its request) or is cancelled while
    a drafted batched pass is out: its request ends when the pass returns, the head verifies the
    other rows only (the ended row's caches are gone), and the others get their tokens."""
    monkeypatch.setenv(SPECULATE_ENV, "0")
    with trio.fail_after(120):
        async with ring_of(stories260k, BOUNDS) as ring:
            ref = {r: (await ring[0].generate(r, p, max_tokens=30, temperature=0.0, on_event=_ignore)).generated
                   for r, p in (("a", repeat_prompt), ("b", repeat_prompt + " Once"))}
    monkeypatch.setenv(SPECULATE_ENV, "k=4")
    monkeypatch.setenv("KAFILA_MICRO_BATCHES", micro_batches)
    release, states = trio.Event(), {}

    async def stuck(_e):
        await release.wait()
    with trio.fail_after(120):
        async with ring_of(stories260k, BOUNDS, stream_events=4) as ring:
            head = ring[0]
            cancelled = []
            real = head._on_act

            async def on_act(frame):  # the cancel arrives while a drafted batched pass is out
                if not cancelled and getattr(frame, "reqs", ()) and len(frame.reqs) > 1 and frame.h["shape"][1] > 1:
                    cancelled.append(head.cancel("gone", "its client went away"))
                await real(frame)
            head._on_act = on_act

            async def go(r, p, n, ev):
                states[r] = await head.generate(r, p, max_tokens=n, temperature=0.0, on_event=ev)
            async with trio.open_nursery() as n:
                n.start_soon(go, "slow", repeat_prompt, 40, stuck)
                n.start_soon(go, "gone", repeat_prompt, 40, _ignore)
                n.start_soon(go, "a", repeat_prompt, 30, _ignore)
                n.start_soon(go, "b", repeat_prompt + " Once", 30, _ignore)
                while not ("a" in states and "b" in states):
                    await trio.sleep(0.01)
                release.set()
            await trio.sleep(0.05)
            left = [list(m.runner.active_requests) for m in ring]
            broken, status = head.broken, head.drafter.status()
    assert broken is None
    assert {r: states[r].generated for r in ("a", "b")} == ref
    assert states["slow"].cancelled is not None and "fast enough" in states["slow"].cancelled
    assert cancelled == [True] and states["gone"].cancelled is not None
    assert status["batch_passes"] > 0
    assert left == [[], [], []]


@trio_test
async def test_a_plain_batched_step_returning_more_positions_breaks_the_ring(stories260k, monkeypatch):
    """The head sent a batched step of one token a row; an act that returns with two positions a
    row (a member that is wrong or lying) breaks the ring naming the sender, and no token is
    sampled from it."""
    import mlx.core as mx

    from kafilad.executor import runner as runner_mod
    monkeypatch.setenv(SPECULATE_ENV, "0")
    real = WireStage.run_batch

    def doubled(self, rids, h_wire, group=0, trims=()):
        a = runner_mod.array_from_wire(real(self, rids, h_wire, group, trims))
        return runner_mod.array_to_wire(mx.concatenate([a, a], axis=1)) if self.runner.stage.end == 5 else \
            runner_mod.array_to_wire(a)
    monkeypatch.setattr(WireStage, "run_batch", doubled)
    with trio.fail_after(120):
        async with ring_of(stories260k, BOUNDS) as ring:
            ring[0].prev_name = "m2"
            states = await generate_all(ring[0], {"a": (STORIES_PROMPT, 20, None), "b": ("The cat", 20, None)})
            broken = ring[0].broken
    assert broken is not None and "m2" in broken and "positions a row" in broken
    assert all(st.error is not None for st in states.values())
