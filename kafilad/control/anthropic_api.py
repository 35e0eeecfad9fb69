"""The Anthropic Messages API on the host's HTTP port (https://docs.anthropic.com/en/api/messages), so
Claude-style clients (the official `anthropic` client with `base_url="http://127.0.0.1:8400"`) work
against a Kafila session. Its routes sit in kafilad/control/openai_api.py's route table:

```
POST /v1/messages               {"model", "messages", "max_tokens", "system"?, "stream"?, ...} -> "message"
POST /v1/messages/count_tokens  {"model", "messages", "system"?, "tools"?, "tool_choice"?}  -> {"input_tokens": N}
```
Request (`MessagesRequest`; strict types, unknown fields refused, each error a 400 naming the
field): `messages` [{role: user | assistant, content: str | [blocks]}] (at least one) whose
blocks are text ({"type": "text", "text"}; `cache_control` and `citations` accepted without
effect), tool_use ({"id", "name", "input"}, assistant turns) and tool_result ({"tool_use_id",
"content": str | [text blocks], "is_error"}, user turns); `max_tokens` (required, >= 1), `system`
(str | [text blocks]), `temperature` ([0, 1]; default 0: greedy, as on this server's other APIs,
where Anthropic's is 1), `top_p`, `top_k` (0: off), `stop_sequences` (up to MAX_STOP_SEQUENCES
non-empty strings), `stream`, `tools` [{"name", "description", "input_schema"}] (client tools),
`tool_choice` {type: auto | any | tool (+ name) | none, disable_parallel_tool_use},
`output_config.format` {"type": "json_schema", "schema"} (a text reply is constrained to match
it, kafilad/control/grammars.py; a forced call's grammar takes its place). Accepted without
effect: `metadata` {user_id}, `cache_control`, `diagnostics`, `inference_geo`, `speed`,
`user_profile_id`, `workspace_id` and `output_config.effort` (newer clients send these; the
sampling fields are sent by older ones, or with `extra_body`). Refused by name: `thinking`, `service_tier`, `container`, `mcp_servers`,
server tools (a `tools` entry with a `type` other than "custom": web search, code execution, ...)
and content blocks other than those three (image, document, thinking, ...).

Tools map onto the OpenAI chat route's (kafilad/control/tools.py): the tools go into the model's
chat template (the family's own call format, or the Hermes convention), tool_use blocks become
the assistant's `tool_calls` and tool_result blocks `tool` messages (an error result's content
begins "Error: "); `tool_choice` any is OpenAI's "required" and tool a named function, both
constrained so that the call's `input` matches its `input_schema`. The system prompt is a system
turn; a last assistant turn is rendered as a finished turn, not continued (no prefill).

Answer (whole): `{"id": "msg_...", "type": "message", "role": "assistant", "model", "content":
[{"type": "text", "text"} (when there is text, or no call), {"type": "tool_use", "id": "toolu_...",
"name", "input"} per call], "stop_reason": "end_turn" | "max_tokens" | "stop_sequence" |
"tool_use", "stop_sequence": str | null, "usage": {"input_tokens", "cache_read_input_tokens" (the
prompt's tokens the prompt cache held: not in input_tokens, as Anthropic counts),
"cache_creation_input_tokens": 0, "output_tokens"}}`. With
`"stream": true`, Server-Sent Events with named events, as Anthropic streams them:

```
event: message_start        {"type": "message_start", "message": {... "content": [], "stop_reason": null,
                             "usage": {"input_tokens": N, "output_tokens": 0}}}
event: ping                 {"type": "ping"}
event: content_block_start  {"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}}
event: content_block_delta  {"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text"}}  (per piece)
event: content_block_stop   {"type": "content_block_stop", "index": i}
   per tool call: content_block_start {"type": "tool_use", "id", "name", "input": {}}, one content_block_delta
   {"type": "input_json_delta", "partial_json": the whole input}, content_block_stop
event: message_delta        {"type": "message_delta", "delta": {"stop_reason", "stop_sequence"}, "usage": {... as whole}}
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

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kafilad.control.api_common import (check_model, generate_whole, json_object, model_id, prompt_tokens,
                                        ready_session, serving_session, stream_generation)
from kafilad.control.http_server import Request, Responder
from kafilad.control.grammars import json_grammar
from kafilad.control.openai_schema import FUNCTION_NAME, MAX_TOKENS_LIMIT, parse_body, refusal
from kafilad.control.tools import ToolCallText, tool_prompt
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
            raise refusal(f"holds a block of type '{kind[:30]}' (block {i}); only text blocks ({{\"type\": "
                          f"\"text\", \"text\": ...}}) are taken here.")
        if (kind != "text" or not isinstance(block.get("text"), str)
                or set(block) - {"type", "text", "cache_control", "citations"}):
            raise refusal(f"must hold blocks of the form {{\"type\": \"text\", \"text\": string}} (block {i} is not).")
        out.append(block["text"])
    return "".join(out)


#: the content blocks a message may hold, and the fields of each (besides "type" and "cache_control")
_BLOCK_FIELDS = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",)}


class Block(_Model):
    """A content block of a message: text, a tool_use (assistant) or a tool_result (user)."""

    type: Literal["text", "tool_use", "tool_result"]
    cache_control: Optional[dict] = None
    citations: Optional[Any] = None
    text: Optional[str] = None
    id: Optional[str] = Field(None, min_length=1, max_length=256)
    name: Optional[str] = Field(None, pattern=FUNCTION_NAME)
    input: Optional[dict] = None
    tool_use_id: Optional[str] = Field(None, min_length=1, max_length=256)
    content: Optional[str] = None
    is_error: Optional[bool] = None

    @field_validator("content", mode="before")
    @classmethod
    def _result_content(cls, v: Any) -> Any:
        return None if v is None else _texts(v, "text blocks")

    @model_validator(mode="after")
    def _fields_of_its_type(self):
        wanted = _BLOCK_FIELDS[self.type]
        for name in wanted:
            if getattr(self, name) is None:
                raise refusal(f"is a {self.type} block and needs '{name}'.")
        own = {"tool_result": ("tool_use_id", "content", "is_error"), "text": ("text", "citations")}.get(
            self.type, wanted)
        for name in ("text", "citations", "id", "name", "input", "tool_use_id", "content", "is_error"):
            if name not in own and getattr(self, name) is not None:
                raise refusal(f"is a {self.type} block and cannot carry '{name}'.")
        return self


class Message(_Model):
    role: Literal["user", "assistant"]
    content: list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        if not isinstance(v, list):
            raise refusal("must be a string or a list of content blocks.")
        for i, block in enumerate(v):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in _BLOCK_FIELDS:
                raise refusal(f"holds a block of type '{kind[:30]}' (block {i}); this server takes text, tool_use "
                              "and tool_result blocks: it does not read images or documents.")
        return v

    @model_validator(mode="after")
    def _blocks_of_its_role(self):
        for b in self.content:
            if b.type == "tool_use" and self.role != "assistant":
                raise refusal("holds a tool_use block, which only an assistant message may hold.")
            if b.type == "tool_result" and self.role != "user":
                raise refusal("holds a tool_result block, which only a user message may hold.")
        return self


class Metadata(_Model):
    user_id: Optional[str] = None


class OutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Model):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None  # no effect: no extended thinking
    format: Optional[OutputFormat] = None


class Tool(_Model):
    """A client tool (Anthropic's "custom" tools); server tools (web search, code execution) are refused."""

    type: Optional[Literal["custom"]] = None
    name: str = Field(pattern=FUNCTION_NAME)
    description: Optional[str] = None
    input_schema: dict
    cache_control: Optional[dict] = None
    strict: Optional[bool] = None


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = Field(None, pattern=FUNCTION_NAME)
    disable_parallel_tool_use: Optional[bool] = None

    @model_validator(mode="after")
    def _name_for_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise refusal("'tool_choice' of type 'tool' needs 'name' (and only it has one).")
        return self


class _Prompted(_Model):
    model: Optional[str] = None
    messages: list[Message] = Field(min_length=1)
    system: Optional[str] = None
    tools: Optional[list[Tool]] = Field(None, max_length=128)
    tool_choice: Optional[ToolChoice] = None

    @field_validator("system", mode="before")
    @classmethod
    def _system(cls, v: Any) -> Any:
        return None if v is None else _texts(v, "text blocks")

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools(cls, v: Any) -> Any:
        for i, t in enumerate(v if isinstance(v, list) else ()):
            kind = t.get("type") if isinstance(t, dict) else None
            if isinstance(kind, str) and kind != "custom":
                raise refusal(f"'tools[{i}]' is a tool of type '{kind[:40]}', which is not supported: this server "
                              "calls client tools ({\"name\", \"description\", \"input_schema\"}) only.")
        return v

    def prompt_messages(self) -> list[dict]:
        """The conversation in OpenAI chat form (kafilad/control/tools.py takes it): the system
        prompt first, tool_use blocks as the assistant's `tool_calls`, tool_result blocks as
        `tool` messages (before the rest of their user turn)."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for m in self.messages:
            text = "".join(b.text for b in m.content if b.type == "text")
            if m.role == "assistant":
                d = {"role": "assistant", "content": text}
                calls = [{"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                    for b in m.content if b.type == "tool_use"]
                out.append({**d, "tool_calls": calls} if calls else d)
                continue
            results = [b for b in m.content if b.type == "tool_result"]
            out += [{"role": "tool", "tool_call_id": b.tool_use_id,
                     "content": ("Error: " if b.is_error else "") + (b.content or "")} for b in results]
            if text or not results:
                out.append({"role": "user", "content": text})
        return out

    def tool_dicts(self) -> Optional[list[dict]]:
        """The tools as OpenAI chat tool objects (None without tools)."""
        return [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                  **({"description": t.description} if t.description else {})}}
                for t in self.tools] if self.tools else None

    def tool_choice_value(self) -> Any:
        """`tool_choice` as the OpenAI chat route takes it (any: "required", tool: the named function)."""
        c = self.tool_choice
        if c is None:
            return None
        if c.type == "tool":
            return {"type": "function", "function": {"name": c.name}}
        return {"any": "required"}.get(c.type, c.type)

    def parallel(self) -> Optional[bool]:
        """`parallel_tool_calls` of the OpenAI chat route (Anthropic's disable_parallel_tool_use, negated)."""
        c = self.tool_choice
        return None if c is None or c.disable_parallel_tool_use is None else not c.disable_parallel_tool_use


class MessagesRequest(_Prompted):
    """The body of POST /v1/messages (module docstring)."""

    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    stop_sequences: Optional[tuple[str, ...]] = None
    stream: Optional[bool] = None
    metadata: Optional[Metadata] = None
    # accepted without effect: prompt-cache hints, routing and accounting fields of Anthropic's service
    cache_control: Optional[dict] = None
    diagnostics: Optional[dict] = None
    inference_geo: Optional[str] = None
    speed: Optional[Literal["standard", "fast"]] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None
    output_config: Optional[OutputConfig] = None

    @field_validator("stop_sequences", mode="before")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        if v is None:
            return None
        if (not isinstance(v, list) or len(v) > MAX_STOP_SEQUENCES
                or not all(isinstance(s, str) and s for s in v)):
            raise refusal(f"'stop_sequences' must be a list of at most {MAX_STOP_SEQUENCES} non-empty strings.")
        return tuple(v)

    def grammar_schema(self) -> Optional[dict]:
        """The JSON schema `output_config.format` asks the reply to match, else None."""
        fmt = self.output_config.format if self.output_config is not None else None
        return None if fmt is None else fmt.schema_


class CountTokensRequest(_Prompted):
    """The body of POST /v1/messages/count_tokens."""


def parse_messages(body: dict) -> MessagesRequest:
    """Raises HttpError 400 naming the field (module docstring)."""
    return parse_body(MessagesRequest, body, _UNSUPPORTED, _SENTENCES)


def parse_count_tokens(body: dict) -> CountTokensRequest:
    """Raises HttpError 400 naming the field (module docstring)."""
    return parse_body(CountTokensRequest, body, _UNSUPPORTED, _SENTENCES)


# ---- answers ------------------------------------------------------------------------------------
def stop_reason(result: dict, called: bool = False) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of a finished generation (kafilad/node/serving/host_requests.py result);
    `called`: the reply holds tool calls ("tool_use" unless max_tokens cut it)."""
    if result.get("stop_sequence") is not None:
        return "stop_sequence", result["stop_sequence"]
    if result.get("finish_reason") == "length":
        return "max_tokens", None
    return ("tool_use" if called else "end_turn"), None


def usage(result: dict) -> dict:
    """A finished generation's `usage`: tokens read from the prompt cache (kafilad/executor/prefix.py)
    are `cache_read_input_tokens`, the rest of the prompt `input_tokens`, as Anthropic counts them."""
    cached = int(result.get("cached_tokens") or 0)
    return {"input_tokens": result["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": len(result["token_ids"])}


def tool_use(call: dict) -> dict:
    """The tool_use block of a parsed call (kafilad/control/tools.py `openai_call`); its arguments
    as the `input` object ({} when the family's parser gave text that is not a JSON object)."""
    try:
        args = json.loads(call["function"]["arguments"])
    except ValueError:
        args = None
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": args if isinstance(args, dict) else {}}


def sse(event: str, doc: dict) -> bytes:
    """One named Server-Sent Event."""
    return f"event: {event}\ndata: {json.dumps(doc)}\n\n".encode()


async def _prompt(s, r: _Prompted):
    """(prompt, ToolPlan, grammar) of a checked request: its tools through the OpenAI chat route's path."""
    return await tool_prompt(s, r.prompt_messages(), r.tool_dicts(), r.tool_choice_value(), r.parallel())


class _Blocks:
    """The content blocks of a streamed reply as they are made: text into an open text block, each
    tool call a whole tool_use block (start, one input_json_delta, stop)."""

    def __init__(self):
        self.n = 0  # blocks begun
        self.text_open = False

    def text(self, delta: str) -> bytes:
        out = b""
        if not self.text_open:
            out += sse("content_block_start", {"type": "content_block_start", "index": self.n,
                                               "content_block": {"type": "text", "text": ""}})
            self.text_open = True
        if delta:
            out += sse("content_block_delta", {"type": "content_block_delta", "index": self.n,
                                               "delta": {"type": "text_delta", "text": delta}})
        return out

    def close_text(self) -> bytes:
        if not self.text_open:
            return b""
        self.text_open = False
        self.n += 1
        return sse("content_block_stop", {"type": "content_block_stop", "index": self.n - 1})

    def call(self, call: dict) -> bytes:
        block = tool_use(call)
        out = self.close_text() + sse("content_block_start", {"type": "content_block_start", "index": self.n,
                                                              "content_block": {**block, "input": {}}})
        out += sse("content_block_delta", {"type": "content_block_delta", "index": self.n, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
        out += sse("content_block_stop", {"type": "content_block_stop", "index": self.n})
        self.n += 1
        return out


async def _messages(node, request: Request, res: Responder) -> None:
    r = parse_messages(json_object(request.body))
    s = await serving_session(node, res.client_gone)
    check_model(s, r.model)
    prompt, plan, grammar = await _prompt(s, r)
    if grammar is None and r.grammar_schema() is not None:
        grammar = json_grammar(r.grammar_schema(), param="output_config.format.schema")
    sampling = Sampling(temperature=r.temperature or 0.0, top_p=1.0 if r.top_p is None else r.top_p,
                        top_k=r.top_k or 0, grammar=grammar)
    calls = ToolCallText(plan) if plan is not None and plan.parses else None
    mid = "msg_" + uuid.uuid4().hex[:24]
    model = model_id(s)

    def generate(emit):
        return s.generate(prompt, max_tokens=r.max_tokens, temperature=sampling.temperature, emit=emit,
                          gone=res.client_gone, sampling=sampling, stop=r.stop_sequences or ())

    if not r.stream:
        result, _ = await generate_whole(s, res, generate, ANTHROPIC_FIELDS)
        text, found = result["text"], []
        if calls is not None:
            content, found = calls.feed(text)
            rest, more = calls.finish()
            text, found = content + rest, found + more
        reason, sequence = stop_reason(result, bool(found))
        blocks = ([{"type": "text", "text": text}] if text or not found else []) + [tool_use(c) for c in found]
        await res.send(200, json.dumps({
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(result)}).encode())
        return

    n_prompt = (await prompt_tokens(s, prompt, s.context))[0]  # message_start tells it before the first token
    started = [False]
    blocks = _Blocks()

    def start() -> bytes:  # the events before the first block (one payload: one slot of the stream's buffer)
        if started[0]:
            return b""
        started[0] = True
        return (sse("message_start", {"type": "message_start", "message": {
                    "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
                + sse("ping", {"type": "ping"}))

    def pieces(text: str, found: list[dict]) -> bytes:
        return (blocks.text(text) if text else b"") + b"".join(blocks.call(c) for c in found)

    def token_payloads(ev: dict) -> list[bytes]:
        text, found = str(ev.get("text") or ""), []
        if calls is not None:
            text, found = calls.feed(text)
        if not text and not found:
            return []
        return [start() + pieces(text, found)]

    def end_payloads(result: dict) -> list[bytes]:
        out = start()
        if calls is not None:
            out += pieces(*calls.finish())
        if blocks.n == 0:  # no call and no text yet: one (empty) text block, as a whole answer has
            out += blocks.text("")
        reason, sequence = stop_reason(result, bool(calls is not None and calls.calls))
        return [out + blocks.close_text()
                + sse("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                        "usage": usage(result)})
                + sse("message_stop", {"type": "message_stop"})]

    def error_payloads(message: str) -> list[bytes]:
        return [sse("error", {"type": "error", "error": {"type": "api_error", "message": message}})]

    await stream_generation(s, res, generate, content_type="text/event-stream", token_payloads=token_payloads,
                            end_payloads=end_payloads, error_payloads=error_payloads, fields=ANTHROPIC_FIELDS)


async def _count_tokens(node, request: Request, res: Responder) -> None:
    r = parse_count_tokens(json_object(request.body))
    s = ready_session(node)
    check_model(s, r.model)
    prompt, _, _ = await _prompt(s, r)
    await res.send(200, json.dumps({"input_tokens": (await prompt_tokens(s, prompt))[0]}).encode())


#: path -> (methods, handler), registered in kafilad/control/openai_api.py's route table
ROUTES = {
    PREFIX: (("POST",), _messages),
    PREFIX + "/count_tokens": (("POST",), _count_tokens),
}

__all__ = ["ROUTES", "PREFIX", "MessagesRequest", "CountTokensRequest", "parse_messages", "parse_count_tokens",
           "error_body", "stop_reason", "MAX_STOP_SEQUENCES"]
