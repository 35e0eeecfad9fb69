"""A member that returns while a request runs (a new user's report, 2026-12-01).

kill -9 a member, restart it, while a long request ran on the survivors: the host planned the
returning member back in, the new plan moved the blocks, the old ring was torn down under the
request, and the request never ended — `status` showed `running: 1` for good and later requests
queued until the host restarted. Here a real HostSession and MemberSessions over the simulated
network (tests/node/session_harness.py), a synthesised 3-block model on MLX: the request in
flight when the member returns completes (the host lets the ring drain before it switches to the
new plan), its admission slot is freed, and the next request runs on the new plan.
"""

from __future__ import annotations

import pytest
import trio
from trio.testing import trio_test

from kafila_testing import reference_tokens
from kafilad.proto.session import HostState, MemberState
from node.session_harness import generate, session_world

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PROMPT = "Once upon a time"
N_TOKENS = 12
LONG_TOKENS = 120


@pytest.fixture(scope="module")
def model_dir(session_model):
    return session_model


@pytest.fixture(scope="module")
def reference(model_dir):
    return reference_tokens(model_dir, PROMPT, N_TOKENS)


def planned(h) -> dict:
    return {m["name"]: m["blocks"] for m in h.snapshot()["members"] if m["blocks"] and not m["lost"]}


def ready_over(h, names: set) -> bool:
    return h.state == HostState.READY and set(planned(h)) == names


@trio_test
async def test_a_request_in_flight_when_a_member_returns_completes_and_frees_its_slot(tmp_path, model_dir,
                                                                                       reference, monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, (m1, m2) = await w.form(2)
        await m2.link.stream.transport.aclose()  # m2 is lost: the host replans over h and m1
        await w.wait(lambda: ready_over(h, {"h", "m1"}) and m2.state == MemberState.FAILED, 20, "the replan")
        long_ref = reference_tokens(model_dir, PROMPT, LONG_TOKENS)
        started = trio.Event()
        out: dict = {}

        async def slow_client(n: int) -> None:  # a client reading at ~50 tokens/s keeps the request running
            if n == 3:
                started.set()
            await trio.sleep(0.02)

        async def long_request() -> None:
            out["long"] = await generate(h, PROMPT, LONG_TOKENS, on_token=slow_client)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_request)
                await started.wait()
                assert h.snapshot()["requests"]["running"] == 1
                m2_again = await w.join("m2", h.code)  # it returns while the request runs
                await w.wait(lambda: ready_over(h, {"h", "m1", "m2"}) and m2_again.state == MemberState.READY, 40,
                             "m2 planned back in")
        assert out["long"]["token_ids"] == long_ref  # it ran to its end on the plan it started under
        assert h.snapshot()["requests"]["running"] == 0
        assert (await generate(h, PROMPT, N_TOKENS))["token_ids"] == reference  # the new plan serves


@trio_test
async def test_a_request_still_running_when_the_wait_runs_out_fails_with_a_sentence_and_frees_its_slot(
        tmp_path, model_dir, reference, monkeypatch):
    from kafilad.errors import GenerationError
    from kafilad.node import host_requests
    from kafilad.proto import session as sm
    monkeypatch.setattr(host_requests, "DRAIN_WAIT_S", 0.3)
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, (m1, m2) = await w.form(2)
        await m2.link.stream.transport.aclose()
        await w.wait(lambda: ready_over(h, {"h", "m1"}) and m2.state == MemberState.FAILED, 20, "the replan")
        started = trio.Event()
        out: dict = {}

        async def very_slow_client(n: int) -> None:  # ~10 tokens/s: far longer than the wait
            if n == 3:
                started.set()
            await trio.sleep(0.1)

        async def long_request() -> None:
            try:
                await generate(h, PROMPT, LONG_TOKENS, on_token=very_slow_client)
            except GenerationError as e:
                out["error"] = str(e)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_request)
                await started.wait()
                m2_again = await w.join("m2", h.code)
                await w.wait(lambda: ready_over(h, {"h", "m1", "m2"}) and m2_again.state == MemberState.READY, 40,
                             "m2 planned back in")
        assert out["error"] == sm.PLAN_SWITCHED, out
        assert h.snapshot()["requests"] == {**h.snapshot()["requests"], "running": 0, "queued": 0}
        assert (await generate(h, PROMPT, N_TOKENS))["token_ids"] == reference
