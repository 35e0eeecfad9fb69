"""OpenAI-compatible HTTP API of the host (DESIGN §7): existing clients work unchanged.

Served on localhost by the daemon (`kafilad --http 127.0.0.1:8400`; `--http off` disables it).
Routes (https://platform.openai.com/docs/api-reference, the subset a local server offers), plus
the Ollama API (kafilad/control/ollama_api.py), the Anthropic Messages API
(kafilad/control/anthropic_api.py), the OpenAI Responses API (kafilad/control/responses_api.py),
the metrics (kafilad/control/metrics.py) and the web page (kafilad/control/web.py):

```
GET  /health                  200 {"status": "ok"} | 503 {"status": "unavailable"}: ready or not, nothing more
GET  /metrics                 Prometheus text format: requests, tokens, TTFT, the session's state, stages, edges
GET  /v1/models               {"object": "list", "data": [{"id": model_id, "object": "model", "created", "owned_by"}]}
GET  /v1/models/{id}          that model object, or 404 `model_not_found`
POST /v1/completions          {"prompt": str, "max_tokens": 16, ...}   -> "text_completion"
POST /v1/chat/completions     {"messages": [...], "max_tokens": 256, ...} -> "chat.completion"
POST /v1/responses            {"input": str | [items], "max_output_tokens"?, ...} -> "response" (stateless)
POST /v1/messages             Anthropic: {"messages", "max_tokens", "system"?, ...} -> "message"
POST /v1/messages/count_tokens  Anthropic: {"messages", "system"?} -> {"input_tokens"}
/api/...                      the Ollama API (kafilad/control/ollama_api.py)
OPTIONS <any route>           CORS preflight (kafilad/control/cors.py): 204, or 403 for an origin not allowed
```
Errors of /v1/messages and below are in Anthropic's shape (`{"type": "error", "error": {"type",
"message"}}`), of /api/ in Ollama's (`{"error": sentence}`), of the rest in OpenAI's (below).
With API keys (kafilad/control/auth.py: `--api-key`, KAFILA_API_KEYS) every route but `/health`,
the web page's static files and OPTIONS asks for one (`Authorization: Bearer KEY` or `x-api-key`):
without it the answer is 401 with `WWW-Authenticate: Bearer` (RFC 6750 §3), in OpenAI's error
shape (`"code": "invalid_api_key"`), Anthropic's on /v1/messages, or Ollama's `{"error": ...}` on
/api/ paths; /metrics asks for one too (Prometheus: `authorization: {credentials: KEY}`).
HEAD is answered wherever GET is (RFC 9110 §9.3.2); a known path with another method is 405
with `Allow`. Request bodies are validated by typed models (kafilad/control/openai_schema.py):
each field gets a precise 400 naming it (`param`), unknown and unsupported fields are refused,
and null means the default for `max_tokens`, `max_completion_tokens` and `temperature`. A
request naming another model than the one served is 404 `model_not_found`.

Generation: `temperature` (default 0: greedy, token-identical to single-process mlx-lm),
`top_p`, `seed` (the same seed draws the same tokens), `presence_penalty`, `frequency_penalty`,
`logit_bias`, `logprobs` / `top_logprobs` and the extensions `top_k`, `min_p`,
`repetition_penalty` reach the head's sampler (kafilad/proto/sampling.py); `response_format`
json_object / json_schema constrain the reply on the head (kafilad/control/grammars.py, llguidance);
`tools`, `tool_choice` (auto, none, required, a named function) and `parallel_tool_calls` go into
the chat template and calls come back as `message.tool_calls` with `finish_reason` "tool_calls",
whole or streamed as `delta.tool_calls` (a forced call's arguments match the function's schema by
construction; kafilad/control/tools.py); `stop` ends the
request before its first stop string, which is never emitted, not even partly in a stream
(kafilad/node/session/stops.py). With `"stream": true` the reply is Server-Sent Events: chat chunks
carry `role` in the first delta only, then `content`; the last chunk has `finish_reason`;
`stream_options.include_usage` adds every chunk's `"usage": null` and one more chunk with
`"choices": []` and the usage; then `data: [DONE]`. Errors are `{"error": {"message", "type",
"param", "code"}}` with a 4xx/5xx status, in sentences that name API fields, never command-line
flags. A completion that arrives while the session heals from a member loss (`recovering`, then
`loading` its new plan) waits for it to serve again, at most `RECOVERY_WAIT_S` (30 s,
kafilad/node/serving/host_requests.py); while the session is forming, degraded or failed, or past that
wait, the 503 says which state (with `Retry-After` while it is still coming up). At most the session's concurrency of requests run at once, a
bounded number more wait (kafilad/node/serving/admission.py); past the queue the answer is 429 with
`Retry-After`. A client that disconnects, streaming or not, queued or running, ends its request
on the ring within one decode step; one that reads slower than tokens come gets
`SSE_BUFFER_EVENTS` events of slack (kafilad/control/api_common.py `stream_generation`).
HTTP itself (limits, timeouts, keep-alive, HEAD, lingering close) is kafilad/control/http_server.py.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from functools import partial
from typing import Awaitable, Callable, Optional
from urllib.parse import unquote

import attrs
import trio

from kafilad.control import anthropic_api, ollama_api, responses_api, web
from kafilad.control.api_common import (SSE_BUFFER_EVENTS, HttpError, TokenText, check_model, chat_prompt,
                                        created_s, default_max_tokens, generate_whole, json_object, model_id,
                                        ready_session, serving_session, shown, stream_generation,
                                        token_reports, vocab_size)
from kafilad.control.auth import ApiKeys
from kafilad.control.cors import cors_headers, preflight_headers, refuse_foreign_origin
from kafilad.control.grammars import ANY_OBJECT, json_grammar
from kafilad.control.http_server import ClientGone, HttpLimits, HttpServer, Request, Responder, open_listeners
from kafilad.control.metrics import CONTENT_TYPE, CURRENT, ApiMetrics, RequestMeter
from kafilad.control.openai_schema import ChatRequest, CompletionRequest, parse_chat, parse_completion
from kafilad.control.tools import ToolCallText, ToolPlan, plan_tools, template_messages
from kafilad.errors import ContextTooLongError, KafilaError
from kafilad.proto.sampling import Sampling

log = logging.getLogger("kafilad.http")

#: default `max_tokens` of a completion (OpenAI's) and of a chat reply (at most what the context leaves)
DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_CHAT_TOKENS = 256


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
                           keys: ApiKeys = ApiKeys(), listeners: Optional[list] = None,
                           task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the API for `node` on host:port until cancelled; `task_status.started(actual_port)`.

    Args:
        keys: the API keys a request must present (none: the API is open; kafilad/main.py allows that
            on loopback only, unless --http-insecure).
        listeners: already open on host:port (the daemon's check of its default address), else opened here.

    Raises:
        KafilaError: the address cannot be served (port out of range, in use, not local).
    """
    try:
        if listeners is None:
            listeners = await open_listeners(host, port)
    except ValueError:
        raise KafilaError(f"The HTTP API port must be between 0 and 65535 (got {port}).") from None
    except OSError as e:
        raise KafilaError(f"The HTTP API cannot listen on {host}:{port}: {e.strerror or e}; "
                          "pick another with --http HOST:PORT, or --http off.") from None
    actual = listeners[0].socket.getsockname()[1]
    log.info("OpenAI-compatible API on http://%s:%s/v1 (%s)", host, actual,
             f"{len(keys)} API key{'s' if len(keys) != 1 else ''}" if keys else "no API key")
    server = HttpServer(partial(handle, node, keys=keys, metrics=ApiMetrics()), limits or default_limits())
    task_status.started(actual)
    await server.serve(listeners)


#: paths served without an API key: the web page's files (it asks for the key) and /health
OPEN_PATHS = frozenset({"/health", *web.STATIC})


async def handle(node, request: Request, res: Responder, *, keys: ApiKeys = ApiKeys(),
                 metrics: Optional[ApiMetrics] = None) -> None:
    """The handler of every request (the server guards it: see http_server.py).

    Args:
        keys: the API keys that open every route but OPEN_PATHS and OPTIONS (none: all open).
        metrics: what GET /metrics reports and this request is counted in (kafilad/control/
            metrics.py); None: this process's `DEFAULT_METRICS`.
    """
    keyed = bool(keys)
    res.extra_headers = cors_headers(request, keyed=keyed)
    shape = _error_shape(request.path)
    if shape is not None:  # the server's own errors (413, a stop, an internal error) take that shape too
        res.error_shape = shape
    meter = RequestMeter(metrics or DEFAULT_METRICS, _route_label(request.method, request.path), request.method)
    token = CURRENT.set(meter)  # read by api_common's generation (metrics.metered) in this task
    try:
        refuse_foreign_origin(request, keyed=keyed)
        if keyed and request.method != "OPTIONS" and (request.path.rstrip("/") or "/") not in OPEN_PATHS \
                and not keys.allows(request.headers):
            raise HttpError(401, "This API needs an API key: send it as `Authorization: Bearer KEY` (OpenAI and "
                                 "Ollama clients: api_key=KEY) or `x-api-key: KEY`; the host's owner set the keys "
                                 "with kafilad --api-key or KAFILA_API_KEYS.", "invalid_request_error",
                            headers=[("www-authenticate", 'Bearer realm="kafila"')], code="invalid_api_key")
        await _route(node, request, res, keyed=keyed)
    except HttpError as e:
        if res.started:
            raise
        await res.send(e.status, shape(e.status, e.message) if shape else error_json(e), headers=e.headers)
    finally:
        CURRENT.reset(token)
        # no status sent: the client left first, or the server answers its own error (500, 503 on a stop)
        meter.answered(str(res.status) if res.status is not None else
                       "gone" if res.client_gone.is_set() else "error")


#: the metrics of handlers given none (one HTTP server per daemon gets its own: `serve_openai_api`)
DEFAULT_METRICS = ApiMetrics()


def _route_label(method: str, path: str) -> str:
    """The route template a request is counted under: a known path, "/v1/models/{id}", or "other"."""
    path = path.rstrip("/") or "/"
    if path in _ROUTES:
        return path
    if path.startswith(MODEL_PREFIX):
        return MODEL_PREFIX + "{id}"
    return "other"


async def _metrics(node, request: Request, res: Responder) -> None:
    """GET /metrics (kafilad/control/metrics.py): the API's counters and the node's status."""
    meter = CURRENT.get()
    metrics = meter.metrics if meter is not None else DEFAULT_METRICS
    await res.send(200, metrics.render(node.status()), content_type=CONTENT_TYPE)


def _error_shape(path: str) -> Optional[Callable[[int, str], bytes]]:
    """The error body of the API that `path` belongs to; None: OpenAI's (`error_json`). Every /api/
    path, known or not, answers in Ollama's shape; /v1/messages and below in Anthropic's."""
    if path.startswith("/api/"):
        return lambda status, message: json.dumps({"error": message}).encode()
    if path.rstrip("/") == anthropic_api.PREFIX or path.startswith(anthropic_api.PREFIX + "/"):
        return anthropic_api.error_body
    return None


def error_json(e: HttpError) -> bytes:
    """The OpenAI error body."""
    return json.dumps({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}).encode()


Handler = Callable[[object, Request, Responder], Awaitable[None]]


async def _health(node, request: Request, res: Responder) -> None:
    """200 {"status": "ok"} while a session is ready to serve, else 503 {"status": "unavailable"}
    (with Retry-After while it comes up): ready or not and nothing more, since it is served without
    an API key (no states, paths or errors; an API call with a key says why it is not ready)."""
    try:
        ready_session(node)
    except HttpError as e:
        retry = [h for h in e.headers or () if h[0] == "retry-after"]
        await res.send(503, json.dumps({"status": "unavailable"}).encode(), headers=retry)
        return
    await res.send(200, json.dumps({"status": "ok"}).encode())


def _model_object(s) -> dict:
    return {"id": model_id(s), "object": "model", "created": created_s(s), "owned_by": "kafila"}


async def _models(node, request: Request, res: Responder) -> None:
    s = ready_session(node)
    await res.send(200, json.dumps({"object": "list", "data": [_model_object(s)]}).encode())


async def _model(node, request: Request, res: Responder) -> None:
    name = unquote(request.path.rstrip("/")[len(MODEL_PREFIX):])
    s = ready_session(node)
    check_model(s, name)
    await res.send(200, json.dumps(_model_object(s)).encode())


async def _completions(node, request: Request, res: Responder) -> None:
    r = parse_completion(json_object(request.body))
    s = await serving_session(node, res.client_gone)
    check_model(s, r.model)
    await _generate(s, res, r, r.prompt, chat=False)


async def _chat_completions(node, request: Request, res: Responder) -> None:
    r = parse_chat(json_object(request.body))
    s = await serving_session(node, res.client_gone)
    check_model(s, r.model)
    plan = plan_tools(s.chat_tokenizer(), r.tool_dicts(), r.tool_choice_value(), r.parallel_tool_calls)
    messages = template_messages(r.prompt_messages(), plan)
    prompt = await chat_prompt(s, messages, list(plan.tools) if plan is not None and plan.native else None)
    grammar = plan.grammar() if plan is not None else None
    if grammar is None and r.response_format is not None and r.response_format.type != "text":
        grammar = response_grammar(r.response_format)
    await _generate(s, res, r, prompt, chat=True, plan=plan, grammar=grammar)


def response_grammar(rf) -> str:
    """The grammar of a `response_format` of type json_object or json_schema (kafilad/control/grammars.py)."""
    if rf.type == "json_object":
        return json_grammar(ANY_OBJECT, param="response_format")
    schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else ANY_OBJECT
    return json_grammar(schema, param="response_format.json_schema.schema")


#: path -> (methods, handler). The web page's routes (kafilad/control/web.py) and the Ollama API's
#: (kafilad/control/ollama_api.py) are registered here too.
_ROUTES: dict[str, tuple[tuple[str, ...], Handler]] = {
    "/health": (("GET", "HEAD"), _health),
    "/metrics": (("GET", "HEAD"), _metrics),
    "/v1/models": (("GET", "HEAD"), _models),
    "/v1/completions": (("POST",), _completions),
    "/v1/chat/completions": (("POST",), _chat_completions),
    **ollama_api.ROUTES,
    **anthropic_api.ROUTES,
    **responses_api.ROUTES,
}
_ROUTES.update({p: (m, web.handle) for p, m in web.ROUTES.items()})  # the web page (kafilad/control/web.py)
#: a path under this prefix names a model: GET /v1/models/{id}
MODEL_PREFIX = "/v1/models/"


async def _route(node, request: Request, res: Responder, *, keyed: bool = False) -> None:
    method, path = request.method, request.path.rstrip("/") or "/"
    route = _ROUTES.get(path)
    if route is None and path.startswith(MODEL_PREFIX):
        route = (("GET", "HEAD"), _model)
    if route is None and path.startswith("/api/"):
        raise HttpError(404, f"This server does not offer {shown(method)} {shown(path)}: it is a Kafila host serving "
                             "its session's one model, so it does not pull, push, create, copy, delete or embed "
                             f"models. Its Ollama routes are {', '.join(sorted(ollama_api.ROUTES))}.", "not_found")
    if route is None:
        raise HttpError(404, f"No route for {shown(method)} {shown(path)}; the API serves "
                             f"{', '.join(sorted([*_ROUTES, MODEL_PREFIX + '{id}']))}.", "not_found")
    allowed, handler = route
    if method == "OPTIONS":  # RFC 9110 §9.3.7; a CORS preflight when it asks for a method
        if request.header(b"access-control-request-method") is None:
            await res.start(204, [("allow", ", ".join((*allowed, "OPTIONS")))])
        else:
            await res.start(204, preflight_headers(request, allowed, keyed=keyed))
        await res.end()
        return
    if method not in allowed:
        raise HttpError(405, f"{shown(path)} answers {' and '.join(allowed)}, not {shown(method)}.",
                        headers=[("allow", ", ".join(allowed))])
    await handler(node, request, res)


# ---- generation -------------------------------------------------------------------------------
def sampling_of(s, r) -> Sampling:
    """The head's Sampling for a checked request (kafilad/proto/sampling.py).

    Raises:
        HttpError: 400 for a `logit_bias` token id outside the model's vocabulary.
    """
    vocab = vocab_size(s)
    for token, _ in r.logit_bias or ():
        if vocab is not None and token >= vocab:
            raise HttpError(400, f"'logit_bias' names token {token}, outside this model's vocabulary of {vocab} "
                                 "tokens.", param="logit_bias")
    if isinstance(r, ChatRequest):
        logprobs = (r.top_logprobs or 0) if r.logprobs else None
    else:
        logprobs = r.logprobs
    return Sampling(temperature=r.temperature or 0.0, top_p=1.0 if r.top_p is None else r.top_p,
                    top_k=r.top_k or 0, min_p=r.min_p or 0.0, seed=r.seed,
                    presence_penalty=r.presence_penalty or 0.0, frequency_penalty=r.frequency_penalty or 0.0,
                    repetition_penalty=r.repetition_penalty, logit_bias=tuple(r.logit_bias or ()), logprobs=logprobs)


def _chat_logprobs(events: list[dict], text_of: TokenText) -> dict:
    def entry(t: str, lp: float) -> dict:
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, x) for a, x in top]}
                        for t, lp, top in token_reports(events, text_of)], "refusal": None}


def _completion_logprobs(events: list[dict], text_of: TokenText, offset: int = 0) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, lp, top in token_reports(events, text_of):
        out["tokens"].append(t)
        out["token_logprobs"].append(lp)
        alternatives: dict[str, float] = {}
        for a, x in top:  # texts that coincide (bytes of one character) keep the likelier
            alternatives.setdefault(a, x)
        alternatives.setdefault(t, lp)  # the sampled token is always listed (OpenAI: up to logprobs + 1)
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
        offset += len(t)
    return out


def _usage(result: dict) -> dict:
    n = len(result["token_ids"])
    return {"prompt_tokens": result["prompt_tokens"], "completion_tokens": n,
            "total_tokens": result["prompt_tokens"] + n,
            "prompt_tokens_details": {"cached_tokens": int(result.get("cached_tokens") or 0)}}


async def _generate(s, res: Responder, r, prompt: str, *, chat: bool, plan: Optional[ToolPlan] = None,
                    grammar: Optional[str] = None) -> None:
    """Run a checked completion or chat request and answer it, whole or streamed; with `plan`, tool
    calls are taken out of the reply (kafilad/control/tools.py); `grammar` constrains it."""
    sampling = sampling_of(s, r)
    if grammar is not None:
        sampling = attrs.evolve(sampling, grammar=grammar)
    calls = ToolCallText(plan) if plan is not None and plan.parses else None
    max_tokens = (r.max_completion_tokens if chat and r.max_completion_tokens is not None else r.max_tokens)
    defaulted = max_tokens is None
    if max_tokens is None:
        max_tokens = await default_max_tokens(s, prompt, DEFAULT_CHAT_TOKENS if chat else DEFAULT_COMPLETION_TOKENS)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    model = model_id(s)
    text_of = TokenText(s) if sampling.logprobs is not None else None

    async def generate(emit):
        try:
            return await s.generate(prompt, max_tokens=max_tokens, temperature=sampling.temperature, emit=emit,
                                    gone=res.client_gone, sampling=sampling, stop=r.stop or ())
        except ContextTooLongError as e:
            if defaulted:  # not "'max_tokens' 256 exceeds...": the client sent none (api_common generation_error)
                e.prompt_field = "messages" if chat else "prompt"
            raise

    if not r.stream:
        result, events = await generate_whole(s, res, generate)
        finish = result.get("finish_reason") or "stop"
        if chat:
            message = {"role": "assistant", "content": result["text"], "refusal": None}
            if calls is not None:
                content, found = calls.feed(result["text"])
                rest, more = calls.finish()
                if found or more:
                    message = {"role": "assistant", "content": (content + rest) or None, "refusal": None,
                               "tool_calls": found + more}
                    finish = "tool_calls" if finish == "stop" else finish
            choice = {"index": 0, "message": message,
                      "logprobs": _chat_logprobs(events, text_of) if text_of else None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": result["text"],
                      "logprobs": _completion_logprobs(events, text_of) if text_of else None, "finish_reason": finish}
        await res.send(200, json.dumps({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": _usage(result)}).encode())
        return

    include_usage = bool(r.stream_options and r.stream_options.include_usage)
    obj = "chat.completion.chunk" if chat else "text_completion"
    sent = {"role": False, "offset": 0}

    def sse(payload) -> bytes:
        return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()

    def chunk(choices: list, **extra) -> bytes:
        out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra}
        if include_usage and "usage" not in out:
            out["usage"] = None
        return sse(out)

    def choice(text: Optional[str], finish: Optional[str], events: list[dict]) -> dict:
        if chat:
            delta = {} if text is None else {"content": text}
            if not sent["role"]:
                delta = {"role": "assistant", **delta}
                sent["role"] = True
            lp = _chat_logprobs(events, text_of) if text_of and events else None
            return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        lp = _completion_logprobs(events, text_of, sent["offset"]) if text_of and events else None
        sent["offset"] += len(text or "")
        return {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}

    def call_payloads(found: list[dict]) -> list[bytes]:
        """One chunk per completed tool call: the whole call in one delta, indexed (OpenAI's shape)."""
        out = []
        for c in found:
            out.append(chunk([{"index": 0, "delta": {"tool_calls": [{"index": sent.setdefault("calls", 0), **c}]},
                               "logprobs": None, "finish_reason": None}]))
            sent["calls"] += 1
        return out

    def token_payloads(ev: dict) -> list[bytes]:
        text = str(ev.get("text") or "")
        has_lp = ev.get("logprob") is not None and text_of is not None
        found: list[dict] = []
        if calls is not None:
            text, found = calls.feed(text)
        if not text and not has_lp and not found:
            return []
        out = []
        if chat and not sent["role"]:  # the first chunk: the role, and no content yet (as OpenAI streams)
            out.append(chunk([choice("", None, [])]))
        if text or has_lp:
            out.append(chunk([choice(text, None, [ev] if has_lp else [])]))
        return out + call_payloads(found)

    def end_payloads(result: dict) -> list[bytes]:
        finish = result.get("finish_reason") or "stop"
        out = []
        if calls is not None:
            rest, found = calls.finish()
            if chat and not sent["role"] and (rest or found):
                out.append(chunk([choice("", None, [])]))
            if rest:
                out.append(chunk([choice(rest, None, [])]))
            out += call_payloads(found)
            if calls.calls and finish == "stop":
                finish = "tool_calls"
        out.append(chunk([choice(None if chat else "", finish, [])]))
        if include_usage:
            out.append(chunk([], usage=_usage(result)))
        return out + [sse("[DONE]")]

    def error_payloads(message: str) -> list[bytes]:
        return [sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}}),
                sse("[DONE]")]

    await stream_generation(s, res, generate, content_type="text/event-stream", token_payloads=token_payloads,
                            end_payloads=end_payloads, error_payloads=error_payloads)


__all__ = ["serve_openai_api", "handle", "HttpError", "ClientGone", "SSE_BUFFER_EVENTS", "sampling_of",
           "CompletionRequest", "ChatRequest", "error_json"]
