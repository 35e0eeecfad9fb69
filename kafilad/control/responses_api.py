"""The OpenAI Responses API on the host's HTTP port (https://platform.openai.com/docs/api-reference/responses),
so clients that speak it (the `openai` client's `responses.create`, the OpenAI Agents SDK's default
model class) work against a Kafila session. Its route sits in kafilad/control/openai_api.py's table:

```
POST /v1/responses   {"model", "input": str | [message items], "instructions"?, "max_output_tokens"?, ...} -> "response"
```
Request (`ResponsesRequest`; strict types, unknown fields refused, each error a 400 naming the
field): `input` is a string (one user turn) or a list of items: messages `{"type"?: "message",
"role": user | assistant | system | developer, "content": str | [{"type": "input_text" |
"output_text", "text"}]}` (`id`, `status`, `annotations` and `logprobs` of earlier output are
accepted and not used), earlier calls `{"type": "function_call", "call_id", "name", "arguments"}`
and their results `{"type": "function_call_output", "call_id", "output"}`; `instructions`
becomes a system turn before them. `tools` [{"type": "function", "name", "description",
"parameters", "strict"}], `tool_choice` (none | auto | required | {"type": "function", "name"}),
`parallel_tool_calls` and the conversation go the OpenAI chat route's way
(kafilad/control/tools.py: the chat template's own call format or the Hermes convention; a
forced call's arguments match its schema by construction). `text.format` json_object /
json_schema {"name", "schema", "strict"} constrains the reply (kafilad/control/grammars.py) when
it is text: a forced call's grammar takes its place, and while it holds (tool_choice auto) the
reply is that JSON, not a call (the Agents SDK's `output_type` after its tool turns).
`max_output_tokens` (default: DEFAULT_OUTPUT_TOKENS, at most what the context leaves),
`temperature` ([0, 2]; default 0: greedy, as on this server's other routes), `top_p`, `stream`;
`metadata`, `user`, `safety_identifier`, `prompt_cache_key`, `store`, `stream_options`,
`truncation: "disabled"`, `text.verbosity` and an empty `include` list are accepted without effect.

Stateless: this server keeps no responses. `store` is accepted (an answer says `"store": false`:
nothing was stored), and `previous_response_id` is refused with a 400 naming it: send the whole
conversation in `input`. Also refused by name: tools other than functions (web_search,
file_search, ...), items other than the three above (reasoning, item_reference, ...), content
parts other than text (input_image, input_file), `reasoning`, `background`, `conversation`,
`prompt`, `truncation: "auto"`, `include` entries, `top_logprobs`, `max_tool_calls`.

Answer (whole): a "response" object, `status` "completed", or "incomplete" with
`incomplete_details: {"reason": "max_output_tokens"}` when the generation hit that limit; its
`output`: the reply's text as a message item `{"type": "message", "role": "assistant",
"content": [{"type": "output_text", "text", "annotations": []}]}` (when there is text, or no
call), then a `{"type": "function_call", "id": "fc_...", "call_id", "name", "arguments"}` item
per call; `usage` {input_tokens, output_tokens, total_tokens, details}. With `"stream": true`,
Server-Sent Events named by their `type`, each with a `sequence_number`:

```
response.created             {"response": {... "status": "in_progress", "output": []}}
response.in_progress         {"response": {...}}
  per message item:
response.output_item.added   {"output_index": i, "item": {"type": "message", "status": "in_progress", "content": []}}
response.content_part.added  {"item_id", "output_index": i, "content_index": 0, "part": {"type": "output_text", "text": ""}}
response.output_text.delta   {"item_id", "output_index": i, "content_index": 0, "delta"}          (per piece)
response.output_text.done    {"item_id", "output_index": i, "content_index": 0, "text"}
response.content_part.done   {"item_id", "output_index": i, "content_index": 0, "part"}
response.output_item.done    {"output_index": i, "item": {... "status": "completed"}}
  per call: response.output_item.added (the function_call item, "arguments": ""),
  response.function_call_arguments.delta (the whole arguments), response.function_call_arguments.done,
  response.output_item.done
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

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kafilad.control.api_common import (check_model, default_max_tokens, generate_whole, json_object, model_id,
                                        serving_session, stream_generation)
from kafilad.control.grammars import ANY_OBJECT, json_grammar
from kafilad.control.http_server import Request, Responder
from kafilad.control.openai_schema import FUNCTION_NAME, MAX_TOKENS_LIMIT, parse_body, refusal
from kafilad.control.tools import ToolCallText, tool_prompt
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


def _joined(v: Any, kinds: tuple[str, ...]) -> Any:
    """A string, or the text of a list of text parts (`kinds`) joined; else a refusal."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise refusal(f"must be a string or a list of {kinds[0]} parts.")
    texts = []
    for i, part in enumerate(v):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in kinds:
            raise refusal(f"holds a part of type '{kind[:30]}' (part {i}); this server takes text only "
                          f"({{\"type\": \"{kinds[0]}\", \"text\": ...}}).")
        if kind is None or not isinstance(part.get("text"), str) or set(part) - {"type", "text", "annotations",
                                                                                 "logprobs"}:
            raise refusal(f"must hold parts of the form {{\"type\": \"{kinds[0]}\", \"text\": string}} "
                          f"(part {i} is not).")
        texts.append(part["text"])
    return "".join(texts)


#: the fields each kind of input item may carry (besides "type", "id" and "status")
_ITEM_FIELDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                "function_call_output": ("call_id", "output")}


class InputItem(_Model):
    """An item of `input`: a message, an earlier function call, or a call's output."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    id: Optional[str] = None
    status: Optional[str] = None
    role: Optional[Literal["user", "assistant", "system", "developer"]] = None
    content: Optional[str] = None
    call_id: Optional[str] = Field(None, min_length=1, max_length=256)
    name: Optional[str] = Field(None, pattern=FUNCTION_NAME)
    arguments: Optional[str] = None
    output: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        return None if v is None else _joined(v, ("input_text", "output_text"))

    @field_validator("output", mode="before")
    @classmethod
    def _output(cls, v: Any) -> Any:
        return None if v is None else _joined(v, ("input_text",))

    @model_validator(mode="after")
    def _fields_of_its_type(self):
        wanted = _ITEM_FIELDS[self.type]
        for name in wanted:
            if getattr(self, name) is None:
                raise refusal(f"is a {self.type} item and needs '{name}'.")
        for name in {f for fs in _ITEM_FIELDS.values() for f in fs} - set(wanted):
            if getattr(self, name) is not None:
                raise refusal(f"is a {self.type} item and cannot carry '{name}'.")
        return self


class FunctionTool(_Model):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self):
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise refusal("'text.format' of type 'json_schema' needs 'schema' (and only it has one).")
        return self


class TextConfig(_Model):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None  # no effect: the model decides its length


class StreamOptions(_Model):
    include_obfuscation: Optional[bool] = None


class ResponsesRequest(_Model):
    """The body of POST /v1/responses (module docstring)."""

    model: Optional[str] = None
    input: list[InputItem] = Field(min_length=1)
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
    tools: Optional[list[FunctionTool]] = Field(None, max_length=128)
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
                if isinstance(kind, str) and kind not in _ITEM_FIELDS:
                    raise refusal(f"'input[{i}]' is an item of type '{kind[:30]}', which is not supported: this "
                                  "server takes message, function_call and function_call_output items.")
            return v
        raise refusal("'input' must be a string or a list of message items ({\"role\", \"content\"}).")

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, v: Any) -> Any:
        for i, t in enumerate(v if isinstance(v, list) else ()):
            kind = t.get("type") if isinstance(t, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise refusal(f"'tools[{i}]' is a tool of type '{kind[:30]}', which is not supported: this server "
                              "calls function tools only.")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is None or v in ("none", "auto", "required"):
            return v
        if (isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("name"), str)
                and set(v) == {"type", "name"}):
            return v
        raise refusal("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                      "\"name\"}.")

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

    @field_validator("include")
    @classmethod
    def _include(cls, v: Optional[list]) -> Optional[list]:
        if v:
            raise refusal("'include' is not supported: this server adds nothing to its answers.")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v, info):
        if v is not None and not info.data.get("stream"):
            raise refusal("'stream_options' is only allowed when 'stream' is true.")
        return v

    def prompt_messages(self) -> list[dict]:
        """The conversation in OpenAI chat form (kafilad/control/tools.py takes it): `instructions`
        first, "developer" as "system", function calls as the assistant's `tool_calls` (joined to
        the assistant turn before them), their outputs as `tool` messages."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        for item in self.input:
            if item.type == "message":
                out.append({"role": "system" if item.role == "developer" else item.role, "content": item.content})
            elif item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out

    def tool_dicts(self) -> Optional[list[dict]]:
        """The tools as OpenAI chat tool objects (None without tools)."""
        return [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
                for t in self.tools] if self.tools else None

    def tool_choice_value(self) -> Any:
        """`tool_choice` as the OpenAI chat route takes it."""
        if isinstance(self.tool_choice, dict):
            return {"type": "function", "function": {"name": self.tool_choice["name"]}}
        return self.tool_choice

    def grammar(self) -> Optional[str]:
        """The grammar of `text.format` json_object / json_schema (kafilad/control/grammars.py), else None."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return json_grammar(ANY_OBJECT, param="text.format")
        return json_grammar(fmt.schema_, param="text.format.schema")


def parse_responses(body: dict) -> ResponsesRequest:
    """Raises HttpError 400 naming the field (module docstring)."""
    return parse_body(ResponsesRequest, body, _UNSUPPORTED, _SENTENCES)


# ---- answers ------------------------------------------------------------------------------------
def sse(doc: dict) -> bytes:
    """One Server-Sent Event named by its `type`."""
    return f"event: {doc['type']}\ndata: {json.dumps(doc)}\n\n".encode()


class _Answer:
    """The response object of one request and its output items as they are made (module docstring)."""

    def __init__(self, r: ResponsesRequest, model: str, max_tokens: int):
        self.r, self.model, self.max_tokens = r, model, max_tokens
        self.rid = "resp_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.seq = 0
        self.items: list[dict] = []  # finished output items
        self.open: Optional[dict] = None  # the message item text is being streamed into

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def message(text: Optional[str]) -> dict:
        """An output message item; None: one in progress (no content yet)."""
        return {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24],
                "status": "in_progress" if text is None else "completed", "role": "assistant",
                "content": [] if text is None else [_Answer.part(text)]}

    @staticmethod
    def function_call(call: dict) -> dict:
        """An output function_call item of a parsed call (kafilad/control/tools.py `openai_call`)."""
        return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}

    def output(self, text: str, calls: list[dict]) -> list[dict]:
        """The output items of a whole reply: its text as a message (when any, or when there is no
        call), then one function_call item per call."""
        return ([self.message(text)] if text or not calls else []) + [self.function_call(c) for c in calls]

    def response(self, result: Optional[dict] = None, output: Optional[list[dict]] = None, *,
                 status: Optional[str] = None, error: Optional[dict] = None) -> dict:
        r = self.r
        incomplete, usage = False, None
        if result is not None:
            incomplete = result.get("finish_reason") == "length"
            status = "incomplete" if incomplete else "completed"
            n_in, n_out = result["prompt_tokens"], len(result["token_ids"])
            cached = int(result.get("cached_tokens") or 0)  # from the prompt cache (kafilad/executor/prefix.py)
            usage = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": n_out,
                     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}
        fmt = r.text.format if r.text is not None and r.text.format is not None else None
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": r.instructions, "max_output_tokens": self.max_tokens, "model": self.model,
                "output": output or [], "parallel_tool_calls": r.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": 0.0 if r.temperature is None else r.temperature,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                "tool_choice": r.tool_choice or "auto",
                "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
                "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": "disabled", "usage": usage,
                "user": r.user, "metadata": r.metadata or {}}

    # ---- streaming (each method returns the events it makes, encoded) ----
    def event(self, kind: str, **fields) -> bytes:
        doc = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(doc)

    def started(self) -> bytes:
        return (self.event("response.created", response=self.response(status="in_progress"))
                + self.event("response.in_progress", response=self.response(status="in_progress")))

    def open_text(self) -> bytes:
        """Begin a message item for text (nothing when one is open)."""
        if self.open is not None:
            return b""
        self.open = {**self.message(None), "text": ""}
        item = {k: v for k, v in self.open.items() if k != "text"}
        return (self.event("response.output_item.added", output_index=len(self.items), item=item)
                + self.event("response.content_part.added", **self._where(), part=self.part("")))

    def text(self, delta: str) -> bytes:
        out = self.open_text()
        self.open["text"] += delta
        return out + self.event("response.output_text.delta", **self._where(), delta=delta, logprobs=[])

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}

    def close_text(self) -> bytes:
        if self.open is None:
            return b""
        text, where = self.open["text"], self._where()
        item = {**{k: v for k, v in self.open.items() if k != "text"}, "status": "completed",
                "content": [self.part(text)]}
        out = (self.event("response.output_text.done", **where, text=text, logprobs=[])
               + self.event("response.content_part.done", **where, part=self.part(text))
               + self.event("response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        self.open = None
        return out

    def call(self, call: dict) -> bytes:
        out = self.close_text()
        item = self.function_call(call)
        index = len(self.items)
        out += self.event("response.output_item.added", output_index=index,
                          item={**item, "arguments": "", "status": "in_progress"})
        out += self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=item["arguments"])
        out += self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          name=item["name"], arguments=item["arguments"])
        out += self.event("response.output_item.done", output_index=index, item=item)
        self.items.append(item)
        return out


async def _responses(node, request: Request, res: Responder) -> None:
    r = parse_responses(json_object(request.body))
    s = await serving_session(node, res.client_gone)
    check_model(s, r.model)
    prompt, plan, grammar = await tool_prompt(s, r.prompt_messages(), r.tool_dicts(), r.tool_choice_value(),
                                              r.parallel_tool_calls)
    grammar = grammar or r.grammar()
    sampling = Sampling(temperature=r.temperature or 0.0, top_p=1.0 if r.top_p is None else r.top_p, grammar=grammar)
    calls = ToolCallText(plan) if plan is not None and plan.parses else None
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
        text, found = result["text"], []
        if calls is not None:
            content, found = calls.feed(text)
            rest, more = calls.finish()
            text, found = content + rest, found + more
        await res.send(200, json.dumps(answer.response(result, answer.output(text, found))).encode())
        return

    begun = [False]

    def begin() -> bytes:
        if begun[0]:
            return b""
        begun[0] = True
        return answer.started()

    def pieces(text: str, found: list[dict]) -> bytes:
        return (answer.text(text) if text else b"") + b"".join(answer.call(c) for c in found)

    def token_payloads(ev: dict) -> list[bytes]:
        text, found = str(ev.get("text") or ""), []
        if calls is not None:
            text, found = calls.feed(text)
        if not text and not found:
            return []
        return [begin() + pieces(text, found)]

    def end_payloads(result: dict) -> list[bytes]:
        out = begin()
        if calls is not None:
            out += pieces(*calls.finish())
        if not answer.items:  # no call and no text yet: one (empty) message, as a whole answer has
            out += answer.open_text()
        out += answer.close_text()
        whole = answer.response(result, answer.items)
        return [out + answer.event("response." + whole["status"], response=whole)]

    def error_payloads(message: str) -> list[bytes]:
        return [begin() + answer.event("response.failed", response=answer.response(
            output=answer.items, status="failed", error={"code": "server_error", "message": message}))]

    await stream_generation(s, res, generate, content_type="text/event-stream", token_payloads=token_payloads,
                            end_payloads=end_payloads, error_payloads=error_payloads, fields=RESPONSES_FIELDS)


#: path -> (methods, handler), registered in kafilad/control/openai_api.py's route table
ROUTES = {"/v1/responses": (("POST",), _responses)}

__all__ = ["ROUTES", "ResponsesRequest", "InputItem", "parse_responses", "DEFAULT_OUTPUT_TOKENS"]
