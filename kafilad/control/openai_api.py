"""OpenAI-compatible HTTP API of the host (DESIGN §7): existing clients work unchanged.

Served on localhost by the daemon (`kafilad --http 127.0.0.1:8400`; `--http off` disables it).
Routes (https://platform.openai.com/docs/api-reference, the subset a local server offers):

```
GET  /v1/models             {"object": "list", "data": [{"id": model_id, "object": "model", ...}]}
POST /v1/completions        {"prompt": str, "max_tokens": 16, "temperature": 0, "stream": false}
POST /v1/chat/completions   {"messages": [{"role", "content"}], "max_tokens": 256, "temperature": 0, "stream": false}
```
With `"stream": true` the reply is Server-Sent Events: one `data: {chunk}` per token, then
`data: [DONE]`. Errors are `{"error": {"message": str, "type": str}}` with a 4xx/5xx status.
The HTTP/1.1 machine is h11 (sans-IO); this module is its thin trio driver.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from typing import Optional

import h11
import trio

from kafilad.errors import GenerationError, KafilaError

log = logging.getLogger("kafilad.http")

MAX_BODY_BYTES = 4 * 1024 * 1024
RECEIVE_BYTES = 65536


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


async def serve_openai_api(node, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the API for `node` until cancelled; `task_status.started(actual_port)`."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    actual = listeners[0].socket.getsockname()[1]
    log.info("OpenAI-compatible API on http://%s:%s/v1", host, actual)
    task_status.started(actual)
    await trio.serve_listeners(lambda stream: _connection(node, stream), listeners)


async def _connection(node, stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_BODY_BYTES)
    async with stream:
        while True:
            try:
                request, body = await _read_request(conn, stream)
            except (h11.RemoteProtocolError, HttpError, trio.BrokenResourceError):
                return
            if request is None:
                return
            try:
                await _route(node, conn, stream, request, body)
            except HttpError as e:
                await _send_json(conn, stream, e.status, {"error": {"message": e.message, "type": e.kind}})
            except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
                return
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return


async def _read_request(conn: h11.Connection, stream) -> tuple[Optional[h11.Request], bytes]:
    request, body = None, bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(RECEIVE_BYTES)
            conn.receive_data(data)
            if not data and request is None:
                return None, b""
            continue
        if isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_BODY_BYTES:
                raise HttpError(413, "The request body is too large.")
        elif isinstance(event, h11.EndOfMessage):
            return request, bytes(body)
        elif isinstance(event, h11.ConnectionClosed):
            return None, b""


async def _send_json(conn, stream, status: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    headers = [("content-type", "application/json"), ("content-length", str(len(data)))]
    await stream.send_all(conn.send(h11.Response(status_code=status, headers=headers)))
    await stream.send_all(conn.send(h11.Data(data=data)))
    await stream.send_all(conn.send(h11.EndOfMessage()))


def _session(node):
    from kafilad.node.host import HostSession
    s = node.session
    if not isinstance(s, HostSession) or s.state != "ready":
        raise HttpError(503, "No session is being served by this daemon; host one with `kafila-ctl host`.",
                        "service_unavailable")
    return s


async def _route(node, conn, stream, request: h11.Request, body: bytes) -> None:
    method, path = request.method.decode(), request.target.decode().split("?")[0].rstrip("/")
    if method == "GET" and path == "/v1/models":
        s = _session(node)
        await _send_json(conn, stream, 200, {"object": "list", "data": [
            {"id": s.info.model_id, "object": "model", "created": int(s.started_s), "owned_by": "kafila"}]})
        return
    if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
        try:
            req = json.loads(body or b"{}")
        except json.JSONDecodeError as e:
            raise HttpError(400, f"The request body is not valid JSON ({e}).") from None
        if not isinstance(req, dict):
            raise HttpError(400, "The request body must be a JSON object.")
        await _complete(node, conn, stream, req, chat=path.endswith("chat/completions"))
        return
    raise HttpError(404, f"No route for {method} {path}.", "not_found")


def _chat_prompt(session, messages) -> str:
    try:
        return session.chat_prompt(messages)
    except KafilaError as e:
        raise HttpError(400, str(e)) from None


async def _complete(node, conn, stream, req: dict, *, chat: bool) -> None:
    s = _session(node)
    if chat:
        prompt = _chat_prompt(s, req.get("messages"))
        default_max = 256
    else:
        prompt = req.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise HttpError(400, "'prompt' must be a non-empty string.")
        default_max = 16
    max_tokens = req.get("max_tokens", req.get("max_completion_tokens", default_max))
    temperature = req.get("temperature", 0.0)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise HttpError(400, "'max_tokens' must be a positive integer.")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) \
            or not math.isfinite(temperature) or temperature < 0:
        raise HttpError(400, "'temperature' must be a finite, non-negative number.")
    if req.get("n", 1) != 1:
        raise HttpError(400, "Only 'n': 1 is supported.")
    if req.get("stop"):
        raise HttpError(400, "'stop' sequences are not supported; generation ends at EOS or 'max_tokens'.")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    model = s.info.model_id

    def choice(text: str, finish: Optional[str], *, delta: bool) -> dict:
        if chat:
            key = "delta" if delta else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    if not req.get("stream"):
        try:
            result = await s.generate(prompt, max_tokens=max_tokens, temperature=float(temperature),
                                      emit=_ignore)
        except GenerationError as e:
            status = 400 if "admitted context" in str(e) else 500  # the prompt is too long for the session
            raise HttpError(status, str(e), "server_error" if status == 500 else "invalid_request_error") from None
        finish = "length" if len(result["token_ids"]) >= max_tokens else "stop"
        await _send_json(conn, stream, 200, {
            "id": rid, "object": obj, "created": created, "model": model,
            "choices": [choice(result["text"], finish, delta=False)],
            "usage": {"prompt_tokens": result["prompt_tokens"], "completion_tokens": len(result["token_ids"]),
                      "total_tokens": result["prompt_tokens"] + len(result["token_ids"])}})
        return
    await stream.send_all(conn.send(h11.Response(status_code=200, headers=[
        ("content-type", "text/event-stream"), ("cache-control", "no-cache")])))
    chunk_obj = "chat.completion.chunk" if chat else "text_completion"

    async def sse(payload) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        await stream.send_all(conn.send(h11.Data(data=f"data: {data}\n\n".encode())))

    async def on_token(ev: dict) -> None:
        if ev.get("text"):
            await sse({"id": rid, "object": chunk_obj, "created": created, "model": model,
                       "choices": [choice(ev["text"], None, delta=True)]})

    try:
        result = await s.generate(prompt, max_tokens=max_tokens, temperature=float(temperature), emit=on_token)
        finish = "length" if len(result["token_ids"]) >= max_tokens else "stop"
        await sse({"id": rid, "object": chunk_obj, "created": created, "model": model,
                   "choices": [choice("", finish, delta=True)]})
    except KafilaError as e:
        await sse({"error": {"message": str(e), "type": "server_error"}})
    await sse("[DONE]")
    await stream.send_all(conn.send(h11.EndOfMessage()))


async def _ignore(ev: dict) -> None:
    return None
