"""The Anthropic Messages API on the host's HTTP port (https://docs.anthropic.com/en/api/messages), so
Claude-style clients (the official `anthropic` client with `base_url="http://127.0.0.1:8400"`) work
against a Kafila session. Its routes sit in kafilad/control/openai_api.py's route table:

```
POST /v1/messages               {"model", "messages", "max_tokens", "system"?, "stream"?, ...} -> "message"
POST /v1/messages/count_tokens  {"model", "messages", "system"?}  -> {"input_tokens": N}
```
Request (`MessagesRequest`; strict types, unknown fields refused, each error a 400 naming the
field): `messages` [{role: user | assistant, content: str | [{"type": "text", "text"}]}] (at
least one; `cache_control` and `citations` on a text block are accepted without effect),
`max_tokens` (required, >= 1), `system` (str | [text blocks]), `temperature` ([0, 1]; default 0:
greedy, as on this server's other APIs, where Anthropic's is 1), `top_p`, `top_k` (0: off),
`stop_sequences` (up to MAX_STOP_SEQUENCES non-empty strings), `stream`. Accepted without
effect: `metadata` {user_id}, `cache_control`, `diagnostics`, `inference_geo`, `speed`,
`user_profile_id`, `workspace_id` and `output_config.effort` (newer clients send these; the
sampling fields are sent by older ones, or with `extra_body`). The messages go through the model's chat template with the system
prompt as a system turn (api_common.chat_prompt); a last assistant turn is rendered as a finished
turn, not continued (no prefill). Refused by name: `tools` that are not empty and a `tool_choice`
other than auto / none (this server does not call tools yet), `thinking`, `service_tier`, `container`, `mcp_servers`, and content blocks other
than text (image, document, tool_use, tool_result, ...), and `output_config.format` (structured
output).

Answer (whole): `{"id": "msg_...", "type": "message", "role": "assistant", "model", "content":
[{"type": "text", "text"}], "stop_reason": "end_turn" | "max_tokens" | "stop_sequence",
"stop_sequence": str | null, "usage": {"input_tokens", "output_tokens"}}`. With `"stream": true`,
Server-Sent Events with named events, as Anthropic streams them:

```
event: message_start        {"type": "message_start", "message": {... "content": [], "stop_reason": null,
                             "usage": {"input_tokens": N, "output_tokens": 0}}}
event: content_block_start  {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
event: ping                 {"type": "ping"}
event: content_block_delta  {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text"}}  (per piece)
event: content_block_stop   {"type": "content_block_stop", "index": 0}
event: message_delta        {"type": "message_delta", "delta": {"stop_reason", "stop_sequence"}, "usage": {"output_tokens"}}
event: message_stop         {"type": "message_stop"}
```
An error after the stream began is one `event: error` with `{"type": "error", "error": {"type":
"api_error", "message"}}`. Errors before are that body with their status (`error_body`): 400
invalid_request_error, 404 not_found_error (another model than the one served), 413
request_too_large, 429 rate_limit_error (the host's queue is full; `Retry-After`), 503
overloaded_error (no session ready; `Retry-After` while it is coming up), 500 api_error.
Generation is the OpenAI chat route's (kafilad/control/api_common.py): the session's queue, stop
strings never emitted, a client that leaves ends its request on the ring within one decode step.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kafilad.control.api_common import (HttpError, chat_prompt, check_model, generate_whole, json_object, model_id,
                                        prompt_tokens, ready_session, serving_session, stream_generation)
from kafilad.control.http_server import Request, Responder
from kafilad.control.openai_schema import MAX_TOKENS_LIMIT, parse_body, refusal
from kafilad.proto.sampling import Sampling

#: most stop sequences a request may give
MAX_STOP_SEQUENCES = 64
#: the route prefix whose errors take Anthropic's shape (kafilad/control/openai_api.py `handle`)
PREFIX = "/v1/messages"

#: the session's names of the request's fields (api_common.generation_error) -> Anthropic's
ANTHROPIC_FIELDS = {"stop": "stop_sequences"}

#: Anthropic fields this server knows and does not offer, and why
_UNSUPPORTED = {
    "thinking": "this server does not offer extended thinking",
    "service_tier": "this server has one service tier",
    "container": "this server runs no code containers",
    "mcp_servers": "this server connects to no MCP servers",
}

#: field -> the sentence for any type or range error of it
_SENTENCES = {
    "model": "'model' must be a string.",
    "max_tokens": f"'max_tokens' must be a positive integer of at most {MAX_TOKENS_LIMIT}.",
    "temperature": "'temperature' must be a number between 0 and 1.",
    "top_p": "'top_p' must be a number between 0 and 1.",
    "top_k": "'top_k' must be an integer of at least 0.",
    "stream": "'stream' must be true or false.",
    "messages": "'messages' must be a non-empty list of {role, content} objects.",
    "system": "'system' must be a string or a list of text blocks.",
    "metadata": "'metadata' must be an object with 'user_id' (a string).",
}

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> bytes:
    """Anthropic's error body for an answer with `status`: {"type": "error", "error": {"type", "message"}}."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


# ---- request bodies -----------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _texts(v: Any, what: str) -> Any:
    """A string, or the text of a list of text blocks joined (""); else a refusal naming the block type."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise refusal(f"must be a string or a list of content blocks ({what}).")
    out = []
    for i, block in enumerate(v):
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise refusal(f"holds a block of type '{kind[:30]}' (block {i}); this server takes text blocks only "
                          "({\"type\": \"text\", \"text\": ...}): it does not call tools or read images or "
                          "documents.")
        if (kind != "text" or not isinstance(block.get("text"), str)
                or set(block) - {"type", "text", "cache_control", "citations"}):
            raise refusal(f"must hold blocks of the form {{\"type\": \"text\", \"text\": string}} (block {i} is not).")
        out.append(block["text"])
    return "".join(out)


class Message(_Model):
    role: Literal["user", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        return _texts(v, "text blocks")


class Metadata(_Model):
    user_id: Optional[str] = None


class OutputConfig(_Model):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None  # no effect: no extended thinking
    format: Optional[Any] = None

    @field_validator("format")
    @classmethod
    def _no_format(cls, v: Any) -> Any:
        if v is not None:
            raise refusal("'output_config.format' is not supported: this server generates free text only.")
        return v


class _Prompted(_Model):
    model: Optional[str] = None
    messages: list[Message] = Field(min_length=1)
    system: Optional[str] = None

    @field_validator("system", mode="before")
    @classmethod
    def _system(cls, v: Any) -> Any:
        return None if v is None else _texts(v, "text blocks")

    def prompt_messages(self) -> list[dict]:
        """The messages as the chat template takes them, the system prompt first."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m.role, "content": m.content} for m in self.messages]


class MessagesRequest(_Prompted):
    """The body of POST /v1/messages (module docstring)."""

    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    stop_sequences: Optional[tuple[str, ...]] = None
    stream: Optional[bool] = None
    metadata: Optional[Metadata] = None
    tools: Optional[list] = None
    tool_choice: Optional[Any] = None
    # accepted without effect: prompt-cache hints, routing and accounting fields of Anthropic's service
    cache_control: Optional[dict] = None
    diagnostics: Optional[dict] = None
    inference_geo: Optional[str] = None
    speed: Optional[Literal["standard", "fast"]] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None
    output_config: Optional[OutputConfig] = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: Optional[list]) -> Optional[list]:
        if v:
            raise refusal("'tools' is not supported: this server does not call tools.")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is not None and not (isinstance(v, dict) and v.get("type") in ("auto", "none") and set(v) <= {
                "type", "disable_parallel_tool_use"}):
            raise refusal("'tool_choice' must be {\"type\": \"auto\"} or {\"type\": \"none\"}: this server does "
                          "not call tools.")
        return v

    @field_validator("stop_sequences", mode="before")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        if v is None:
            return None
        if (not isinstance(v, list) or len(v) > MAX_STOP_SEQUENCES
                or not all(isinstance(s, str) and s for s in v)):
            raise refusal(f"'stop_sequences' must be a list of at most {MAX_STOP_SEQUENCES} non-empty strings.")
        return tuple(v)


class CountTokensRequest(_Prompted):
    """The body of POST /v1/messages/count_tokens."""


def parse_messages(body: dict) -> MessagesRequest:
    """Raises HttpError 400 naming the field (module docstring)."""
    return parse_body(MessagesRequest, body, _UNSUPPORTED, _SENTENCES)


def parse_count_tokens(body: dict) -> CountTokensRequest:
    """Raises HttpError 400 naming the field (module docstring)."""
    return parse_body(CountTokensRequest, body, _UNSUPPORTED, _SENTENCES)


# ---- answers ------------------------------------------------------------------------------------
def stop_reason(result: dict) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of a finished generation (kafilad/node/host_requests.py result)."""
    if result.get("stop_sequence") is not None:
        return "stop_sequence", result["stop_sequence"]
    return ("max_tokens" if result.get("finish_reason") == "length" else "end_turn"), None


def sse(event: str, doc: dict) -> bytes:
    """One named Server-Sent Event."""
    return f"event: {event}\ndata: {json.dumps(doc)}\n\n".encode()


async def _messages(node, request: Request, res: Responder) -> None:
    r = parse_messages(json_object(request.body))
    s = await serving_session(node, res.client_gone)
    check_model(s, r.model)
    prompt = await chat_prompt(s, r.prompt_messages())
    sampling = Sampling(temperature=r.temperature or 0.0, top_p=1.0 if r.top_p is None else r.top_p,
                        top_k=r.top_k or 0)
    mid = "msg_" + uuid.uuid4().hex[:24]
    model = model_id(s)

    def generate(emit):
        return s.generate(prompt, max_tokens=r.max_tokens, temperature=sampling.temperature, emit=emit,
                          gone=res.client_gone, sampling=sampling, stop=r.stop_sequences or ())

    if not r.stream:
        result, _ = await generate_whole(s, res, generate, ANTHROPIC_FIELDS)
        reason, sequence = stop_reason(result)
        await res.send(200, json.dumps({
            "id": mid, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": result["text"]}], "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": result["prompt_tokens"], "output_tokens": len(result["token_ids"])}}).encode())
        return

    n_prompt = (await prompt_tokens(s, prompt, s.context))[0]  # message_start tells it before the first token
    started = [False]

    def start() -> bytes:  # the events before the first text (one payload: one slot of the stream's buffer)
        if started[0]:
            return b""
        started[0] = True
        return (sse("message_start", {"type": "message_start", "message": {
                    "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
                + sse("content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": {"type": "text", "text": ""}})
                + sse("ping", {"type": "ping"}))

    def token_payloads(ev: dict) -> list[bytes]:
        text = str(ev.get("text") or "")
        if not text:
            return []
        return [start() + sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                      "delta": {"type": "text_delta", "text": text}})]

    def end_payloads(result: dict) -> list[bytes]:
        reason, sequence = stop_reason(result)
        return [start()
                + sse("content_block_stop", {"type": "content_block_stop", "index": 0})
                + sse("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                        "usage": {"output_tokens": len(result["token_ids"])}})
                + sse("message_stop", {"type": "message_stop"})]

    def error_payloads(message: str) -> list[bytes]:
        return [sse("error", {"type": "error", "error": {"type": "api_error", "message": message}})]

    await stream_generation(s, res, generate, content_type="text/event-stream", token_payloads=token_payloads,
                            end_payloads=end_payloads, error_payloads=error_payloads, fields=ANTHROPIC_FIELDS)


async def _count_tokens(node, request: Request, res: Responder) -> None:
    r = parse_count_tokens(json_object(request.body))
    s = ready_session(node)
    check_model(s, r.model)
    prompt = await chat_prompt(s, r.prompt_messages())
    await res.send(200, json.dumps({"input_tokens": (await prompt_tokens(s, prompt))[0]}).encode())


#: path -> (methods, handler), registered in kafilad/control/openai_api.py's route table
ROUTES = {
    PREFIX: (("POST",), _messages),
    PREFIX + "/count_tokens": (("POST",), _count_tokens),
}

__all__ = ["ROUTES", "PREFIX", "MessagesRequest", "CountTokensRequest", "parse_messages", "parse_count_tokens",
           "error_body", "stop_reason", "MAX_STOP_SEQUENCES"]
