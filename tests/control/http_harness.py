"""One HTTP request to the API's handler (kafilad/control/openai_api.py) over trio's in-memory streams.

Shared by tests/control/test_openai_routes.py and tests/control/test_web.py: the real
:class:`~kafilad.control.http_server.HttpServer` serves one end of a memory stream pair, the test
writes raw request bytes into the other and reads the whole answer (the requests say
``connection: close``, so the server ends the stream).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import trio
import trio.testing

from kafilad.control import openai_api
from kafilad.control.http_server import HttpServer


async def exchange(raw: bytes, node) -> tuple[int, dict, bytes]:
    """Serve `raw` (one whole request) to `node`'s API handler.

    Args:
        raw: the request's bytes, as :func:`http_request` builds them.
        node: what the handler reads of kafilad/daemon.py's ``Node`` (``snapshot()``,
            ``session``).
    Returns:
        (status, headers with lower-case names, body bytes).
    """
    server = HttpServer(partial(openai_api.handle, node))
    client, srv = trio.testing.memory_stream_pair()
    out = bytearray()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_stream, srv)
        await client.send_all(raw)
        while data := await client.receive_some(65536):
            out += data
    head, _, body = bytes(out).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def http_request(method: str, path: str, headers: Optional[dict] = None, body: Optional[bytes] = None) -> bytes:
    """An HTTP/1.1 request that closes its connection.

    Args:
        headers: extra header lines, after ``host``, ``connection`` and ``content-length``.
        body: the body; None sends no ``content-length`` header (and no body).
    Returns:
        The request's bytes.
    """
    length = "" if body is None else f"content-length: {len(body)}\r\n"
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{length}{extra}\r\n".encode() + (body or b"")
