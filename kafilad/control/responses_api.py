"""The OpenAI Responses API on the host's HTTP port (https://platform.openai.com/docs/api-reference/responses),
so clients that speak it (the `openai` client's `responses.create`, the OpenAI Agents SDK's default
model class) work against a Kafila session. Its route sits in kafilad/control/openai_api.py's table:

```
POST /v1/responses   {"model", "input": str | [message items], "instructions"?, "max_output_tokens"?, ...} -> "response"
```
Request (`ResponsesRequest`; strict types, unknown fields refused, each error a 400 naming the
field): `input` is a string (one user turn) or a list of message items `{"type"?: "message",
"role": user | assistant | system | developer, "content": str | [{"type": "input_text" |
"output_text", "text"}]}` (`id`, `status`, `annotations` and `logprobs` of earlier output are
accepted and not used); `instructions` becomes a system turn before them; then the model's chat
template (api_common.chat_prompt). `max_output_tokens` (default: DEFAULT_OUTPUT_TOKENS, at most
what the context leaves), `temperature` ([0, 2]; default 0: greedy, as on this server's other
routes), `top_p`, `stream`; `metadata`, `user`, `safety_identifier`, `prompt_cache_key`,
`parallel_tool_calls`, `store`, `stream_options`, `truncation: "disabled"`, `text: {"format":
{"type": "text"}}`, an empty `tools` / `include` list and `tool_choice` "auto" or "none" are
accepted without effect.

Stateless: this server keeps no responses. `store` is accepted (an answer says `"store": false`:
nothing was stored), and `previous_response_id` is refused with a 400 naming it: send the whole
conversation in `input`. Also refused by name: `tools` that are not empty and a `tool_choice`
that asks for a tool (this server does not call tools yet), items other than messages
(function_call, function_call_output, reasoning, item_reference, ...) and content parts other than
text (input_image, input_file), `reasoning`, `background`, `conversation`, `prompt`,
`truncation: "auto"`, `include` entries, `top_logprobs`, `max_tool_calls` and `text.format`
json_object / json_schema.

Answer (whole): a "response" object, `status` "completed", or "incomplete" with
`incomplete_details: {"reason": "max_output_tokens"}` when the generation hit that limit, one
output item `{"type": "message", "role": "assistant", "content": [{"type": "output_text",
"text", "annotations": []}]}`, and `usage` {input_tokens, output_tokens, total_tokens, details}.
With `"stream": true`, Server-Sent Events named by their `type`, each with a `sequence_number`:

```
response.created             {"response": {... "status": "in_progress", "output": []}}
response.in_progress         {"response": {...}}
response.output_item.added   {"output_index": 0, "item": {"type": "message", "status": "in_progress", "content": []}}
response.content_part.added  {"item_id", "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": ""}}
response.output_text.delta   {"item_id", "output_index": 0, "content_index": 0, "delta"}          (per piece)
response.output_text.done    {"item_id", "output_index": 0, "content_index": 0, "text"}
response.content_part.done   {"item_id", "output_index": 0, "content_index": 0, "part"}
response.output_item.done    {"output_index": 0, "item": {... "status": "completed"}}
response.completed           {"response": {... the whole answer}}    (response.incomplete at max_output_tokens)
```
An error after the stream began ends it with `response.failed` (`"error": {"code": "server_error",
"message"}`). Errors before are OpenAI's `{"error": {...}}` with their status, as on the other
/v1 routes; generation is theirs too (queue and 429, stop on client gone, kafilad/control/api_common.py).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kafilad.control.api_common import (HttpError, chat_prompt, check_model, default_max_tokens, generate_whole,
                                        json_object, model_id, serving_session, stream_generation)
from kafilad.control.http_server import Request, Responder
from kafilad.control.openai_schema import MAX_TOKENS_LIMIT, parse_body, refusal
from kafilad.errors import ContextTooLongError
from kafilad.proto.sampling import Sampling

#: max_output_tokens when the request gives none (at most what the context leaves)
DEFAULT_OUTPUT_TOKENS = 256
#: the session's names of the request's fields (api_common.generation_error) -> the Responses API's
RESPONSES_FIELDS = {"max_tokens": "max_output_tokens"}

_NO_TOOLS = "this server does not call tools"
#: Responses fields this server knows and does not offer, and why
_UNSUPPORTED = {
    "reasoning": "this server runs no reasoning models' effort settings",
    "background": "this server answers in the foreground only",
    "conversation": "this server is stateless; send the whole conversation in 'input'",
    "prompt": "this server keeps no prompt templates",
    "top_logprobs": "this server's Responses API reports no log-probabilities",
    "max_tool_calls": _NO_TOOLS,
    "service_tier": "this server has one service tier",
}


#: field -> the sentence for any type or range error of it
_SENTENCES = {
    "model": "'model' must be a string.",
    "max_output_tokens": f"'max_output_tokens' must be a positive integer of at most {MAX_TOKENS_LIMIT} (or null).",
    "temperature": "'temperature' must be a number between 0 and 2 (or null).",
    "top_p": "'top_p' must be a number between 0 and 1 (or null).",
    "stream": "'stream' must be true or false.",
    "store": "'store' must be true or false.",
    "instructions": "'instructions' must be a string.",
    "metadata": "'metadata' must map strings to strings.",
    "truncation": "'truncation' must be \"disabled\".",
    "input": "'input' must be a string or a non-empty list of message items ({\"role\", \"content\"}).",
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class InputMessage(_Model):
    """A message item of `input`."""

    type: Optional[Literal["message"]] = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str
    id: Optional[str] = None
    status: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise refusal("must be a string or a list of input_text parts.")
        texts = []
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("input_text", "output_text"):
                raise refusal(f"holds a part of type '{kind[:30]}' (part {i}); this server takes text only "
                              "({\"type\": \"input_text\", \"text\": ...}).")
            if (kind is None or not isinstance(part.get("text"), str)
                    or set(part) - {"type", "text", "annotations", "logprobs"}):
                raise refusal(f"must hold parts of the form {{\"type\": \"input_text\", \"text\": string}} "
                              f"(part {i} is not).")
            texts.append(part["text"])
        return "".join(texts)


class TextFormat(_Model):
    type: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v != "text":
            raise refusal(f"'text.format' {{\"type\": \"{v[:20]}\"}} is not supported; this server generates "
                          "free text only ({\"type\": \"text\"}).")
        return v


class TextConfig(_Model):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["medium"]] = None


class StreamOptions(_Model):
    include_obfuscation: Optional[bool] = None


class ResponsesRequest(_Model):
    """The body of POST /v1/responses (module docstring)."""

    model: Optional[str] = None
    input: list[InputMessage] = Field(min_length=1)
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    truncation: Optional[Literal["disabled"]] = None
    text: Optional[TextConfig] = None
    tools: Optional[list] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    include: Optional[list] = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"role": "user", "content": v}]
        if isinstance(v, list):
            for i, item in enumerate(v):
                kind = item.get("type") if isinstance(item, dict) else None
                if isinstance(kind, str) and kind != "message":
                    why = (_NO_TOOLS if kind.startswith("function_call") or kind.endswith("_call")
                           else "this server takes message items only")
                    raise refusal(f"'input[{i}]' is an item of type '{kind[:30]}', which is not supported: {why}.")
            return v
        raise refusal("'input' must be a string or a list of message items ({\"role\", \"content\"}).")

    @field_validator("previous_response_id")
    @classmethod
    def _stateless(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            raise refusal("'previous_response_id' is not supported: this server is stateless and keeps no "
                          "responses; send the whole conversation in 'input'.")
        return v

    @field_validator("truncation", mode="before")
    @classmethod
    def _truncation(cls, v: Any) -> Any:
        if v == "auto":
            raise refusal("'truncation': \"auto\" is not supported: this server does not drop turns; a "
                          "conversation longer than the context is refused (400).")
        return v

    @field_validator("tools", "include")
    @classmethod
    def _empty(cls, v: Optional[list], info) -> Optional[list]:
        if v:
            raise refusal(f"'tools' is not supported: {_NO_TOOLS}." if info.field_name == "tools" else
                          "'include' is not supported: this server adds nothing to its answers.")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v not in (None, "auto", "none"):
            raise refusal(f"'tool_choice' must be \"auto\" or \"none\": {_NO_TOOLS}.")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v, info):
        if v is not None and not info.data.get("stream"):
            raise refusal("'stream_options' is only allowed when 'stream' is true.")
        return v

    def prompt_messages(self) -> list[dict]:
        """The messages as the chat template takes them: `instructions` first, "developer" as "system"."""
        head = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return head + [{"role": "system" if m.role == "developer" else m.role, "content": m.content}
                       for m in self.input]


def parse_responses(body: dict) -> ResponsesRequest:
    """Raises HttpError 400 naming the field (module docstring)."""
    return parse_body(ResponsesRequest, body, _UNSUPPORTED, _SENTENCES)


# ---- answers ------------------------------------------------------------------------------------
def sse(doc: dict) -> bytes:
    """One Server-Sent Event named by its `type`."""
    return f"event: {doc['type']}\ndata: {json.dumps(doc)}\n\n".encode()


class _Answer:
    """The response object of one request as it is built (module docstring)."""

    def __init__(self, r: ResponsesRequest, model: str, max_tokens: int):
        self.r, self.model, self.max_tokens = r, model, max_tokens
        self.rid = "resp_" + uuid.uuid4().hex[:24]
        self.item_id = "msg_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.seq = 0

    def part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, text: Optional[str]) -> dict:
        """The output message; None: still in progress (no content yet)."""
        return {"type": "message", "id": self.item_id, "status": "in_progress" if text is None else "completed",
                "role": "assistant", "content": [] if text is None else [self.part(text)]}

    def response(self, result: Optional[dict] = None, *, status: Optional[str] = None,
                 error: Optional[dict] = None) -> dict:
        r = self.r
        if result is not None:
            incomplete = result.get("finish_reason") == "length"
            status = "incomplete" if incomplete else "completed"
            n_in, n_out = result["prompt_tokens"], len(result["token_ids"])
            usage = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n_out,
                     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}
        else:
            incomplete, usage = False, None
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": r.instructions, "max_output_tokens": self.max_tokens, "model": self.model,
                "output": [self.item(result["text"])] if result is not None else [],
                "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": 0.0 if r.temperature is None else r.temperature,
                "text": {"format": {"type": "text"}}, "tool_choice": r.tool_choice or "auto", "tools": [],
                "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": "disabled", "usage": usage,
                "user": r.user, "metadata": r.metadata or {}}

    def event(self, kind: str, **fields) -> bytes:
        doc = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(doc)


async def _responses(node, request: Request, res: Responder) -> None:
    r = parse_responses(json_object(request.body))
    s = await serving_session(node, res.client_gone)
    check_model(s, r.model)
    prompt = await chat_prompt(s, r.prompt_messages())
    sampling = Sampling(temperature=r.temperature or 0.0, top_p=1.0 if r.top_p is None else r.top_p)
    defaulted = r.max_output_tokens is None
    max_tokens = r.max_output_tokens or await default_max_tokens(s, prompt, DEFAULT_OUTPUT_TOKENS)
    answer = _Answer(r, model_id(s), max_tokens)

    async def generate(emit):
        try:
            return await s.generate(prompt, max_tokens=max_tokens, temperature=sampling.temperature, emit=emit,
                                    gone=res.client_gone, sampling=sampling)
        except ContextTooLongError as e:
            if defaulted:  # the client sent no max_output_tokens: the prompt alone fills the context
                e.prompt_field = "input"
            raise

    if not r.stream:
        result, _ = await generate_whole(s, res, generate, RESPONSES_FIELDS)
        await res.send(200, json.dumps(answer.response(result)).encode())
        return

    started = [False]
    where = {"item_id": answer.item_id, "output_index": 0, "content_index": 0}

    def start() -> bytes:
        if started[0]:
            return b""
        started[0] = True
        return b"".join([
            answer.event("response.created", response=answer.response(status="in_progress")),
            answer.event("response.in_progress", response=answer.response(status="in_progress")),
            answer.event("response.output_item.added", output_index=0, item=answer.item(None)),
            answer.event("response.content_part.added", **where, part=answer.part(""))])

    def token_payloads(ev: dict) -> list[bytes]:
        text = str(ev.get("text") or "")
        if not text:
            return []
        return [start() + answer.event("response.output_text.delta", **where, delta=text, logprobs=[])]

    def end_payloads(result: dict) -> list[bytes]:
        whole = answer.response(result)
        text = result["text"]
        return [start() + b"".join([
            answer.event("response.output_text.done", **where, text=text, logprobs=[]),
            answer.event("response.content_part.done", **where, part=answer.part(text)),
            answer.event("response.output_item.done", output_index=0, item=answer.item(text)),
            answer.event("response." + whole["status"], response=whole)])]

    def error_payloads(message: str) -> list[bytes]:
        return [start() + answer.event("response.failed", response=answer.response(
            status="failed", error={"code": "server_error", "message": message}))]

    await stream_generation(s, res, generate, content_type="text/event-stream", token_payloads=token_payloads,
                            end_payloads=end_payloads, error_payloads=error_payloads, fields=RESPONSES_FIELDS)


#: path -> (methods, handler), registered in kafilad/control/openai_api.py's route table
ROUTES = {"/v1/responses": (("POST",), _responses)}

__all__ = ["ROUTES", "ResponsesRequest", "InputMessage", "parse_responses", "DEFAULT_OUTPUT_TOKENS"]
