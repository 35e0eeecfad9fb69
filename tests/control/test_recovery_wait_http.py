"""The HTTP API's generation routes while the session heals (kafilad/control/api_common.py
`serving_session`; the wait itself: kafilad/node/serving/host_requests.py `wait_serving`).

A completion (OpenAI or Ollama) that arrives while the host recovers from a member loss waits
for the session to serve again; when it fails or closes meanwhile, or the wait (RECOVERY_WAIT_S)
runs out, the answer is the 503 naming the state, as before, only later. A client that hangs up
while it waits ends its request: its connection and handler are gone. The real HttpServer and
API handler over trio's memory streams; a real HostMachine (tests/node/healing_host.py); MockClock.
"""

from __future__ import annotations

import json
from functools import partial

import pytest
import trio
import trio.testing

from kafilad.control import openai_api
from kafilad.control.http_server import HttpServer
from kafilad.proto import session as sm
from kafilad.control.node_view import SessionOnly

from control.http_harness import exchange, http_request
from node.healing_host import lose_beta, ready_host

COMPLETION = ("/v1/completions", b'{"prompt": "Once upon a time", "max_tokens": 4}')
OLLAMA = ("/api/generate", b'{"prompt": "Once upon a time", "stream": false}')


def run(fn) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


async def answer_while(h, route: tuple[str, bytes], then=None, after_s: float = 0.0) -> tuple[int, dict, dict, float]:
    """POST `route` to an API serving `h`; at `after_s` s, `await then()`. (status, headers, body, when)."""
    node = SessionOnly(h)
    out: dict = {}

    async def client() -> None:
        t0 = trio.current_time()
        out["answer"] = await exchange(http_request("POST", route[0], body=route[1]), node)
        out["after_s"] = trio.current_time() - t0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client)
        if then is not None:
            await trio.sleep(after_s)
            await then()
    status, headers, body = out["answer"]
    return status, headers, json.loads(body), out["after_s"]


@pytest.mark.parametrize("route", [COMPLETION, OLLAMA])
def test_a_completion_arriving_while_the_session_heals_waits_for_its_close_and_is_told_then(route):
    async def main():
        h = await ready_host()
        await lose_beta(h)
        status, _, body, after_s = await answer_while(
            h, route, lambda: h._handle(sm.Close("the host closed the session", final=True)), after_s=2.5)
        assert status == 503 and after_s == 2.5
        message = body["error"]["message"] if route is COMPLETION else body["error"]
        assert message == ("The session is closed, so no session is being served by this daemon; host one with "
                           "`kafila-ctl host --model MODEL` and admit its members, or send requests to the API of the "
                           "daemon hosting a session.")
    run(main)


def test_a_completion_the_session_does_not_heal_in_time_for_gets_the_state_and_retry_after():
    async def main():
        h = await ready_host()
        await lose_beta(h)
        status, headers, body, after_s = await answer_while(h, COMPLETION)
        assert status == 503 and after_s == 30  # RECOVERY_WAIT_S
        assert body["error"]["message"] == "The session is recovering; it serves requests once it is ready."
        assert headers["retry-after"] == "5"
    run(main)


def test_a_client_that_hangs_up_while_its_request_waits_leaves_nothing_behind():
    async def main():
        h = await ready_host()
        await lose_beta(h)
        server = HttpServer(partial(openai_api.handle, SessionOnly(h)))
        client, srv = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve_stream, srv)
            await client.send_all(http_request("POST", COMPLETION[0], body=COMPLETION[1]))
            await trio.sleep(1)
            assert server.open_connections == 1 and h.state == sm.HostState.RECOVERING
            await client.aclose()  # the client hangs up
            await trio.sleep(0.01)
            assert server.open_connections == 0
        changed = h.requests._state_changed
        assert changed is None or changed.statistics().tasks_waiting == 0
        await h.replan()
        await h.load_all()
        assert h.state == sm.HostState.READY
    run(main)
