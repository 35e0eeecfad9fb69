"""Batched decode round a real ring (DESIGN §6 "Batched decode", §9 item 4; kafilad/node/serving/ring.py).

Real daemons on loopback: concurrent requests decode in lockstep batches and each gets exactly
the tokens it gets alone (greedy), requests of different lengths join and leave the batch, and a
member killed mid-batch fails every request in the batch with that member's name.
"""

from __future__ import annotations

import re
import signal

import pytest
import trio

from kafila_ctl.demo import LoopbackCluster
from kafila_testing import STORIES_PROMPT, STORIES_REFERENCE_IDS
from kafilad.errors import KafilaError

pytestmark = pytest.mark.slow

# different prompts and lengths: the short ones leave the batch while the long one decodes on
JOBS = [("Kafila serves", 40), ("The ring", 12), ("Once upon a time", 25), ("A caravan of machines", 33)]


def run_concurrently(c: LoopbackCluster, jobs, *, late: tuple = ()) -> dict:
    """Generate every job through the host at once; a job listed in `late` starts once the first
    job has streamed 4 tokens (it joins a batch already decoding). Returns prompt -> result."""
    out, first_tokens = {}, trio.Event()

    async def one(prompt, n, stream_first=False):
        if prompt in late:
            await first_tokens.wait()
        tokens, result = 0, None
        async for kind, body in c.client(0).stream("generate", prompt=prompt, max_tokens=n):
            if kind == "event":
                tokens += 1
                if stream_first and tokens == 4:
                    first_tokens.set()
            else:
                result = body
        out[prompt] = result

    async def main():
        async with trio.open_nursery() as nursery:
            for i, (prompt, n) in enumerate(jobs):
                nursery.start_soon(one, prompt, n, i == 0)
    trio.run(main)
    return out


def head_batches(c: LoopbackCluster, status: dict) -> list[int]:
    """The largest decode step (requests) of every request the head finished, from its log."""
    head = next(m["name"] for m in status["members"] if m["head"])
    log = (c.root / f"{head}.log").read_text()
    return [int(x) for x in re.findall(r"its decode steps carried up to (\d+) requests", log)]


def check_batched_equals_alone(c: LoopbackCluster, model, jobs, *, late=()) -> dict:
    status = c.form(str(model), concurrency=len(jobs))["status"]
    alone = {p: c.generate(p, n)["token_ids"] for p, n in jobs}
    assert head_batches(c, status) == [1] * len(jobs)  # alone: every decode step carried one request
    together = run_concurrently(c, jobs, late=late)
    assert {p: r["token_ids"] for p, r in together.items()} == alone
    assert len({tuple(t) for t in alone.values()}) == len(jobs)  # the prompts really differ
    assert max(head_batches(c, status)[len(jobs):]) >= 3  # the concurrent requests shared decode steps
    for r in together.values():
        assert [s[0] for s in r["stats"]] and all(s[1] > 0 and s[2] > 0 and s[4] > 0 for s in r["stats"])
    return together


def test_synth_four_concurrent_requests_batch_and_match_alone(tmp_path, synth_llama):
    with LoopbackCluster(3, root=str(tmp_path / "c")) as c:
        got = check_batched_equals_alone(c, synth_llama, JOBS, late=("A caravan of machines",))
        assert {p: len(r["token_ids"]) for p, r in got.items()} == dict(JOBS)
        status = c.call(0, "status")
        assert status["state"] == "ready" and all(m["measured_stage_s"] > 0 for m in status["members"])


def test_stories260k_four_concurrent_requests_batch_and_match_alone(tmp_path, stories260k):
    jobs = [(STORIES_PROMPT, 40), ("The dog", 12), ("Lily and Tom", 30), ("One day, a bird", 21)]
    with LoopbackCluster(3, root=str(tmp_path / "c")) as c:
        got = check_batched_equals_alone(c, stories260k, jobs, late=("One day, a bird",))
        assert got[STORIES_PROMPT]["token_ids"] == STORIES_REFERENCE_IDS


def test_member_killed_mid_batch_pauses_every_request_which_goes_on_identical(tmp_path, synth_llama):
    """Every request of a batch streams when a member is killed: each pauses while the ring heals
    over the survivors, then goes on, its tokens those of the undisturbed greedy run (issue 25 item 4)."""
    with LoopbackCluster(3, root=str(tmp_path / "c")) as c:
        status = c.form(str(synth_llama), concurrency=4)["status"]
        victim = next(m["name"] for m in status["members"] if not m["head"] and m["name"] != "m0")
        vi = c.names.index(victim)
        prompts = [p for p, _ in JOBS]
        async def events_of(prompt):
            return [(b.get("token_id"), b.get("text")) async for kind, b in
                    c.client(0).stream("generate", prompt=prompt, max_tokens=120) if kind == "event"]
        reference = {p: trio.run(events_of, p) for p in prompts}  # undisturbed, one at a time
        streamed: dict = {p: [] for p in prompts}

        async def one(prompt):
            async for kind, body in c.client(0).stream("generate", prompt=prompt, max_tokens=120):
                if kind == "event":
                    streamed[prompt].append((body.get("token_id"), body.get("text")))
                    if all(len(n) >= 3 for n in streamed.values()) and c.daemons[vi].poll() is None:
                        c.daemons[vi].send_signal(signal.SIGKILL)  # every request is in the batch

        async def main():
            async with trio.open_nursery() as nursery:
                for p in prompts:
                    nursery.start_soon(one, p)
        trio.run(main)
        assert c.daemons[vi].wait(10) is not None  # the kill happened mid-batch
        assert streamed == reference  # each event once, in order: a pause, neither an error nor a repeat
        snap = c.call(0, "wait", states=["ready"], timeout_s=30)  # healed over the survivors (issue 8)
        assert [m for m in snap["members"] if m["name"] == victim][0]["lost"]
        for i, p in enumerate(c.daemons):
            if i != vi:
                assert p.poll() is None and c.call(i, "keys")["name"] == c.names[i]


def test_the_schedule_op_switches_modes_between_requests_and_tokens_stay_the_same(tmp_path, synth_llama):
    """`kafila-ctl schedule`: per-request passes, M pinned, back to auto — the same tokens each time."""
    with LoopbackCluster(3, root=str(tmp_path / "c")) as c:
        status = c.form(str(synth_llama), concurrency=4, strategy="uniform")["status"]
        assert next(m["name"] for m in status["members"] if m["head"]) == "m0"  # uniform: the head on the host
        assert c.call(0, "schedule")["mode"] == "auto"
        alone = {p: c.generate(p, n)["token_ids"] for p, n in JOBS}
        assert c.call(0, "schedule", mode="per-request")["mode"] == "per-request"
        steps = c.call(0, "status")["schedule"]["decode_steps"]
        got = run_concurrently(c, JOBS)
        assert {p: r["token_ids"] for p, r in got.items()} == alone
        assert c.call(0, "status")["schedule"]["decode_steps"] == steps  # no batched steps: each its own passes
        assert c.call(0, "schedule", mode="2")["mode"] == 2
        got = run_concurrently(c, JOBS)
        assert {p: r["token_ids"] for p, r in got.items()} == alone
        sched = c.call(0, "status")["schedule"]
        assert sched["pinned"] == 2 and sched["max_steps_in_flight"] == 2 and sched["decode_steps"] > steps
        with pytest.raises(KafilaError, match="Unknown schedule 'fast'"):
            c.call(0, "schedule", mode="fast")
        with pytest.raises(KafilaError, match="not possible"):
            c.call(0, "schedule", mode=0)
        with pytest.raises(KafilaError, match="not possible"):
            c.call(0, "schedule", mode="-4")  # out of range, not "unknown" (a new user's trial)
        with pytest.raises(KafilaError, match="5 micro-batches cannot be filled: at most 4 requests"):
            c.call(0, "schedule", mode="5")  # it was accepted, and status claimed 5 in flight
        assert c.call(0, "schedule", mode="auto")["mode"] == "auto"
