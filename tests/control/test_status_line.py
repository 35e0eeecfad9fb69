"""The status line of every answer carries its reason phrase (RFC 9112 §4; phrases of RFC 9110 §15,
as http.HTTPStatus spells them). A new user's report (2026-12-01): `curl -i` showed "HTTP/1.1 503 "
with nothing after the code. In-memory streams, the real HttpServer."""

from __future__ import annotations

import trio
import trio.testing

import pytest

from kafilad.control.http_server import HttpServer, Request, Responder, reason_phrase


def status_line(status: int, raw: bytes = b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n") -> bytes:
    """The first line the server sends when its handler answers `status`."""
    async def handler(request: Request, res: Responder) -> None:
        await res.error(status, "A sentence.") if status >= 400 else await res.send(status, b"{}")

    async def main() -> bytes:
        client, srv = trio.testing.memory_stream_pair()
        out = bytearray()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(HttpServer(handler).serve_stream, srv)
            await client.send_all(raw)
            while data := await client.receive_some(65536):
                out += data
        return bytes(out).split(b"\r\n", 1)[0]
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("status, line", [
    (200, b"HTTP/1.1 200 OK"),
    (400, b"HTTP/1.1 400 Bad Request"),
    (404, b"HTTP/1.1 404 Not Found"),
    (429, b"HTTP/1.1 429 Too Many Requests"),
    (500, b"HTTP/1.1 500 Internal Server Error"),
    (503, b"HTTP/1.1 503 Service Unavailable"),
])
def test_a_handlers_answer_has_its_reason_phrase(status, line):
    assert status_line(status) == line


def test_the_servers_own_refusals_and_100_continue_have_theirs():
    assert status_line(200, b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20000 + b"\r\n\r\n") == \
        b"HTTP/1.1 431 Request Header Fields Too Large"
    raw = (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nexpect: 100-continue\r\n"
           b"connection: close\r\n\r\nab")
    assert status_line(200, raw) == b"HTTP/1.1 100 Continue"


def test_a_code_without_a_phrase_has_an_empty_one():
    assert reason_phrase(503) == b"Service Unavailable" and reason_phrase(299) == b""
