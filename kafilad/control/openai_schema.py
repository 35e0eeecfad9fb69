"""Typed request bodies of the OpenAI-compatible API, mirroring https://platform.openai.com/docs/api-reference.

`parse_completion` / `parse_chat` validate a decoded JSON object with pydantic models (strict
types: no "5" for 5, no 1 for true; unknown fields refused) and raise
:class:`~kafilad.control.api_common.HttpError` 400 with one sentence naming the first field at
fault (and its `param`). Every accepted field is honoured; what this server cannot do (n > 1, echo,
suffix, images, the deprecated `functions`) is refused by name, never ignored. Extensions that
mlx_lm.server also accepts: `top_k`, `min_p`, `repetition_penalty`.

```
both        model, max_tokens (>= 1 | null), temperature ([0, 2] | null), top_p ([0, 1]), n (1), stream,
            stream_options {include_usage} (with stream only), stop (str | [str] up to 4, non-empty),
            presence_penalty, frequency_penalty ([-2, 2]), logit_bias {"token id": [-100, 100]},
            seed (int64 / uint64), user, top_k, min_p, repetition_penalty
completions prompt (str, or [str] of one), logprobs (0..5), echo (false), suffix (null), best_of (1)
chat        messages [{role: system | developer | user | assistant | tool, content: str | [{type: "text", text}]
            | null, name, tool_calls (assistant), tool_call_id (tool)}], max_completion_tokens, logprobs (bool),
            top_logprobs (0..20, with logprobs), response_format {type: text | json_object | json_schema},
            tools [{type: function, function: {name, description, parameters}}],
            tool_choice (none | auto | required | {type: function, function: {name}}), parallel_tool_calls
```
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kafilad.control.api_common import HttpError
from kafilad.proto.sampling import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES

MAX_TOKENS_LIMIT = 2**31 - 1
#: most stop sequences a request may give (OpenAI's limit)
MAX_STOPS = 4


def refusal(sentence: str) -> PydanticCustomError:
    """A validation error whose message is `sentence` as it stands (error_sentence keeps it)."""
    return PydanticCustomError("kafila", sentence)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: Optional[bool] = None


class _Common(_Model):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    n: Optional[int] = Field(None, ge=1, le=1)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    stop: Optional[tuple[str, ...]] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[tuple[tuple[int, float], ...]] = None
    seed: Optional[int] = Field(None, ge=-2**63, le=2**64 - 1)
    user: Optional[str] = None
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if (not isinstance(stops, list) or not 1 <= len(stops) <= MAX_STOPS
                or not all(isinstance(s, str) and s for s in stops)):
            raise refusal(f"'stop' must be a non-empty string or a list of 1 to {MAX_STOPS} non-empty strings.")
        return tuple(stops)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v: Any) -> Any:
        if v is None:
            return None
        sentence = (f"'logit_bias' must map token ids (integers written as strings, e.g. \"50256\") to numbers "
                    f"between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}.")
        if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS_ENTRIES:
            raise refusal(sentence if isinstance(v, dict) is False else
                          f"'logit_bias' may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries.")
        out = []
        for k, b in v.items():
            if not (k.isascii() and k.isdigit() and len(k) <= 12):
                raise refusal(f"'logit_bias' key '{k[:20]}' is not a token id; " + sentence[0].lower() + sentence[1:])
            if not (isinstance(b, (int, float)) and not isinstance(b, bool) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS):
                raise refusal(sentence)
            out.append((int(k), float(b)))
        return tuple(out)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise refusal("'stream_options' is only allowed when 'stream' is true.")
        return self


class CompletionRequest(_Common):
    prompt: str
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1, le=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
            v = v[0]
        if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise refusal("'prompt' as token ids is not supported; send the prompt as text.")
        if isinstance(v, list) and len(v) > 1:
            raise refusal("'prompt' must be one string: this server completes one prompt per request.")
        if not isinstance(v, str) or not v:
            raise refusal("'prompt' must be a non-empty string.")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: Optional[bool]) -> Optional[bool]:
        if v:
            raise refusal("'echo': true is not supported; the completion holds only the generated text.")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: Optional[str]) -> Optional[str]:
        if v:
            raise refusal("'suffix' is not supported: this server does not insert text between a prefix and a suffix.")
        return v


#: OpenAI's function names: letters, digits, '_' and '-', at most 64
_FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionCall(_Model):
    name: str = Field(pattern=_FUNCTION_NAME)
    arguments: str


class ToolCall(_Model):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[str] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = Field(None, max_length=256)
    refusal: Optional[str] = None

    @model_validator(mode="after")
    def _roles(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise refusal("may carry 'tool_calls' only with role 'assistant'.")
        if self.role == "tool" and not self.tool_call_id:
            raise refusal("has role 'tool' and must carry the 'tool_call_id' of the call it answers.")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        """A string, null (""), or a list of text parts joined as mlx_lm.server joins them ("")."""
        if v is None or isinstance(v, str):
            return v or ""
        if isinstance(v, list):
            texts = []
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else None
                    raise refusal(f"holds a part of type '{kind[:20]}'; only text parts "
                                  "({\"type\": \"text\", \"text\": ...}) are supported." if isinstance(kind, str)
                                  else "must hold parts of the form {\"type\": \"text\", \"text\": string}.")
                if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise refusal("must hold parts of the form {\"type\": \"text\", \"text\": string}.")
                texts.append(part["text"])
            return "".join(texts)
        raise refusal("must be a string, null or a list of text parts.")


class JsonSchemaFormat(_Model):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise refusal("'response_format' of type 'json_schema' needs 'json_schema' {name, schema}, and only it.")
        return self


class FunctionDef(_Model):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str = Field(pattern=_FUNCTION_NAME)


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[Tool]] = Field(None, max_length=128)
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is None or v in ("none", "auto", "required"):
            return v
        try:
            return NamedToolChoice.model_validate(v)
        except ValidationError:
            raise refusal(_SENTENCES["tool_choice"]) from None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise refusal("'top_logprobs' needs 'logprobs': true.")
        return self

    @model_validator(mode="after")
    def _one_kind_of_structure(self):
        if self.response_format is not None and self.response_format.type != "text" and self.tool_choice not in (
                None, "none", "auto"):
            raise refusal("'response_format' and a forced 'tool_choice' cannot both shape the reply; send one.")
        return self

    def prompt_messages(self) -> list[dict]:
        """The messages as the chat template takes them ("developer" is the newer name of "system"),
        with assistant `tool_calls` and tool results (kafilad/control/tools.py `template_messages`)."""
        out = []
        for m in self.messages:
            d = {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
            if m.name:
                d["name"] = m.name
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out

    def tool_dicts(self) -> Optional[list[dict]]:
        """The tools as OpenAI objects (None without tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def tool_choice_value(self):
        """"none" | "auto" | "required" | {"type": "function", "function": {"name"}} | None."""
        return self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice


#: field -> the sentence for any type or range error of it (custom refusals keep their own)
_SENTENCES = {
    "model": "'model' must be a string.",
    "max_tokens": f"'max_tokens' must be a positive integer of at most {MAX_TOKENS_LIMIT} (or null).",
    "max_completion_tokens": f"'max_completion_tokens' must be a positive integer of at most {MAX_TOKENS_LIMIT} "
                             "(or null).",
    "temperature": "'temperature' must be a finite number between 0 and 2 (or null).",
    "top_p": "'top_p' must be a number between 0 and 1.",
    "n": "Only 'n': 1 is supported.",
    "best_of": "Only 'best_of': 1 is supported.",
    "stream": "'stream' must be true or false.",
    "stream_options": "'stream_options' must be an object with 'include_usage' (true or false).",
    "presence_penalty": "'presence_penalty' must be a number between -2 and 2.",
    "frequency_penalty": "'frequency_penalty' must be a number between -2 and 2.",
    "seed": "'seed' must be an integer (64 bits).",
    "user": "'user' must be a string.",
    "top_k": "'top_k' must be an integer of at least 0.",
    "min_p": "'min_p' must be a number between 0 and 1.",
    "repetition_penalty": "'repetition_penalty' must be a number above 0.",
    "top_logprobs": "'top_logprobs' must be an integer between 0 and 20.",
    "echo": "'echo' must be true or false.",
    "suffix": "'suffix' must be a string.",
    "response_format": "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\"}}.",
    "tools": "'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\", \"description\", "
             "\"parameters\"}} objects (at most 128; names of letters, digits, '_' and '-').",
    "tool_choice": "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                   "\"function\": {\"name\"}}.",
    "parallel_tool_calls": "'parallel_tool_calls' must be true or false.",
    "messages": "'messages' must be a non-empty list of {role, content} objects.",
}
_LOGPROBS = {CompletionRequest: "'logprobs' must be an integer between 0 and 5 (or null).",
             ChatRequest: "'logprobs' must be true or false."}
#: OpenAI fields this server knows and does not offer, and why
_UNSUPPORTED = {
    **{k: "use 'tools' and 'tool_choice' (the deprecated function-calling fields are not offered)"
       for k in ("functions", "function_call")},
    **{k: "this server generates text only" for k in ("audio", "modalities", "prediction")},
    **{k: "this server offers no such service" for k in ("web_search_options", "service_tier", "store", "metadata",
                                                      "reasoning_effort", "verbosity", "prompt_cache_key",
                                                      "safety_identifier")},
}


def field_path(loc: tuple) -> str:
    """A validation location as the API names it: ("messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def error_sentence(e: ValidationError, model: type) -> HttpError:
    """The 400 for the first error of a validation (module docstring)."""
    err = e.errors(include_url=False)[0]
    loc = tuple(err.get("loc") or ())
    field = str(loc[0]) if loc else None
    path = field_path(loc) or None
    if err["type"] == "kafila":
        sentence = err["msg"]
        return HttpError(400, sentence if sentence.startswith("'") or not path else f"'{path}' {sentence}",
                         param=path)
    if err["type"] == "extra_forbidden":
        why = _UNSUPPORTED.get(field) if len(loc) == 1 else None
        return HttpError(400, f"'{path}' is not supported" + (f": {why}." if why else
                         " by this server (it is not a field of this request)."), param=path)
    if err["type"] in ("model_type", "dict_type", "model_attributes_type") and len(loc) > 1:
        return HttpError(400, f"'{path}' must be an object.", param=path)
    if err["type"] == "missing" and len(loc) == 1:
        return HttpError(400, f"'{field}' is required.", param=field)
    if len(loc) == 1 and field == "logprobs":
        return HttpError(400, _LOGPROBS[model], param=field)
    if len(loc) == 1 and field in _SENTENCES:
        return HttpError(400, _SENTENCES[field], param=field)
    msg = err["msg"]
    return HttpError(400, f"'{path}' is invalid: {msg[:1].lower() + msg[1:]}.", param=path)


def parse_completion(body: dict) -> CompletionRequest:
    """Raises HttpError 400 (module docstring)."""
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as e:
        raise error_sentence(e, CompletionRequest) from None


def parse_chat(body: dict) -> ChatRequest:
    """Raises HttpError 400 (module docstring)."""
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as e:
        raise error_sentence(e, ChatRequest) from None


__all__ = ["CompletionRequest", "ChatRequest", "ChatMessage", "parse_completion", "parse_chat", "error_sentence",
           "MAX_TOKENS_LIMIT", "MAX_STOPS"]
