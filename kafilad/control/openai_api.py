"""OpenAI-compatible HTTP API of the host (DESIGN §7): existing clients work unchanged.

Served on localhost by the daemon (`kafilad --http 127.0.0.1:8400`; `--http off` disables it).
Routes (https://platform.openai.com/docs/api-reference, the subset a local server offers):

```
GET  /v1/models             {"object": "list", "data": [{"id": model_id, "object": "model", ...}]}
HEAD /v1/models             the same headers, no body (RFC 9110 §9.3.2)
POST /v1/completions        {"prompt": str, "max_tokens": 16, "temperature": 0, "stream": false}
POST /v1/chat/completions   {"messages": [{"role", "content"}], "max_tokens": 256, "temperature": 0, "stream": false}
```
With `"stream": true` the reply is Server-Sent Events: one `data: {chunk}` per token, then
`data: [DONE]`. Errors are `{"error": {"message": str, "type": str}}` with a 4xx/5xx status and a
sentence that names API fields, never command-line flags. While the session is forming, loading
or failed, the 503 says which (with `Retry-After` while it is still coming up). The host runs at
most the session's concurrency of requests at once and queues a bounded number more (first in,
first out; kafilad/node/admission.py); past the queue the answer is 429 with `Retry-After`. A
client that disconnects, streaming or not, queued or running, ends its request on the ring within
one decode step (the session's cancel API, never a trio cancellation of a link send).

Every input is checked before it reaches the session: the body must be UTF-8 JSON (nesting
deeper than Python's parser goes is a 400, not a RecursionError), strings must be valid Unicode
(a lone surrogate such as "\\ud800" is a 400, not a tokenizer error), numbers must fit a float,
and a chat template that refuses the messages (jinja2's `raise_exception`) is a 400.
A streaming client that reads slower than tokens come gets `SSE_BUFFER_EVENTS` events of slack;
past it its request is ended (the ring never waits for a client) and the stream says so.
HTTP itself (limits, timeouts, keep-alive, HEAD, lingering close) is kafilad/control/http_server.py.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import uuid
from functools import partial
from typing import Optional

import trio

from kafilad.control import web
from kafilad.control.http_server import ClientGone, HttpLimits, HttpServer, Request, Responder, open_listeners
from kafilad.errors import GenerationError, HostBusyError, KafilaError

log = logging.getLogger("kafilad.http")

#: SSE events a streaming request may have waiting for its client before it is ended.
SSE_BUFFER_EVENTS = 256
MAX_TOKENS_LIMIT = 2**31 - 1
#: seconds a client is told to wait (Retry-After) while the session is still coming up
RETRY_FORMING_S = 5


class HttpError(Exception):
    """An answer with an error status and a sentence."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 headers: Optional[list[tuple[str, str]]] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


def default_limits() -> HttpLimits:
    """HttpLimits whose connection limit leaves 3/4 of this process's file handles to the rest of the
    daemon (control socket, ring links, model files): at most 256, at least 16."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
    except (ImportError, ValueError, OSError):
        soft = 1024
    return HttpLimits(max_connections=max(16, min(256, soft // 4)))


async def serve_openai_api(node, host: str, port: int, *, limits: Optional[HttpLimits] = None,
                           task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the API for `node` on host:port until cancelled; `task_status.started(actual_port)`.

    Raises:
        KafilaError: the address cannot be served (port out of range, in use, not local).
    """
    try:
        listeners = await open_listeners(host, port)
    except ValueError:
        raise KafilaError(f"The HTTP API port must be between 0 and 65535 (got {port}).") from None
    except OSError as e:
        raise KafilaError(f"The HTTP API cannot listen on {host}:{port}: {e.strerror or e}; "
                          "pick another with --http HOST:PORT, or --http off.") from None
    actual = listeners[0].socket.getsockname()[1]
    log.info("OpenAI-compatible API on http://%s:%s/v1", host, actual)
    server = HttpServer(partial(handle, node), limits or default_limits())
    task_status.started(actual)
    await server.serve(listeners)


async def handle(node, request: Request, res: Responder) -> None:
    """The handler of every request (the server guards it: see http_server.py)."""
    try:
        await _route(node, request, res)
    except HttpError as e:
        if res.started:
            raise
        await res.send(e.status, json.dumps({"error": {"message": e.message, "type": e.kind}}).encode(),
                       headers=e.headers)


_ROUTES = {"/v1/models": ("GET", "HEAD"), "/v1/completions": ("POST",), "/v1/chat/completions": ("POST",)}
_ROUTES.update(web.ROUTES)  # the web page and its status document (kafilad/control/web.py)


async def _route(node, request: Request, res: Responder) -> None:
    method, path = request.method, request.path.rstrip("/") or "/"
    allowed = _ROUTES.get(path)
    if allowed is None:
        raise HttpError(404, f"No route for {method} {_shown(path)}; the API serves "
                             f"{', '.join(sorted(_ROUTES))}.", "not_found")
    if method not in allowed:
        raise HttpError(405, f"{_shown(path)} answers {' and '.join(allowed)}, not {_shown(method)}.",
                        headers=[("allow", ", ".join(allowed))])
    if path in web.ROUTES:
        await web.handle(node, request, res)
        return
    if path == "/v1/models":
        s = _session(node)
        await res.send(200, json.dumps({"object": "list", "data": [
            {"id": _model_id(s), "object": "model", "created": _created(s), "owned_by": "kafila"}]}).encode())
        return
    req = _json_object(request.body)
    await _complete(node, res, req, chat=path.endswith("chat/completions"))


def _model_id(session) -> str:
    return str(getattr(getattr(session, "info", None), "model_id", None) or "kafila")


_CREATED: dict[int, int] = {}


def _created(session) -> int:
    """When the session started (s since the epoch), or when this API first saw it."""
    started = getattr(session, "started_s", None)
    if isinstance(started, (int, float)) and math.isfinite(started):
        return int(started)
    return _CREATED.setdefault(id(session), int(time.time()))


def _shown(text: str) -> str:
    """Client-supplied text quoted in an answer: at most 80 characters, printable."""
    text = "".join(c if c.isprintable() else "?" for c in text[:80])
    return text + ("..." if len(text) >= 80 else "")


def _json_object(body: bytes) -> dict:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HttpError(400, f"The request body is not UTF-8 text (byte {e.start} is not valid UTF-8).") from None
    try:
        req = json.loads(text or "{}")
    except RecursionError:
        raise HttpError(400, "The request body nests JSON arrays or objects deeper than the server accepts.") from None
    except ValueError as e:  # JSONDecodeError, and integers past Python's digit limit
        raise HttpError(400, f"The request body is not valid JSON ({e}).") from None
    if not isinstance(req, dict):
        raise HttpError(400, "The request body must be a JSON object.")
    return req


def _text(value: str, field: str) -> str:
    """`value` if it is valid Unicode (encodable as UTF-8).

    Raises:
        HttpError: a lone surrogate (JSON allows "\\ud800"; no tokenizer does).
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HttpError(400, f"{field} contains a lone surrogate (\\u{ord(value[e.start]):04x} at character "
                             f"{e.start}); send valid Unicode text.") from None
    return value


def _state(session) -> str:
    state = session.state
    return str(getattr(state, "value", state))


def _session(node):
    """The hosted session if it is ready to generate.

    Raises:
        HttpError: 503 saying what the daemon is doing instead.
    """
    return _ready(node.session)


def _ready(s):
    """`s` if it is a hosted session ready to generate; else HttpError 503 saying its state."""
    from kafilad.node.host import HostSession
    if s is None:
        raise HttpError(503, "No session is being served by this daemon: it is not hosting one.",
                        "service_unavailable")
    state = _state(s)
    if not isinstance(s, HostSession):
        if state in ("failed", "closed"):
            raise HttpError(503, "No session is being served by this daemon: it is not hosting one.",
                            "service_unavailable")
        raise HttpError(503, "This daemon is a member of a session, not its host; send requests to the host's API.",
                        "service_unavailable")
    if state == "ready":
        return s
    if state == "failed":
        reason = _api_text(str(s.error or "no reason was recorded")).rstrip(".")
        raise HttpError(503, f"The session failed: {reason}. No session is being served by this daemon.",
                        "service_unavailable")
    if state in ("closing", "closed"):
        raise HttpError(503, f"The session is {state}; no session is being served by this daemon.",
                        "service_unavailable")
    raise HttpError(503, f"The session is {state}; it serves requests once it is ready.", "service_unavailable",
                    headers=[("retry-after", str(RETRY_FORMING_S))])


_FLAG = re.compile(r"--([a-z][a-z0-9-]*)")


def _api_text(message: str) -> str:
    """A session's sentence with command-line flags named as the API's fields (`--max-tokens` -> 'max_tokens')."""
    return _FLAG.sub(lambda m: "'" + m.group(1).replace("-", "_") + "'", message)


def _chat_prompt(session, messages) -> str:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role", "user"), str)
            for m in messages):
        raise HttpError(400, "'messages' must be a non-empty list of {role, content} objects with string values.")
    for i, m in enumerate(messages):
        _text(m["content"], f"messages[{i}].content")
        _text(m.get("role", "user"), f"messages[{i}].role")
    try:
        prompt = session.chat_prompt(messages)
    except KafilaError as e:
        raise HttpError(400, _api_text(str(e))) from None
    except Exception as e:  # noqa: BLE001 - the model's template is code we do not control
        if not _is_template_error(e) and not isinstance(e, (TypeError, ValueError, KeyError, IndexError)):
            raise
        raise HttpError(400, f"The model's chat template refused these messages: {_shown(str(e)) or type(e).__name__}.") \
            from None
    if not isinstance(prompt, str) or not prompt:
        raise HttpError(400, "The model's chat template made an empty prompt of these messages.")
    return _text(prompt, "the chat template's output")


def _is_template_error(e: Exception) -> bool:
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers brings jinja2
        return False
    return isinstance(e, TemplateError)


def _params(req: dict, default_max: int) -> tuple[int, float]:
    max_tokens = req.get("max_tokens", req.get("max_completion_tokens", default_max))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise HttpError(400, "'max_tokens' must be a positive integer.")
    temperature = req.get("temperature", 0.0)
    if temperature is None:
        temperature = 0.0
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        raise HttpError(400, "'temperature' must be a finite, non-negative number.")
    try:
        temperature = float(temperature)
    except OverflowError:
        raise HttpError(400, "'temperature' must be a finite, non-negative number (this one is too large).") from None
    if not math.isfinite(temperature) or temperature < 0:
        raise HttpError(400, "'temperature' must be a finite, non-negative number.")
    if req.get("n", 1) not in (1, None):
        raise HttpError(400, "Only 'n': 1 is supported.")
    if req.get("stop"):
        raise HttpError(400, "'stop' sequences are not supported; generation ends at EOS or 'max_tokens'.")
    if not isinstance(req.get("stream", False), (bool, type(None))):
        raise HttpError(400, "'stream' must be true or false.")
    return max_tokens, temperature


def _generation_error(e: KafilaError, session) -> HttpError:
    """The answer for an error of `session.generate` (ContextTooLongError: 400; busy: 429; not ready: 503)."""
    if isinstance(e, HostBusyError):
        return HttpError(429, _api_text(str(e)), "rate_limit_exceeded",
                         headers=[("retry-after", str(max(1, int(e.retry_after_s))))])
    numbers = [getattr(e, k, None) for k in ("prompt_tokens", "max_tokens", "context")]
    if all(isinstance(n, int) for n in numbers):  # ContextTooLongError
        return HttpError(400, f"The prompt ({numbers[0]} tokens) plus 'max_tokens' {numbers[1]} exceeds the "
                              f"session's context of {numbers[2]} tokens.")
    text = _api_text(str(e))
    if "admitted context" in text:  # the prompt is too long for the session
        return HttpError(400, text)
    if _state(session) != "ready":
        try:
            _ready(session)
        except HttpError as unavailable:
            return unavailable
    return HttpError(500, text, "server_error")


async def _complete(node, res: Responder, req: dict, *, chat: bool) -> None:
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
        _text(prompt, "'prompt'")
        default_max = 16
    max_tokens, temperature = _params(req, default_max)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    model = _model_id(s)

    def choice(text: str, finish: Optional[str], *, delta: bool) -> dict:
        if chat:
            key = "delta" if delta else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    # The session ends a request whose `emit` raises at that event (ring.py), so a client that left
    # or reads too slowly ends its request there; trio-cancelling generate mid-send could break a link.
    res.cancel_on_disconnect = False
    if not req.get("stream"):
        async def on_event(ev: dict) -> None:
            if res.client_gone.is_set():
                raise ClientGone("the client closed its connection")

        try:
            result = await s.generate(prompt, max_tokens=max_tokens, temperature=temperature, emit=on_event,
                                      gone=res.client_gone)
        except KafilaError as e:
            if res.client_gone.is_set():
                raise ClientGone("the client closed its connection") from None
            raise _generation_error(e, s) from None
        if res.client_gone.is_set():
            raise ClientGone("the client closed its connection")
        finish = "length" if len(result["token_ids"]) >= max_tokens else "stop"
        await res.send(200, json.dumps({
            "id": rid, "object": obj, "created": created, "model": model,
            "choices": [choice(result["text"], finish, delta=False)],
            "usage": {"prompt_tokens": result["prompt_tokens"], "completion_tokens": len(result["token_ids"]),
                      "total_tokens": result["prompt_tokens"] + len(result["token_ids"])}}).encode())
        return
    chunk_obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str, finish: Optional[str]) -> dict:
        return {"id": rid, "object": chunk_obj, "created": created, "model": model,
                "choices": [choice(text, finish, delta=True)]}

    await _stream(s, res, prompt, max_tokens, temperature, chunk)


async def _stream(s, res: Responder, prompt: str, max_tokens: int, temperature: float, chunk) -> None:
    """Stream one generation as SSE; the generation never waits for the client (module docstring).

    The 200 and its headers go with the first event, so a request refused because the host is busy
    (its queue is full) still gets a 429; a request waiting in the queue sends nothing meanwhile.
    """
    send, recv = trio.open_memory_channel(SSE_BUFFER_EVENTS)
    slow = False
    gone = False
    busy: Optional[HostBusyError] = None

    def push(payload) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        try:
            send.send_nowait(f"data: {data}\n\n".encode())
        except trio.WouldBlock:  # only an end event can find the buffer full: tokens stop 2 short
            pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):  # the writer ended: the client is gone
            pass

    async def writer() -> None:
        nonlocal gone
        async with recv:
            try:
                async for data in recv:
                    if not res.started:
                        await res.start(200, [("content-type", "text/event-stream"), ("cache-control", "no-cache")])
                    await res.write(data)
            except ClientGone:
                gone = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer)
        with send:
            async def on_token(ev: dict) -> None:
                nonlocal slow
                if gone or res.client_gone.is_set():
                    raise ClientGone("the client closed its connection")
                if not ev.get("text"):
                    return
                if send.statistics().current_buffer_used >= SSE_BUFFER_EVENTS - 2:  # 2 kept for the end
                    slow = True
                    raise ClientGone(f"the client fell {SSE_BUFFER_EVENTS} events behind")
                push(chunk(ev["text"], None))

            try:
                result = await s.generate(prompt, max_tokens=max_tokens, temperature=temperature, emit=on_token,
                                          gone=res.client_gone)
                if not slow:
                    finish = "length" if len(result["token_ids"]) >= max_tokens else "stop"
                    push(chunk("", finish))
            except HostBusyError as e:  # nothing was sent: answered 429 below
                busy = e
            except KafilaError as e:
                if not slow:
                    push({"error": {"message": _generation_error(e, s).message, "type": "server_error"}})
            if slow:
                log.info("http: ended a streaming request: its client fell %d events behind", SSE_BUFFER_EVENTS)
                push({"error": {"message": f"The client read the stream too slowly ({SSE_BUFFER_EVENTS} events "
                                           "behind); the request was ended.", "type": "server_error"}})
            if busy is None:
                push("[DONE]")
    if gone or res.client_gone.is_set():
        raise ClientGone("the client closed its connection")
    if busy is not None:
        raise _generation_error(busy, s)
    await res.end()


async def _ignore(ev: dict) -> None:
    return None


__all__ = ["serve_openai_api", "handle", "HttpError", "ClientGone", "SSE_BUFFER_EVENTS"]
