"""Requests and status while a real in-process session heals (tests/node/session_harness.py).

A new user's report (2026-12-01): a request that arrived while the host recovered from a member
loss failed at once with 503 + Retry-After, and `status` kept each stage's measured time from the
plan before the loss. Here a real HostSession and MemberSessions, real ring and ctl links over the
simulated network, a synthesised 3-block model on MLX: after a loss, `status` shows no measured
stage time until the new plan has served a request, and a request through the control API's
`generate` and one through the OpenAI HTTP route, both arriving while the host heals, wait and are
served (kafilad/node/serving/host_requests.py `wait_serving`).
"""

from __future__ import annotations

import json

import pytest
import trio
from trio.testing import trio_test

from kafila_testing import reference_tokens
from kafilad.proto.session import HostState
from control.http_harness import exchange, http_request
from node.session_harness import generate, session_world

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PROMPT = "Once upon a time"
N_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(session_model):
    return session_model


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy tokens of single-process mlx-lm on the model (tests/kafila_testing.py)."""
    return reference_tokens(model_dir, PROMPT, N_TOKENS)


def measured(h) -> dict:
    """{name: measured_stage_s} of the members in the host's current plan (status's `meas. ms`)."""
    return {m["name"]: m["measured_stage_s"] for m in h.snapshot()["members"] if m["blocks"] and not m["lost"]}


def ready_over(h, names: set) -> bool:
    return h.state == HostState.READY and set(measured(h)) == names


@trio_test
async def test_after_a_loss_status_drops_old_stage_times_and_requests_arriving_meanwhile_are_served(
        tmp_path, model_dir, reference, monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, (m1, m2) = await w.form(2)
        assert (await generate(h, PROMPT, N_TOKENS))["token_ids"] == reference
        assert all(s is not None and s > 0 for s in measured(h).values()) and set(measured(h)) == {"h", "m1", "m2"}

        await m2.link.stream.transport.aclose()  # m2's ctl circuit closes: the host replans over h and m1
        await w.wait(lambda: ready_over(h, {"h", "m1"}), 20, "the replan over h and m1")
        assert measured(h) == {"h": None, "m1": None}, measured(h)  # times of the old plan are gone
        assert (await generate(h, PROMPT, N_TOKENS))["token_ids"] == reference
        assert all(s is not None and s > 0 for s in measured(h).values()), measured(h)

        await m1.link.stream.transport.aclose()  # now the host alone: requests arrive while it heals
        await w.wait(lambda: h.state != HostState.READY, 10, "the host recovering")
        assert h.state in (HostState.RECOVERING, HostState.LOADING), h.state
        out: dict = {}

        async def by_control() -> None:
            out["control"] = await generate(h, PROMPT, N_TOKENS)

        async def by_http() -> None:
            body = json.dumps({"prompt": PROMPT, "max_tokens": N_TOKENS}).encode()
            out["http"] = await exchange(http_request("POST", "/v1/completions", body=body), h.node)
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(by_control)
                nursery.start_soon(by_http)
        assert out["control"]["token_ids"] == reference
        status, _, body = out["http"]
        assert status == 200, body
        assert json.loads(body)["choices"][0]["text"] == out["control"]["text"]
        assert ready_over(h, {"h"})


@trio_test
async def test_a_request_sent_just_before_a_loss_is_noticed_runs_again_and_is_served(tmp_path, model_dir, reference,
                                                                                    monkeypatch):
    """A new user's report: a request sent 0.1 s after kill -9 of a member got 503, while one sent a
    second later waited for the healing and was served. The first one reached the ring before the
    host knew of the loss and failed before any output: it now runs again once the session serves."""
    from node.session_harness import shrink_liveness
    shrink_liveness(monkeypatch, interval_s=0.2, deadline_s=1.5)
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, (m1, m2) = await w.form(2)
        w.freeze("m2")  # as a killed process: nothing answers; the host notices after the ctl deadline
        with trio.fail_after(30):
            result = await generate(h, PROMPT, N_TOKENS)
        assert result["token_ids"] == reference
        assert len(result["retried_after"]) == 1 and "m2" in result["retried_after"][0], result.get("retried_after")
        assert ready_over(h, {"h", "m1"}) and h.snapshot()["requests"]["running"] == 0
        records = [json.loads(line) for line in h.node.state.trace_path(h.session_id).read_text().splitlines()]
        assert [r["retried_after"] for r in records if r["event"] == "generation"] == [result["retried_after"]]


@trio_test
async def test_a_member_frozen_mid_stream_pauses_the_stream_which_goes_on_identical(tmp_path, model_dir,
                                                                                    monkeypatch):
    """Issue 25 item 4: a member lost while a request streams (output already handed to its client)
    no longer fails it: the host runs it again on the healed ring, drops the events its client was
    already handed, and the stream goes on; the client's events are the undisturbed greedy run's,
    each once. A request sent right after the loss waits for the healing and is served."""
    from node.session_harness import shrink_liveness
    shrink_liveness(monkeypatch, interval_s=0.2, deadline_s=1.5)
    n_tokens = 24
    ref = reference_tokens(model_dir, PROMPT, n_tokens)
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, (m1, m2) = await w.form(2)
        out: dict = {}

        async def after_loss() -> None:
            await w.wait(lambda: h.state != HostState.READY, 10, "the host noticing the loss")
            out["after"] = await generate(h, PROMPT, N_TOKENS)

        async def on_token(n: int) -> None:
            if n == 3:
                w.freeze("m2")  # as a frozen process: the ring stalls, the host notices after the deadline
                nursery.start_soon(after_loss)
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                out["stream"] = await generate(h, PROMPT, n_tokens, on_token=on_token)
        result = out["stream"]
        assert result["token_ids"] == ref
        assert [ev["token_id"] for ev in result["events"] if ev["token_id"] is not None] == ref  # the client was handed each token once
        assert "".join(ev["text"] for ev in result["events"]) == result["text"]
        assert len(result["retried_after"]) == 1 and "m2" in result["retried_after"][0], result.get("retried_after")
        assert out["after"]["token_ids"] == reference_tokens(model_dir, PROMPT, N_TOKENS)
        assert ready_over(h, {"h", "m1"}) and h.snapshot()["requests"]["running"] == 0


@pytest.mark.parametrize("head", ["host", "member"])
@trio_test
async def test_a_sampled_stream_without_a_seed_goes_on_after_a_loss(tmp_path, model_dir, monkeypatch, head):
    """Issue 25 item 4: a request sampled by temperature alone, without a seed, that streamed output
    when a member was frozen no longer fails: its new run prefills the prompt and the tokens already
    handed in one pass (proto_spec 05 §2 `gen` "cont", through a member head too) and draws the rest.
    The client gets each token once, and the text is the tokens' text after the prompt, the
    junction included."""
    from kafilad.executor.tokenizer import load_tokenizer
    from node.session_harness import CAPABILITY, shrink_liveness
    shrink_liveness(monkeypatch, interval_s=0.2, deadline_s=1.5)
    n_tokens = 24
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        if head == "member":  # a slow host, the members' reports trusted: a member heads
            w.host_capability = {**CAPABILITY, "bandwidth_Bps": CAPABILITY["bandwidth_Bps"] / 20}
        h, (m1, m2) = await w.form(2, head_any=head == "member")
        assert h.machine.head().is_host == (head == "host")
        victim = "m1" if h.machine.head().name == "m2" else "m2"  # never the head

        async def on_token(n: int) -> None:
            if n == 5:
                w.freeze(victim)
        with trio.fail_after(60):
            result = await generate(h, PROMPT, n_tokens, on_token=on_token, temperature=0.9)
        handed = [ev["token_id"] for ev in result["events"] if ev["token_id"] is not None]
        assert handed == result["token_ids"]  # each token once, in order: a pause, no repeat, no error
        assert len(handed) == n_tokens or result["finish_reason"] == "stop", result["finish_reason"]
        assert result["resumed_after_tokens"] >= 5 and len(result["retried_after"]) == 1, result
        assert result["prompt_tokens"] == len(load_tokenizer(model_dir).encode(PROMPT))
        tok = load_tokenizer(model_dir)
        detok = tok.continuation_detokenizer(tok.encode(PROMPT))
        for t in handed:
            detok.add_token(t)
        detok.finalize()
        assert "".join(ev["text"] for ev in result["events"]) == result["text"] == detok.text
        assert ready_over(h, {"h", "m1", "m2"} - {victim}) and h.snapshot()["requests"]["running"] == 0
        records = [json.loads(line) for line in h.node.state.trace_path(h.session_id).read_text().splitlines()]
        gen = [r for r in records if r["event"] == "generation"]
        assert gen[-1]["resumed_after_tokens"] == result["resumed_after_tokens"], gen[-1]
