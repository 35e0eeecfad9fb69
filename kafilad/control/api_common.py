"""What the host's OpenAI and Ollama APIs share (DESIGN §7): errors, the served session, input checks.

kafilad/control/openai_api.py and kafilad/control/ollama_api.py answer through these, so both
say the same sentences for the same conditions: 503 while no session is ready (with the state,
and `Retry-After` while it is still coming up), 404 for another model than the one served, 400
for bodies that are not UTF-8 JSON objects, for strings that are not valid Unicode, for a chat
template that refuses the messages, and for a prompt too long for the session's context.
Sentences name API fields, never command-line flags (`api_text`), and the field as the client's
API spells it (Ollama's `options.num_predict`, not OpenAI's `max_tokens`: `fields`). A generation request that
arrives while the session heals from a member loss waits for it to serve again, at most
`RECOVERY_WAIT_S` (kafilad/node/serving/host_requests.py; `serving_session`), before that 503.
Browser clients (CORS): kafilad/control/cors.py.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import h11
import trio

from kafilad.control.http_server import SHUTTING_DOWN_MID_STREAM, ClientGone
from kafilad.control.metrics import metered
from kafilad.errors import (CONTEXT_LENGTH_EXCEEDED, INVALID_LOGIT_BIAS, ContextTooLongError, GenerationCancelled,
                            HostBusyError, KafilaError, SessionNotReadyError, only_cancelled)
from kafilad.step_timeline import TIMELINE

log = logging.getLogger("kafilad.http")

#: seconds a client is told to wait (Retry-After) while the session is still coming up
RETRY_FORMING_S = 5


class HttpError(Exception):
    """An answer with an error status and a sentence; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 headers: Optional[list[tuple[str, str]]] = None, *, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers
        self.param, self.code = param, code


# ---- the served session ---------------------------------------------------------------------
def state_of(session) -> str:
    state = session.state
    return str(getattr(state, "value", state))


def ready_session(node):
    """The hosted session of `node` if it is ready to generate.

    Raises:
        HttpError: 503 saying what the daemon is doing instead.
    """
    not_restoring(node)
    return ready(node.session)


def not_restoring(node) -> None:
    """Pass unless `node` (a restarted daemon) is registering its remembered session again.

    Raises:
        HttpError: 503 + Retry-After saying so (kafilad/daemon.py `restoring_sentence`).
    """
    said = node.restoring_sentence()
    if said is not None:
        raise HttpError(503, f"{said} It serves requests once the session is ready.", "service_unavailable",
                        headers=[("retry-after", str(RETRY_FORMING_S))])


async def serving_session(node, gone: trio.Event):
    """The hosted session of `node` once it is ready to generate: a session healing from a member
    loss, or one a restarted host daemon is restoring, is waited for, at most RECOVERY_WAIT_S each
    (kafilad/daemon.py `Node.session_back`, kafilad/node/serving/host_requests.py `wait_serving`).

    Args:
        gone: set when the request's client went away (`Responder.client_gone`).
    Raises:
        HttpError: 503 saying what the daemon is doing instead (`ready`).
        ClientGone: the client went away while its request waited.
    """
    await node.session_back(gone)  # a daemon restoring its session after a restart is waited for
    if gone.is_set():
        raise ClientGone("the client closed its connection")
    not_restoring(node)
    s = node.session
    wait = getattr(s, "wait_serving", None)
    if wait is not None:
        try:
            await wait(gone)
        except GenerationCancelled:
            raise ClientGone("the client closed its connection") from None
        except SessionNotReadyError:
            pass  # `ready` says the state, as for a request that never waited
    return ready(s)


#: what to do when this daemon serves no session (the end of the 503's sentence)
HOST_ONE = ("host one with `kafila-ctl host --model MODEL` and admit its members, or send requests to the API of "
            "the daemon hosting a session.")
NOT_HOSTING = "No session is being served by this daemon: it is not hosting one. To serve, " + HOST_ONE


def ready(s):
    """`s` if it is a hosted session ready to generate; else HttpError 503 saying its state."""
    if s is None:
        raise HttpError(503, NOT_HOSTING, "service_unavailable")
    state = state_of(s)
    if s.role != "host":  # a member session (kafilad/node/session/member.py MemberSession)
        if state in ("failed", "closed"):
            raise HttpError(503, NOT_HOSTING, "service_unavailable")
        raise HttpError(503, "This daemon is a member of a session, not its host; send requests to the host's API.",
                        "service_unavailable")
    if state == "ready":
        return s
    if state == "failed":
        reason = api_text(str(s.error or "no reason was recorded")).rstrip(".")
        raise HttpError(503, f"The session failed: {reason}. No session is being served by this daemon; {HOST_ONE}",
                        "service_unavailable")
    if state == "closed":
        raise HttpError(503, f"The session is {state}, so no session is being served by this daemon; {HOST_ONE}",
                        "service_unavailable")
    raise HttpError(503, f"The session is {state}; it serves requests once it is ready.", "service_unavailable",
                    headers=[("retry-after", str(RETRY_FORMING_S))])


def model_names(session) -> list[str]:
    """The names a request may give the served model, its id first: the Hugging Face repo id
    ("ORG/NAME") when the model directory is a snapshot in a Hugging Face cache
    (`models--ORG--NAME/snapshots/COMMIT`, kafilad/modelref.py), then the directory's name."""
    own = str(getattr(getattr(session, "info", None), "model_id", None) or "kafila")
    d = Path(str(getattr(session, "model_dir", "") or ""))
    repo = d.parent.parent.name
    if d.parent.name == "snapshots" and repo.startswith("models--") and "--" in repo[len("models--"):]:
        return [repo[len("models--"):].replace("--", "/", 1), own]
    return [own]


def model_id(session) -> str:
    """The served model's id, as /v1/models and /api/tags list it."""
    return model_names(session)[0]


def check_model(session, name: Optional[str], *, suffixes: tuple[str, ...] = ()) -> str:
    """The served model's id when a request names it (or names none), else a 404 `model_not_found`.

    Args:
        suffixes: spellings also accepted after a name (Ollama's ":latest").
    """
    served = model_id(session)
    if name is None or any(name == n + s for n in model_names(session) for s in ("", *suffixes)):
        return served
    raise HttpError(404, f"The model '{shown(name)}' does not exist on this server; it serves '{served}'.",
                    param="model", code="model_not_found")


_CREATED: dict[int, int] = {}


def created_s(session) -> int:
    """When the session started (s since the epoch), or when this API first saw it."""
    started = getattr(session, "started_s", None)
    if isinstance(started, (int, float)) and math.isfinite(started):
        return int(started)
    return _CREATED.setdefault(id(session), int(time.time()))


def vocab_size(session) -> Optional[int]:
    """The model's vocabulary size from its config.json (None when it does not say)."""
    cfg = getattr(getattr(session, "info", None), "config", None) or {}
    v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return v if isinstance(v, int) and v > 0 else None


async def prompt_tokens(session, prompt: str, limit: Optional[int] = None) -> tuple[int, bool]:
    """(the prompt's tokens, True), counted in a worker thread so the event loop serves on; or (a
    lower bound, False) when that alone exceeds `limit`, found without tokenizing a prompt that
    certainly does not fit (kafilad/node/serving/host_requests.py `prompt_tokens`)."""
    return await session.prompt_tokens(prompt, limit)


def tokens_text(n: int, exact: bool) -> str:
    """'N tokens', or 'at least N tokens' for a lower bound."""
    return f"{n} tokens" if exact else f"at least {n} tokens"


async def default_max_tokens(session, prompt: str, default: int) -> int:
    """`default`, or less when the prompt leaves less of the session's context (at least 1)."""
    context = int(getattr(session, "context", 0) or 0)
    room = context - (await prompt_tokens(session, prompt, context))[0]
    return max(1, min(default, room)) if room > 0 else default


# ---- request bodies -------------------------------------------------------------------------
def shown(text: str) -> str:
    """Client-supplied text quoted in an answer: at most 80 characters, printable."""
    text = "".join(c if c.isprintable() else "?" for c in str(text)[:80])
    return text + ("..." if len(text) >= 80 else "")


def json_object(body: bytes) -> dict:
    """The request body as a JSON object whose strings are all valid Unicode.

    Raises:
        HttpError: 400 for a body that is not UTF-8, not JSON, nested too deep, not an object, or
            holds a lone surrogate (JSON allows "\\ud800"; no tokenizer does).
    """
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
    _check_unicode(req, "")
    return req


def _check_unicode(value: Any, path: str) -> None:
    """Raise HttpError 400 naming the first string (or key) under `value` with a lone surrogate."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            text(v, p or "the body")
        elif isinstance(v, dict):
            for k, x in v.items():
                text(k, f"a key of {p or 'the body'}")
                stack.append((x, f"{p}.{k}" if p else k))
        elif isinstance(v, list):
            stack.extend((x, f"{p}[{i}]") for i, x in enumerate(v))


def text(value: str, field: str) -> str:
    """`value` if it is valid Unicode (encodable as UTF-8).

    Raises:
        HttpError: a lone surrogate, naming `field` and where.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HttpError(400, f"{field} contains a lone surrogate (\\u{ord(value[e.start]):04x} at character "
                             f"{e.start}); send valid Unicode text.", param=field) from None
    return value


_FLAG = re.compile(r"--([a-z][a-z0-9-]*)")


def api_text(message: str, fields: Optional[dict[str, str]] = None) -> str:
    """A session's sentence with command-line flags named as the API's fields (`--max-tokens` -> 'max_tokens').

    Args:
        fields: the OpenAI field name -> the name the client's API uses instead (ollama_api.py
            OLLAMA_FIELDS: 'max_tokens' -> 'options.num_predict'); None: the OpenAI names.
    """
    def field(m: re.Match) -> str:
        name = m.group(1).replace("-", "_")
        return "'" + (fields or {}).get(name, name) + "'"
    return _FLAG.sub(field, message)


async def chat_prompt(session, messages: list[dict], tools: Optional[list[dict]] = None) -> str:
    """The prompt for checked `messages` ([{"role": str, "content": str, ...}]) by the model's chat
    template, with `tools` when the template takes them (kafilad/control/tools.py), applied in a
    worker thread (kafilad/node/serving/host_requests.py `off_loop`).

    Raises:
        HttpError: 400 when the template refuses the messages or makes an empty prompt.
    """
    try:
        prompt = await session.off_loop(session.chat_prompt, messages, tools)
    except KafilaError as e:
        raise HttpError(400, api_text(str(e)), param="messages") from None
    except Exception as e:  # noqa: BLE001 - the model's template is code we do not control
        if not _is_template_error(e) and not isinstance(e, (TypeError, ValueError, KeyError, IndexError)):
            raise
        raise HttpError(400, f"The model's chat template refused these messages: {shown(str(e)) or type(e).__name__}.",
                        param="messages") from None
    if not isinstance(prompt, str) or not prompt:
        raise HttpError(400, "The model's chat template made an empty prompt of these messages.", param="messages")
    return text(prompt, "the chat template's output")


def _is_template_error(e: Exception) -> bool:
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers brings jinja2
        return False
    return isinstance(e, TemplateError)


def generation_error(e: KafilaError, session, fields: Optional[dict[str, str]] = None) -> HttpError:
    """The answer for an error of `session.generate` (ContextTooLongError: 400; busy: 429; not ready: 503).

    Args:
        fields: as for `api_text`: the request's fields as the client's API names them.
    """
    if isinstance(e, HostBusyError):
        return HttpError(429, api_text(str(e), fields), "rate_limit_exceeded",
                         headers=[("retry-after", str(max(1, int(e.retry_after_s))))])
    if isinstance(e, ContextTooLongError):
        prompt = tokens_text(e.prompt_tokens, not e.at_least)
        if e.prompt_field:  # the request had no max_tokens (the API chose it): the prompt alone fills the context
            return HttpError(400, f"The prompt ({prompt}) leaves no room to generate in the session's context "
                                  f"of {e.context} tokens; shorten the {e.prompt_field}.", param=e.prompt_field,
                             code=CONTEXT_LENGTH_EXCEEDED)
        field = (fields or {}).get("max_tokens", "max_tokens")
        return HttpError(400, f"The prompt ({prompt}) plus '{field}' {e.max_tokens} exceeds the "
                              f"session's context of {e.context} tokens.", param=field, code=CONTEXT_LENGTH_EXCEEDED)
    message = api_text(str(e), fields)
    if e.code == INVALID_LOGIT_BIAS:  # the head refused a token id outside the vocabulary
        return HttpError(400, message, param="logit_bias")
    if state_of(session) != "ready":
        try:
            ready(session)
        except HttpError as unavailable:
            if isinstance(e, SessionNotReadyError):  # it never started: the session's state says it all
                return unavailable
            # it failed because the session changed under it (a member lost): say which, then the state
            cause = message[:1].upper() + message[1:].rstrip(".")  # "the host closed the session" begins a sentence
            return HttpError(unavailable.status, f"{cause}. {unavailable.message}", unavailable.kind,
                             unavailable.headers, code=unavailable.code)
    return HttpError(500, message, "server_error")


class TokenText:
    """The text one token adds where it stands, for log-probability alternatives (cached per id).

    A lone `decode([id])` loses what a token adds after other text: SentencePiece decoders strip
    the leading space of the first token ("▁the" -> "the", "▁" -> ""), so "▁the" and "the" would
    share one `top_logprobs` key. The chosen token's text is the detokenizer's segment
    (kafilad/executor/tokenizer.py: the decode as it continues the text before it); an alternative
    is decoded the same way after a fixed word ("a"): `decode(ref + [id])[len(decode(ref)):]`.
    """

    def __init__(self, session):
        self._tok = session.chat_tokenizer()
        self._cache: dict[int, str] = {}
        self._ref = [int(i) for i in self._tok.encode("a", add_special_tokens=False)]
        self._ref_text = self._tok.decode(self._ref)

    def __call__(self, token_id: int) -> str:
        t = self._cache.get(token_id)
        if t is None:
            full = self._tok.decode([*self._ref, int(token_id)])
            if full.startswith(self._ref_text):
                t = full[len(self._ref_text):]
            else:  # a decoder that rewrote the reference word: the token alone
                t = self._tok.decode([int(token_id)])
            self._cache[token_id] = t
        return t


def token_reports(events: list[dict], text_of: TokenText) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(text, logprob, [(alternative's text, logprob)]) per generated token that reports a log-probability.

    A token's text is what its event streamed (the detokenizer's segment), and text streamed
    without a token (the detokenizer's tail) joins the token before it, so the texts of all
    tokens add up to the completion's text. Among the alternatives the chosen token has that same
    text (OpenAI's `top_logprobs` holds `tokens[i]` as a key); the others are `text_of(id)`.
    """
    out: list[list] = []
    for ev in events:
        if ev.get("logprob") is not None:
            out.append([str(ev.get("text") or ""), ev["logprob"], ev.get("top_logprobs") or [], ev.get("token_id")])
        elif out and ev.get("token_id") is None:
            out[-1][0] += str(ev.get("text") or "")
    return [(text, lp, [(text if chosen is not None and int(i) == int(chosen) else text_of(i), x) for i, x in top])
            for text, lp, top, chosen in out]


# ---- running a generation for an HTTP client ------------------------------------------------
#: events a streaming request may have waiting for its client before it is ended
SSE_BUFFER_EVENTS = 256
#: of those, kept for the end of the stream (finish, usage, error and end markers)
_END_EVENTS = 4


async def generate_whole(s, res, generate: Callable[[Callable], Awaitable[dict]],
                         fields: Optional[dict[str, str]] = None) -> tuple[dict, list[dict]]:
    """Run `generate(emit)` for a client that wants one answer; return (result, its events).

    `fields`: as for `generation_error` (the client API's names of the request's fields).

    The session ends the request whose `emit` raises (ring.py), so a client that left ends its
    request there; a trio cancellation of generate mid-send could break a link
    (`res.cancel_on_disconnect` is set False for that).

    Raises:
        ClientGone: the client closed its connection.
        HttpError: the generation's error as an answer (`generation_error`).
    """
    res.cancel_on_disconnect = False
    generate = metered(generate)
    events: list[dict] = []

    async def on_event(ev: dict) -> None:
        if res.client_gone.is_set():
            raise ClientGone("the client closed its connection")
        events.append(ev)
    try:
        result = await generate(on_event)
    except KafilaError as e:
        if res.client_gone.is_set():
            raise ClientGone("the client closed its connection") from None
        raise generation_error(e, s, fields) from None
    if res.client_gone.is_set():
        raise ClientGone("the client closed its connection")
    return result, events


async def stream_generation(s, res, generate: Callable[[Callable], Awaitable[dict]], *, content_type: str,
                            token_payloads: Callable[[dict], list[bytes]],
                            end_payloads: Callable[[dict], list[bytes]],
                            error_payloads: Callable[[str], list[bytes]],
                            fields: Optional[dict[str, str]] = None) -> None:
    """Stream one generation (SSE or NDJSON); the generation never waits for the client.

    The 200 and its headers go with the first payload, so a request refused before its first
    token (the host's queue is full: 429; the prompt too long: 400) gets its real status and a
    request waiting in the queue sends nothing meanwhile. A client that reads slower than tokens
    come gets SSE_BUFFER_EVENTS payloads of slack; past it its request is ended and the stream says so.

    Args:
        generate: `generate(emit)` runs the request (the session's generate) and returns its result.
        token_payloads: the encoded payloads for one token event (may be none).
        end_payloads: the payloads that end a completed stream, given the result.
        error_payloads: the payloads that end a stream with an error sentence.
        fields: as for `generation_error` (the client API's names of the request's fields).
    Raises:
        ClientGone: the client closed its connection. HttpError: the request failed before its
            first payload.
    """
    res.cancel_on_disconnect = False
    generate = metered(generate)
    send, recv = trio.open_memory_channel(SSE_BUFFER_EVENTS)
    state = {"slow": False, "gone": False, "pushed": False}
    failure: Optional[KafilaError] = None

    def push(data: bytes) -> None:
        state["pushed"] = True
        try:
            send.send_nowait(data)
        except trio.WouldBlock:  # only end payloads can find the buffer full: tokens stop short of it
            pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):  # the writer ended: the client is gone
            pass

    async def writer() -> None:
        async with recv:
            try:
                async for data in recv:
                    if not res.started:
                        await res.start(200, [("content-type", content_type), ("cache-control", "no-cache")])
                    await res.write(data)
                    TIMELINE.mark("sse")
            except ClientGone:
                state["gone"] = True

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            with send:
                async def on_token(ev: dict) -> None:
                    if state["gone"] or res.client_gone.is_set():
                        raise ClientGone("the client closed its connection")
                    payloads = token_payloads(ev)
                    if not payloads:
                        return
                    if send.statistics().current_buffer_used + len(payloads) > SSE_BUFFER_EVENTS - _END_EVENTS:
                        state["slow"] = True
                        raise ClientGone(f"the client fell {SSE_BUFFER_EVENTS} events behind")
                    for p in payloads:
                        push(p)

                try:
                    result = await generate(on_token)
                    if not state["slow"]:
                        for p in end_payloads(result):
                            push(p)
                except KafilaError as e:
                    if state["pushed"] or isinstance(e, GenerationCancelled):
                        if not state["slow"]:
                            for p in error_payloads(generation_error(e, s, fields).message):
                                push(p)
                    else:  # nothing was sent: answered with its status below
                        failure = e
                if state["slow"]:
                    log.info("http: ended a streaming request: its client fell %d events behind", SSE_BUFFER_EVENTS)
                    for p in error_payloads(f"The client read the stream too slowly ({SSE_BUFFER_EVENTS} events "
                                            "behind); the request was ended."):
                        push(p)
    except BaseException as e:  # the daemon stops mid-stream: the stream ends with a sentence, not silently
        if not only_cancelled(e):
            raise
        if res.started and not (state["gone"] or res.client_gone.is_set()):
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                try:
                    for p in error_payloads(SHUTTING_DOWN_MID_STREAM):
                        await res.write(p)
                    await res.end()
                except (ClientGone, h11.LocalProtocolError):
                    pass
        raise
    if state["gone"] or res.client_gone.is_set():
        raise ClientGone("the client closed its connection")
    if failure is not None:
        raise generation_error(failure, s, fields)
    await res.end()
