"""Hostile body-phase connections against a real HttpServer on real loopback sockets (issue 22 §4):
clients that declare a body and send one byte of it must not lock the API. Each test opens the
hostile connections, then sends one legitimate request and asserts it is served and answered
correctly; a generous `fail_after` guards against a hang (no wall-clock bound is asserted).

Linux routes all of 127.0.0.0/8 to loopback, so a client bound to 127.0.0.2 is "another address"."""

from __future__ import annotations

import json
import sys

import pytest
import trio

from kafilad.control.http_server import HttpLimits, HttpServer, Request, Responder

pytestmark = [pytest.mark.filterwarnings("ignore::trio.TrioDeprecationWarning"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="binds clients to 127.0.0.2 (Linux)")]

HANG_GUARD_S = 120


async def echo(request: Request, res: Responder) -> None:
    await res.send(200, json.dumps({"method": request.method, "path": request.path,
                                    "body": request.body.decode("latin-1")}).encode())


async def read_all(stream: trio.SocketStream) -> bytes:
    out = bytearray()
    while data := await stream.receive_some(65536):
        out += data
    return bytes(out)


def parse_one(data: bytes) -> tuple[int, dict, bytes]:
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, rest[:int(headers.get("content-length", "0"))]


async def legitimate_post(port: int, local: str) -> tuple[int, dict]:
    body = json.dumps({"prompt": "hello", "max_tokens": 4}).encode()
    s = await trio.open_tcp_stream("127.0.0.1", port, local_address=local)
    await s.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    status, _, answer = parse_one(await read_all(s))
    await s.aclose()
    return status, json.loads(answer)


async def hostile(port: int, n: int, declared: int, local: str) -> list[trio.SocketStream]:
    """`n` connections that declare a body of `declared` bytes and send 1 byte of it."""
    out = []
    for _ in range(n):
        s = await trio.open_tcp_stream("127.0.0.1", port, local_address=local)
        await s.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n{" % declared)
        out.append(s)
    return out


async def fates(streams: list[trio.SocketStream], wait_s: float = 2.0) -> dict[str, int]:
    """What each hostile connection got: a 503 (refused), a 408 (closed to make room), closed without an
    answer, still open, or reset."""
    counts = {"503": 0, "408": 0, "closed": 0, "open": 0, "reset": 0}

    async def one(s: trio.SocketStream) -> None:
        with trio.move_on_after(wait_s):
            try:
                data = await read_all(s)
            except trio.BrokenResourceError:
                counts["reset"] += 1
                return
            fate = ("503" if data.startswith(b"HTTP/1.1 503 ") else "408" if data.startswith(b"HTTP/1.1 408 ")
                    else "closed" if not data else "other")
            counts[fate] = counts.get(fate, 0) + 1
            return
        counts["open"] += 1

    async with trio.open_nursery() as nursery:
        for s in streams:
            nursery.start_soon(one, s)
    for s in streams:
        await s.aclose()
    return counts


async def serving(server: HttpServer, body) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve, listeners)
            await body(port)
            nursery.cancel_scope.cancel()


def test_16_connections_declaring_4_mib_and_sending_1_byte_leave_posts_served():
    server = HttpServer(echo)  # default limits: 4 MiB a body, 64 MiB in all

    async def body(port: int) -> None:
        held = await hostile(port, 16, 4 * 1024 * 1024, "127.0.0.2")
        while server.budget.held_bytes < 16:  # each hostile body's one byte has reached the server
            await trio.sleep(0.01)
        assert server.budget.held_bytes == 16  # what arrived; the declared 64 MiB reserve nothing
        status, answer = await legitimate_post(port, "127.0.0.1")
        assert status == 200 and json.loads(answer["body"]) == {"prompt": "hello", "max_tokens": 4}
        counts = await fates(held, wait_s=0.5)
        assert counts == {"503": 0, "408": 0, "closed": 0, "open": 16, "reset": 0}

    trio.run(serving, server, body)


def test_300_trickling_connections_from_one_address_leave_another_address_served_and_none_is_reset():
    """Defaults: 64 connections per address, so the hostile address holds 64 and the 236 others are
    answered 503 with Retry-After (never reset); a client from another address is served."""
    server = HttpServer(echo)

    async def body(port: int) -> None:
        held = await hostile(port, 300, 10, "127.0.0.2")
        status, answer = await legitimate_post(port, "127.0.0.1")
        assert status == 200 and answer["path"] == "/v1/completions" and answer["method"] == "POST"
        counts = await fates(held)
        assert counts["reset"] == 0 and counts.get("other", 0) == 0, counts
        assert counts["open"] + counts["closed"] + counts["408"] <= 64 and counts["503"] >= 300 - 64, counts

    trio.run(serving, server, body)


@pytest.mark.parametrize("spread", [1, 10])
def test_300_trickling_connections_make_room_for_a_client_of_the_same_or_another_address(spread):
    """The server's grace for bodies set to 0 s (injected, instead of waiting 2 s): trickling bodies
    are slow at once, so newcomers close the furthest behind; 300 from one address (the legitimate
    client's own) or from 10 addresses that fill the whole server; the legitimate POST is served."""
    server = HttpServer(echo, HttpLimits(max_connections=128, max_connections_per_address=64, body_grace_s=0.0))

    async def body(port: int) -> None:
        held = []
        for i in range(spread):
            held += await hostile(port, 300 // spread, 10, f"127.0.0.{i + 1}")
        status, answer = await legitimate_post(port, "127.0.0.1")
        assert status == 200 and json.loads(answer["body"]) == {"prompt": "hello", "max_tokens": 4}
        counts = await fates(held, wait_s=1.0)
        assert counts["reset"] == 0 and counts.get("other", 0) == 0 and counts["closed"] == 0, counts
        assert counts["408"] > 0, counts  # trickling bodies were closed to make room, each told why

    trio.run(serving, server, body)
