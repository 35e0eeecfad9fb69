"""Issue 7 "Session tests at the right level": the session drivers, whole, in one trio run.

A real HostSession and real MemberSessions (kafilad/node/session/host.py, host_requests.py, member.py)
with the real rendezvous over in-memory WebSockets and ring edges over the in-memory NAT
network (tests/node/session_harness.py); a synthesised 3-block model on MLX. Each test forms a
session and drives one story: formation and generation (head on the host, and on a member),
admission, a member cut off, a rejoin, a malformed frame, the host's close, liveness.
"""

from __future__ import annotations

import json

import pytest
import trio
from trio.testing import trio_test

from kafila_testing import reference_tokens
from kafilad.errors import GenerationCancelled, GenerationError, SessionError
from kafilad.proto.session import HostState, MemberState
from node.session_harness import CAPABILITY, generate, session_world, shrink_liveness

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PROMPT = "Once upon a time"
N_TOKENS = 12
#: seconds a formed session stands ready before a member is cut off (the form_s test)
SETTLE_S = 1.0
#: what form_s (time.perf_counter) and the trace's ts (time.time) may drift apart over a test
CLOCKS_S = 0.05


@pytest.fixture(scope="module")
def model_dir(session_model):
    return session_model


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy tokens of single-process mlx-lm on the model (tests/kafila_testing.py)."""
    return reference_tokens(model_dir, PROMPT, N_TOKENS)


def planned(h) -> dict:
    """{name: [start, end]} of the host's current plan, for members not lost."""
    return {m["name"]: m["blocks"] for m in h.snapshot()["members"] if m["blocks"] and not m["lost"]}


def member_row(h, name: str) -> dict:
    return next(m for m in h.snapshot()["members"] if m["name"] == name)


def trace_events(h) -> list[str]:
    """The session's own trace events (the paths' `path` records — classification, sizes — left out)."""
    path = h.node.state.trace_path(h.session_id)
    return [e for e in (json.loads(line)["event"] for line in path.read_text().splitlines()) if e != "path"]


def ready_over(h, names: set) -> bool:
    return h.state == HostState.READY and set(planned(h)) == names


@trio_test
async def test_a_host_and_two_members_form_and_generate_as_single_process_mlx_lm(tmp_path, model_dir, reference,
                                                                                monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, (m1, m2) = await w.form(2)
        assert planned(h) == {"h": [0, 1], "m1": [1, 2], "m2": [2, 3]}
        assert [e["path"] for e in h.snapshot()["edges"]] == ["direct"] * 3  # QUIC over the simulated NATs
        assert m1.state == m2.state == MemberState.READY and m1.host_name == "h"
        result = await generate(h, PROMPT, N_TOKENS)
        assert result["token_ids"] == reference
        assert [ev["token_id"] for ev in result["events"]] == reference  # streamed as generated
        assert trace_events(h)[:2] == ["session_opened", "plan"] and "generation" in trace_events(h)


@trio_test
async def test_a_head_on_a_member_serves_through_its_ctl_link_and_its_loss_moves_the_head(tmp_path, model_dir,
                                                                                         reference, monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        w.host_capability = {**CAPABILITY, "bandwidth_Bps": CAPABILITY["bandwidth_Bps"] / 20}  # a slow host
        # the members' reports are trusted, so one heads from the first plan (by default only once its report
        # is confirmed by its measured stage: issue 22 item 5, tests/e2e/test_member_reports_checked.py)
        h, ms = await w.form(2, head_any=True)
        head = h.machine.head()
        assert not head.is_host, h.snapshot()["plan"]
        result = await generate(h, PROMPT, N_TOKENS)  # gen / gen_event / gen_done (proto_spec 05 §2)
        assert result["token_ids"] == reference
        assert [ev["token_id"] for ev in result["events"]] == reference

        gone = trio.Event()  # the client goes away after 2 tokens: a `cancel` frame ends it at the head

        async def leave_after_2(n: int) -> None:
            if n == 2:
                gone.set()
        with pytest.raises(GenerationCancelled, match=r"ended after \d+ tokens: The client went away") as cancelled:
            await generate(h, PROMPT, 200, on_token=leave_after_2, gone=gone)
        assert cancelled.value.tokens < 20, cancelled.value  # within a few decode steps, not at max_tokens

        head_session = next(m for m in ms if m.node.peer_id == head.peer_id)

        async def cut_after_3(n: int) -> None:
            if n == 3:
                await head_session.link.stream.transport.aclose()
        # the head is lost mid-stream: the host holds the request and what it streamed, runs it again
        # on the new head, and the stream goes on, each token once (issue 25 item 4)
        resumed = await generate(h, PROMPT, 200, on_token=cut_after_3)
        assert resumed["token_ids"] == reference_tokens(model_dir, PROMPT, 200)
        assert [ev["token_id"] for ev in resumed["events"] if ev["token_id"] is not None] == resumed["token_ids"]
        assert len(resumed["retried_after"]) == 1 and head.name in resumed["retried_after"][0], resumed["retried_after"]
        survivor = next(m.node.name for m in ms if m is not head_session)
        await w.wait(lambda: ready_over(h, {"h", survivor}), 20, "the replan without the head")
        assert h.machine.head().name == survivor  # the head moved to the other fast member
        assert (await generate(h, PROMPT, N_TOKENS))["token_ids"] == reference


@trio_test
async def test_a_pending_member_is_admitted_and_another_denied(tmp_path, model_dir, monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h = await w.host(members=2, open_=False)
        denied = w.join_soon("m1", h.code)
        await w.wait(lambda: [p.name for p in h.pending.values()] == ["m1"], 10, "m1 pending")
        assert h.state == HostState.FORMING
        h.decide("m1", "deny")
        with trio.fail_after(10):
            await denied["done"].wait()
        assert isinstance(denied["error"], SessionError), denied
        assert str(denied["error"]) == ("The host refused this device with `kafila-ctl deny`; to try again, run "
                                        "`kafila-ctl join` again and ask the host to run `kafila-ctl admit m1`.")
        assert w.nodes["m1"].session.state == MemberState.FAILED and not h.pending

        admitted = w.join_soon("m2", h.code)
        await w.wait(lambda: [p.name for p in h.pending.values()] == ["m2"], 10, "m2 pending")
        await w.wait(lambda: any("waiting for the host to admit" in m for m in admitted["progress"]), 5,
                     "m2 told it waits")
        h.decide(w.nodes["m2"].peer_id, "admit")  # by peer id, as `kafila-ctl admit`
        with trio.fail_after(10):
            await admitted["done"].wait()
        m2 = admitted["session"]
        await w.wait(lambda: ready_over(h, {"h", "m2"}) and m2.state == MemberState.READY, 20, "formation")
        roster = h.node.state.load_roster()
        assert roster == {m2.node.peer_id: {"public_key": m2.node.public_key.hex(), "name": "m2"}}


@trio_test
async def test_a_member_cut_off_pauses_the_request_which_goes_on_and_the_host_replans(tmp_path, model_dir, reference,
                                                                               monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, (m1, m2) = await w.form(2)
        await trio.sleep(SETTLE_S)  # the session stands ready a while before the cut (form_s below)

        async def cut_after_3(n: int) -> None:
            if n == 3:
                await m2.link.stream.transport.aclose()  # its relayed ctl circuit closes
        # the host's loss of m2 and m2's own ring link closing race to fail the request's run: both name
        # m2; the request runs again on the healed ring and its stream goes on (issue 25 item 4)
        resumed = await generate(h, PROMPT, 200, on_token=cut_after_3)
        assert resumed["token_ids"] == reference_tokens(model_dir, PROMPT, 200)
        assert [ev["token_id"] for ev in resumed["events"] if ev["token_id"] is not None] == resumed["token_ids"]
        assert resumed["retried_after"] and all("m2" in why for why in resumed["retried_after"]), resumed
        await w.wait(lambda: ready_over(h, {"h", "m1"}), 20, "the replan over h and m1")
        assert member_row(h, "m2")["lost"] and not member_row(h, "m2")["ready"]
        await w.wait(lambda: m2.state == MemberState.FAILED, 5, "m2 failed")
        assert (await generate(h, PROMPT, N_TOKENS))["token_ids"] == reference
        events = trace_events(h)
        assert "member_lost" in events and "replanned" in events
        # each session_formed says what that formation took (a trial saw the re-formations' form_s grow with
        # the session's age: 666.9, 675.6, 691.1 s), while status keeps the first formation's
        path = h.node.state.trace_path(h.session_id)
        records = list(map(json.loads, path.read_text().splitlines()))
        formed = [e for e in records if e["event"] == "session_formed"]
        assert len(formed) >= 2 and formed[0]["form_s"] == h.snapshot()["form_s"], formed
        # the re-formation's form_s counts from its replan, which came after the 1 s the session stood
        # ready; counted from the session's start (the bug) it would span that second too. An order of
        # events, not a speed: it holds however slowly each step ran.
        age_s = formed[1]["ts"] - records[0]["ts"]  # from the session's first record to the re-formation
        assert 0 < formed[1]["form_s"] < age_s - SETTLE_S + CLOCKS_S, (formed, age_s)


@trio_test
async def test_a_member_that_rejoins_is_planned_back_in(tmp_path, model_dir, reference, monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, (m1, m2) = await w.form(2)
        await m2.link.stream.transport.aclose()
        await w.wait(lambda: ready_over(h, {"h", "m1"}) and m2.state == MemberState.FAILED, 20, "the replan")
        m2_again = await w.join("m2", h.code)  # as the daemon's rejoin does: a new session, the same key
        await w.wait(lambda: ready_over(h, {"h", "m1", "m2"}) and m2_again.state == MemberState.READY, 20,
                     "m2 planned back in")
        assert member_row(h, "m2")["lost"] is None
        assert (await generate(h, PROMPT, N_TOKENS))["token_ids"] == reference
        events = trace_events(h)
        assert "member_returned" in events and events.count("replanned") >= 2


@trio_test
async def test_a_malformed_control_frame_closes_only_that_members_link(tmp_path, model_dir, reference, monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, (m1, m2) = await w.form(2)
        await m1.link.send({"t": "capability", "memory_bytes": "lots"})
        await w.wait(lambda: ready_over(h, {"h", "m2"}), 20, "the replan over h and m2")
        lost = member_row(h, "m1")["lost"]
        assert "malformed capability frame: 'memory_bytes' is" in lost, lost
        await w.wait(lambda: m1.state == MemberState.FAILED, 5, "m1 failed")
        assert m2.state == MemberState.READY and "m2" in planned(h)
        assert (await generate(h, PROMPT, N_TOKENS))["token_ids"] == reference


@trio_test
async def test_the_hosts_close_tells_members_and_they_end_closed(tmp_path, model_dir, monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, ms = await w.form(2)
        await h.close()
        assert h.state == HostState.CLOSED
        await w.wait(lambda: all(m.state == MemberState.CLOSED for m in ms), 10, "members closed")
        for m in ms:
            assert "the host closed the session" in (m.error or ""), m.error
            assert m.node.state.remembered_session() is None  # forgotten: no rejoin
    events = trace_events(h)  # after the session task was cancelled too (its daemon's `leave`)
    assert events[-1] == "session_closed" and "session_failed" not in events, events


@trio_test
async def test_a_member_that_stops_reading_its_ctl_link_is_found_within_the_deadline(tmp_path, model_dir, reference,
                                                                                    monkeypatch):
    # short enough to keep the test quick, long enough that one in-process world starved of CPU for
    # a second (CI on two shared cores) does not make the *other* links miss their deadline too
    interval_s, deadline_s = 0.5, 2.5
    shrink_liveness(monkeypatch, interval_s=interval_s, deadline_s=deadline_s)
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, (m1, m2) = await w.form(2)
        w.freeze("m2")
        t0 = trio.current_time()
        await w.wait(lambda: member_row(h, "m2")["lost"] is not None, 60, "m2 lost")  # a hang guard
        found_s = trio.current_time() - t0
        # not before its deadline (less the ping it may have sent just before the freeze); how much
        # later depends on the machine's load, so is not asserted (tests/node/test_liveness.py times
        # the deadline under a mock clock)
        assert found_s >= deadline_s - interval_s, found_s
        assert "m2 sent nothing for" in member_row(h, "m2")["lost"]  # liveness found it: no socket closed
        await w.wait(lambda: ready_over(h, {"h", "m1"}), 20, "the replan over h and m1")
        assert (await generate(h, PROMPT, N_TOKENS))["token_ids"] == reference
        w.thaw("m2")
        await w.wait(lambda: m2.state == MemberState.FAILED, 5, "m2 failed")


# ---- driver bugs these scenarios found (fixed in host.py / ring.py) --------------------------------

@trio_test
async def test_a_request_in_flight_when_the_host_closes_fails_with_the_close_reason(tmp_path, model_dir,
                                                                                  monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, ms = await w.form(2)

        async def close_after_3(n: int) -> None:
            if n == 3:
                w.nursery.start_soon(h.close)  # `kafila-ctl leave` on the host, from another task
        with pytest.raises(GenerationError) as failed:
            await generate(h, PROMPT, 200, on_token=close_after_3)
        assert "the host closed the session" in str(failed.value)
        assert "member ?" not in str(failed.value) and "unreachable" not in str(failed.value), failed.value


@trio_test
async def test_a_host_that_loses_its_rendezvous_connection_re_registers_and_members_rejoin(tmp_path, model_dir,
                                                                                          reference, monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, (m1, m2) = await w.form(2)
        await w.cut("h")
        await w.wait(lambda: m1.state == m2.state == MemberState.FAILED, 5, "the members' ctl links ended")
        await w.wait(lambda: h.snapshot()["rendezvous"] == "connected", 10, "the host re-registered")
        assert h.state != HostState.FAILED, h.error
        rejoined = [await w.join(name, h.code) for name in ("m1", "m2")]  # as their daemons rejoin
        await w.wait(lambda: ready_over(h, {"h", "m1", "m2"}) and all(m.state == MemberState.READY for m in rejoined),
                     30, "the members planned back in")
        assert (await generate(h, PROMPT, N_TOKENS))["token_ids"] == reference


# ---- a member that returns while a request runs (a new user's report, 2026-12-01) ------------------
# kill -9 a member and restart it while a long request ran on the survivors: the host planned it back
# in, the new plan moved the blocks, the old ring was torn down under the request, and the request never
# ended (`status`: running 1 for good; later requests queued until the host restarted). Now the new plan
# waits for the ring to drain (host_requests.drain_for); what still runs then fails with a sentence.

LONG_TOKENS = 120


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
                await w.wait(lambda: h.snapshot()["plan_waits"] is not None, 20, "the new plan waiting")
                waits = h.snapshot()["plan_waits"]  # status says what the session waits for
                assert waits["requests"] == 1 and "long" not in out, waits
                from io import StringIO
                from rich.console import Console
                from kafila_ctl.render import status_renderable
                buf = StringIO()
                Console(file=buf, width=300).print(status_renderable({**h.snapshot(), "name": "h", "session": h.session_id}))
                assert "switching to a new plan (a member joined or returned) once 1 running request(s) finish" \
                    in buf.getvalue()
                await w.wait(lambda: ready_over(h, {"h", "m1", "m2"}) and m2_again.state == MemberState.READY, 40,
                             "m2 planned back in")
        assert out["long"]["token_ids"] == long_ref  # it ran to its end on the plan it started under
        assert h.snapshot()["requests"]["running"] == 0 and h.snapshot()["plan_waits"] is None
        assert (await generate(h, PROMPT, N_TOKENS))["token_ids"] == reference  # the new plan serves


@trio_test
async def test_a_request_still_running_when_the_wait_runs_out_runs_again_on_the_new_plan_and_goes_on(
        tmp_path, model_dir, reference, monkeypatch):
    from kafilad.node.serving import host_requests
    from kafilad.proto import session as sm
    monkeypatch.setattr(host_requests, "DRAIN_WAIT_S", 0.3)
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        long_ref = reference_tokens(model_dir, PROMPT, LONG_TOKENS)
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
            out["result"] = await generate(h, PROMPT, LONG_TOKENS, on_token=very_slow_client)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_request)
                await started.wait()
                m2_again = await w.join("m2", h.code)
                await w.wait(lambda: ready_over(h, {"h", "m1", "m2"}) and m2_again.state == MemberState.READY, 40,
                             "m2 planned back in")
        # the new plan ended its run; it ran again on the new ring and its stream went on (issue 25 item 4)
        assert out["result"]["token_ids"] == long_ref and out["result"]["retried_after"] == [sm.PLAN_SWITCHED], out
        assert [ev["token_id"] for ev in out["result"]["events"] if ev["token_id"] is not None] == long_ref
        assert h.snapshot()["requests"] == {**h.snapshot()["requests"], "running": 0, "queued": 0}
        assert (await generate(h, PROMPT, N_TOKENS))["token_ids"] == reference
