"""The Ollama API on the host's HTTP port (https://github.com/ollama/ollama/blob/main/docs/api.md), so
Ollama front-ends and the official `ollama` client (`ollama.Client(host="http://127.0.0.1:8400")`)
work against a Kafila session. Its routes sit in kafilad/control/openai_api.py's route table:

```
GET  /api/version    {"version": OLLAMA_API_VERSION}
GET  /api/tags       {"models": [{"name", "model", "modified_at", "size", "digest", "details"}]}  (the served one)
GET  /api/ps         {"models": [{..., "expires_at", "size_vram", "context_length"}]}
POST /api/show       {"model"}  -> {"modelfile", "parameters", "template", "details", "model_info", "capabilities"}
POST /api/generate   {"model", "prompt", "system"?, "raw"?, "stream": true, "options"?, "logprobs"?, "top_logprobs"?}
POST /api/chat       {"model", "messages": [{"role", "content"}], "stream": true, "options"?, "logprobs"?, ...}
```
Streaming (the default, as in Ollama) is NDJSON (`application/x-ndjson`), one object per line:
`{"model", "created_at", "response" | "message": {"role": "assistant", "content"}, "done": false}`
per piece of text, then `{"done": true, "done_reason": "stop" | "length", "total_duration",
"prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration", ...}` (durations in
ns). `"stream": false` answers that last object with the whole text. An empty prompt (or no
messages) answers `done_reason: "load"` at once, as Ollama does to load a model. Errors are
`{"error": sentence}` (404 "model 'x' not found", 400 for a bad field, 503 while no session is
ready, 429 when the host is busy); an error after streaming began is one more `{"error"}` line.
A generation that arrives while the session heals from a member loss waits for it to serve again,
at most RECOVERY_WAIT_S (kafilad/node/serving/host_requests.py), as the OpenAI routes do.

The model is named by its id or `id:latest`. `options` honoured: temperature (default 0,
greedy: this server's default, not Ollama's 0.8), top_p, top_k, min_p, seed, num_predict (-1 and
-2: up to the session's context, the default), stop, repeat_penalty, repeat_last_n (0: no
penalties, -1: the context), presence_penalty, frequency_penalty, num_ctx (it caps prompt + generated
tokens; a num_ctx above the session's context is clamped to it, not refused: front-ends send
their own default whatever the model). Options that change sampling in ways this server
does not implement (mirostat, typical_p, tfs_z, penalize_newline, num_keep) are refused with a
400; options about how Ollama runs a model on its machine (num_gpu, num_thread, num_batch,
main_gpu, use_mmap, use_mlock, numa, low_vram, f16_kv, vocab_only, logits_all, embedding_only)
and `keep_alive` do not change the output and are accepted without effect: the session's plan
decides where the model runs and how long it stays loaded. `format` ("json" or a JSON schema)
constrains the output on the head (kafilad/control/grammars.py); /api/chat `tools` go into the chat
template and calls come back as `message.tool_calls` [{"function": {"name", "arguments": {...}}}]
(kafilad/control/tools.py; Ollama has no tool_choice: the model decides), and `tool` messages and
assistant `tool_calls` go back into the template. `images`, `template`, `suffix`, `context` and
`think` are refused by name.
/api/generate formats the prompt with the model's chat template (system + user turn) unless
`raw` is true or the model has no template (then the prompt is used as is, after `system` and a
blank line when a system prompt is given).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import time
from functools import lru_cache
from typing import Any, Literal, Optional

import attrs
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kafilad.control.api_common import (HttpError, TokenText, chat_prompt, check_model, created_s, generate_whole,
                                        json_object, model_id, prompt_tokens, ready_session, serving_session,
                                        stream_generation, token_reports, tokens_text, vocab_size)
from kafilad.control.http_server import Request, Responder
from kafilad.control.grammars import ANY_OBJECT, json_grammar
from kafilad.control.openai_schema import Tool, field_path, refusal
from kafilad.control.tools import ToolCallText, plan_tools, template_messages
from kafilad.proto.sampling import Sampling

#: the Ollama release whose API these routes mirror (front-ends compare it against their minimum)
OLLAMA_API_VERSION = "0.12.0"
#: the tag Ollama clients put after a model name
LATEST = ":latest"

_RUNTIME_OPTIONS = ("numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
                    "use_mmap", "use_mlock", "embedding_only", "num_thread")
_UNSUPPORTED_OPTIONS = ("mirostat", "mirostat_tau", "mirostat_eta", "typical_p", "tfs_z", "penalize_newline",
                        "num_keep")


#: the OpenAI names of the request's fields (in the session's sentences: kafilad/control/api_common.py
#: `api_text`) -> the Ollama option a client sent, so a refusal names what the client wrote
OLLAMA_FIELDS = {"max_tokens": "options.num_predict", "temperature": "options.temperature",
                 "top_p": "options.top_p", "top_k": "options.top_k", "min_p": "options.min_p",
                 "seed": "options.seed", "stop": "options.stop", "repetition_penalty": "options.repeat_penalty",
                 "presence_penalty": "options.presence_penalty", "frequency_penalty": "options.frequency_penalty"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Options(_Model):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = Field(None, ge=-2**63, le=2**64 - 1)
    num_predict: Optional[int] = Field(None, ge=-2, le=2**31 - 1)
    stop: Optional[tuple[str, ...]] = None
    repeat_penalty: Optional[float] = Field(None, gt=0)
    repeat_last_n: Optional[int] = Field(None, ge=-1)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    num_ctx: Optional[int] = Field(None, ge=1)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        stops = [v] if isinstance(v, str) else v
        if v is not None and (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)):
            raise refusal("'options.stop' must be a list of non-empty strings.")
        return None if v is None else tuple(stops)

    @field_validator("num_predict")
    @classmethod
    def _num_predict(cls, v: Optional[int]) -> Optional[int]:
        if v == 0:
            raise refusal("'options.num_predict' must be at least 1, or -1 or -2 (up to the context).")
        return v

    def check_extra(self) -> None:
        """Refuse options this server does not implement; runtime options are accepted (module docstring)."""
        for name in self.model_extra or {}:
            if name in _RUNTIME_OPTIONS:
                continue
            why = ("this server does not implement it" if name in _UNSUPPORTED_OPTIONS else
                   "it is not an option this server knows")
            raise HttpError(400, f"'options.{name[:40]}' is not supported: {why}. The sampling options honoured are "
                                 "temperature, top_p, top_k, min_p, seed, num_predict, stop, repeat_penalty, "
                                 "repeat_last_n, presence_penalty, frequency_penalty and num_ctx.",
                            param=f"options.{name[:40]}")


class _Generation(_Model):
    model: Optional[str] = Field(default=None, min_length=1)  # left out: the served one (README)
    stream: Optional[bool] = None
    options: Optional[Options] = None
    keep_alive: Optional[Any] = None
    format: Optional[Any] = None
    think: Optional[Any] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)

    @field_validator("think")
    @classmethod
    def _unsupported(cls, v: Any, info) -> Any:
        if v not in (None, "", False):
            raise refusal("'think' is not supported: this server does not offer thinking.")
        return v

    @field_validator("format")
    @classmethod
    def _format(cls, v: Any) -> Any:
        if v not in (None, "", "json") and not isinstance(v, dict):
            raise refusal("'format' must be \"json\" or a JSON schema (an object).")
        return v or None

    def grammar(self) -> Optional[str]:
        """The grammar of `format` (kafilad/control/grammars.py): "json" any object, or the schema's."""
        if self.format is None:
            return None
        return json_grammar(ANY_OBJECT if self.format == "json" else self.format, param="format")


class GenerateRequest(_Generation):
    prompt: Optional[str] = None
    system: Optional[str] = None
    raw: Optional[bool] = None
    suffix: Optional[str] = None
    template: Optional[str] = None
    context: Optional[list] = None
    images: Optional[list] = None

    @field_validator("suffix", "template", "context", "images")
    @classmethod
    def _refused(cls, v: Any, info) -> Any:
        if v:
            why = {"suffix": "this server does not insert text between a prefix and a suffix",
                   "template": "the model's own chat template is used (or 'raw': true)",
                   "context": "send the conversation to /api/chat instead",
                   "images": "this server generates from text only"}[info.field_name]
            raise refusal(f"'{info.field_name}' is not supported: {why}.")
        return v


class OllamaFunctionCall(_Model):
    name: str = Field(min_length=1, max_length=64)
    arguments: dict = Field(default_factory=dict)


class OllamaToolCall(_Model):
    function: OllamaFunctionCall


class Message(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: Optional[str] = None  # a reasoning model's earlier turn; this server never writes one
    images: Optional[list] = None
    tool_calls: Optional[list[OllamaToolCall]] = None
    tool_name: Optional[str] = None

    @field_validator("images")
    @classmethod
    def _refused(cls, v: Any, info) -> Any:
        if v:
            raise refusal("images are not supported: this server generates from text only.")
        return v

    def as_openai(self, i: int) -> dict:
        """The message as the chat-template path takes it (OpenAI's shape; kafilad/control/tools.py)."""
        d = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [{"id": f"call_{i}_{j}", "type": "function",
                                "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
                               for j, c in enumerate(self.tool_calls)]
        if self.role == "tool":
            d["tool_call_id"] = self.tool_name or f"call_{i}"
        return d


class ChatRequest(_Generation):
    messages: list[Message] = Field(default_factory=list)
    tools: Optional[list[Tool]] = Field(None, max_length=128)

    def tool_dicts(self) -> Optional[list[dict]]:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


def _parse(model: type, body: dict):
    try:
        r = model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = tuple(err.get("loc") or ())
        path = field_path(loc) or None
        if err["type"] == "kafila":
            msg = err["msg"]
            raise HttpError(400, msg if msg.startswith("'") or not path else f"'{path}' {msg}", param=path) from None
        if err["type"] == "missing":
            raise HttpError(400, f"'{path}' is required.", param=path) from None
        if err["type"] == "extra_forbidden":
            raise HttpError(400, f"'{path}' is not supported by this server (it is not a field of this request).",
                            param=path) from None
        msg = err["msg"]
        raise HttpError(400, f"'{path}' is invalid: {msg[:1].lower() + msg[1:]}.", param=path) from None
    if r.options is not None:
        r.options.check_extra()
    if r.top_logprobs is not None and not r.logprobs:
        raise HttpError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    return r


# ---- answers ----------------------------------------------------------------------------------
async def _send(res: Responder, status: int, doc: Any, headers=None) -> None:
    await res.send(status, json.dumps(doc).encode(), headers=headers)


async def _answer(res: Responder, coro) -> None:
    """Run a handler body; answer its HttpError in Ollama's shape, {"error": sentence}."""
    try:
        await coro
    except HttpError as e:
        if res.started:
            raise
        await _send(res, e.status, {"error": e.message}, e.headers)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _iso(ts_s: float) -> str:
    return datetime.datetime.fromtimestamp(ts_s, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _served(node, name: Optional[str]):
    """The ready session if `name` is its model ("id" or "id:latest"); 404 in Ollama's words otherwise."""
    return _named(ready_session(node), name)


async def _serving(node, name: Optional[str], res: Responder):
    """`_served` for a generation: a session healing from a member loss is waited for first
    (api_common.serving_session, at most RECOVERY_WAIT_S)."""
    return _named(await serving_session(node, res.client_gone), name)


def _named(s, name: Optional[str]):
    try:
        check_model(s, name, suffixes=(LATEST,))
    except HttpError as e:
        raise HttpError(404, f"model '{name}' not found; this server serves '{model_id(s)}'.",
                        headers=e.headers) from None
    return s


@lru_cache(maxsize=8)
def _described(info_key: tuple) -> dict:
    """Size, digest, parameter count and dtype of a model directory's tensors (cached per model)."""
    config_text, tensors = info_key
    size = sum(t[3] for t in tensors)
    params = sum(t[4] for t in tensors)
    dtypes = sorted({t[1] for t in tensors})
    digest = hashlib.sha256(json.dumps([config_text, tensors]).encode()).hexdigest()
    return {"size": size, "params": params, "dtypes": dtypes, "digest": digest}


def _details(s) -> tuple[dict, dict]:
    info = s.info
    tensors = tuple((name, t.dtype, tuple(t.shape), t.nbytes, t.numel) for name, t in info.tensors.items())
    d = _described((json.dumps(info.config, sort_keys=True), tensors))
    family = str(info.config.get("model_type") or "unknown")
    n = d["params"]
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"
    quant = info.config.get("quantization") or info.config.get("quantization_config")
    level = f"Q{quant.get('bits')}" if isinstance(quant, dict) and quant.get("bits") else "/".join(d["dtypes"])
    details = {"parent_model": "", "format": "safetensors", "family": family, "families": [family],
               "parameter_size": size, "quantization_level": level}
    return details, d


def _listed(s) -> dict:
    details, d = _details(s)
    name = model_id(s) + LATEST
    return {"name": name, "model": name, "modified_at": _iso(created_s(s)), "size": d["size"],
            "digest": d["digest"], "details": details}


async def _version(node, request: Request, res: Responder) -> None:
    await _send(res, 200, {"version": OLLAMA_API_VERSION})


def _ready_or_none(node):
    try:
        return ready_session(node)
    except HttpError:
        return None


async def _tags(node, request: Request, res: Responder) -> None:
    s = _ready_or_none(node)
    await _send(res, 200, {"models": [_listed(s)] if s is not None else []})


async def _ps(node, request: Request, res: Responder) -> None:
    s = _ready_or_none(node)
    models = []
    if s is not None:
        m = _listed(s)
        m.pop("modified_at")
        models.append({**m, "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0, "context_length": s.context})
    await _send(res, 200, {"models": models})


async def _show(node, request: Request, res: Responder) -> None:
    async def body() -> None:
        req = json_object(request.body)
        name = req.get("model", req.get("name"))
        if not isinstance(name, str) or not name:
            raise HttpError(400, "'model' must name a model (a non-empty string).", param="model")
        s = _served(node, name)
        details, d = _details(s)
        cfg = s.info.config
        arch = details["family"]
        info = {"general.architecture": arch, "general.parameter_count": d["params"],
                f"{arch}.context_length": cfg.get("max_position_embeddings"),
                f"{arch}.embedding_length": cfg.get("hidden_size"), f"{arch}.block_count": cfg.get("num_hidden_layers"),
                f"{arch}.attention.head_count": cfg.get("num_attention_heads"),
                f"{arch}.attention.head_count_kv": cfg.get("num_key_value_heads"),
                f"{arch}.vocab_size": vocab_size(s), "kafila.session_context_length": s.context}
        template = getattr(s.chat_tokenizer(), "chat_template", None)
        await _send(res, 200, {"modelfile": f"# served by Kafila from {model_id(s)}\nFROM {model_id(s)}\n",
                               "parameters": "", "template": template if isinstance(template, str) else "{{ .Prompt }}",
                               "details": details, "model_info": info, "capabilities": ["completion"],
                               "modified_at": _iso(created_s(s))})
    await _answer(res, body())


# ---- generation -------------------------------------------------------------------------------
def _sampling(s, r, o: Options) -> Sampling:
    penalties = o.repeat_last_n != 0
    window = s.context if o.repeat_last_n == -1 else (o.repeat_last_n or None)
    rep = o.repeat_penalty if penalties and o.repeat_penalty not in (None, 1.0) else None
    kw = {"penalty_context_tokens": window} if window else {}
    return Sampling(temperature=o.temperature or 0.0, top_p=1.0 if o.top_p is None else o.top_p,
                    top_k=o.top_k or 0, min_p=o.min_p or 0.0, seed=o.seed,
                    presence_penalty=(o.presence_penalty or 0.0) if penalties else 0.0,
                    frequency_penalty=(o.frequency_penalty or 0.0) if penalties else 0.0,
                    repetition_penalty=rep, logprobs=(r.top_logprobs or 0) if r.logprobs else None, **kw)


async def _max_tokens(s, prompt: str, o: Options) -> int:
    """num_predict, capped by num_ctx when given (num_ctx above the session's context is clamped to it:
    front-ends send their own default, e.g. 4096 or 32768, whatever the model); unset, -1 or -2: what
    the context leaves."""
    context = s.context if o.num_ctx is None else min(o.num_ctx, s.context)  # above the session's: clamped
    n_prompt, exact = await prompt_tokens(s, prompt, context - 1)
    room = context - n_prompt
    if room < 1:
        raise HttpError(400, f"The prompt ({tokens_text(n_prompt, exact)}) leaves no room to generate in a context "
                             f"of {context} tokens.", param="options.num_ctx" if o.num_ctx is not None else "prompt")
    if o.num_predict is not None and o.num_predict > 0:
        return min(o.num_predict, room) if o.num_ctx is not None else o.num_predict
    return room


async def _generate_prompt(s, r: GenerateRequest) -> str:
    template = getattr(s.chat_tokenizer(), "chat_template", None)
    if r.raw or not template:
        return f"{r.system}\n\n{r.prompt}" if r.system and not r.raw else r.prompt
    messages = ([{"role": "system", "content": r.system}] if r.system else []) + [{"role": "user", "content": r.prompt}]
    return await chat_prompt(s, messages)


async def _generate_route(node, request: Request, res: Responder) -> None:
    async def body() -> None:
        r = _parse(GenerateRequest, json_object(request.body))
        s = await _serving(node, r.model, res)
        r.model = r.model or model_id(s)
        if not r.prompt:
            await _send(res, 200, {"model": r.model, "created_at": _now(), "response": "", "done": True,
                                   "done_reason": "load"})
            return
        await _run(s, res, r, await _generate_prompt(s, r), chat=False)
    await _answer(res, body())


async def _chat_route(node, request: Request, res: Responder) -> None:
    async def body() -> None:
        r = _parse(ChatRequest, json_object(request.body))
        s = await _serving(node, r.model, res)
        r.model = r.model or model_id(s)
        if not r.messages:
            await _send(res, 200, {"model": r.model, "created_at": _now(),
                                   "message": {"role": "assistant", "content": ""}, "done": True,
                                   "done_reason": "load"})
            return
        plan = plan_tools(s.chat_tokenizer(), r.tool_dicts(), None, None)
        messages = template_messages([m.as_openai(i) for i, m in enumerate(r.messages)], plan)
        prompt = await chat_prompt(s, messages, list(plan.tools) if plan is not None and plan.native else None)
        await _run(s, res, r, prompt, chat=True, plan=plan)
    await _answer(res, body())


def _ollama_calls(found: list[dict]) -> list[dict]:
    """OpenAI-shaped calls (kafilad/control/tools.py) in Ollama's shape: arguments as an object."""
    out = []
    for c in found:
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            args = {}
        out.append({"function": {"name": c["function"]["name"], "arguments": args if isinstance(args, dict) else {}}})
    return out


async def _run(s, res: Responder, r, prompt: str, *, chat: bool, plan=None) -> None:
    o = r.options or Options()
    sampling = _sampling(s, r, o)
    grammar = r.grammar()
    if grammar is not None:
        sampling = attrs.evolve(sampling, grammar=grammar)
    calls = ToolCallText(plan) if plan is not None and plan.parses else None
    max_tokens = await _max_tokens(s, prompt, o)
    t0 = time.perf_counter()
    text_of = TokenText(s) if sampling.logprobs is not None else None

    def generate(emit):
        return s.generate(prompt, max_tokens=max_tokens, temperature=sampling.temperature, emit=emit,
                          gone=res.client_gone, sampling=sampling, stop=o.stop or ())

    def logprobs(events: list[dict]) -> list[dict]:
        return [{"token": t, "logprob": lp, "top_logprobs": [{"token": a, "logprob": x} for a, x in top]}
                for t, lp, top in token_reports(events, text_of)]

    def piece(text: str, events: list[dict], done: bool) -> dict:
        out = {"model": r.model, "created_at": _now()}
        out.update({"message": {"role": "assistant", "content": text}} if chat else {"response": text})
        if text_of is not None and events:
            out["logprobs"] = logprobs(events)
        out["done"] = done
        return out

    def final(result: dict, text: str, events: list[dict]) -> dict:
        total_ns = int((time.perf_counter() - t0) * 1e9)
        ttft_ns = int((result.get("ttft_s") or 0.0) * 1e9)
        return {**piece(text, events, True), "done_reason": result.get("finish_reason") or "stop",
                "total_duration": total_ns, "load_duration": 0, "prompt_eval_count": result["prompt_tokens"],
                "prompt_eval_duration": ttft_ns, "eval_count": len(result["token_ids"]),
                "eval_duration": max(0, total_ns - ttft_ns)}

    def with_calls(doc: dict, found: list[dict]) -> dict:
        if found:
            doc["message"]["tool_calls"] = _ollama_calls(found)
        return doc

    if r.stream is False:
        result, events = await generate_whole(s, res, generate, OLLAMA_FIELDS)
        text, found = result["text"], []
        if calls is not None:
            text, found = calls.feed(text)
            rest, more = calls.finish()
            text, found = text + rest, found + more
        await _send(res, 200, with_calls(final(result, text, events), found))
        return

    def line(doc: dict) -> bytes:
        return json.dumps(doc).encode() + b"\n"

    def token_payloads(ev: dict) -> list[bytes]:
        text = str(ev.get("text") or "")
        has_lp = text_of is not None and ev.get("logprob") is not None
        found: list[dict] = []
        if calls is not None:
            text, found = calls.feed(text)
        if not (text or has_lp or found):
            return []
        return [line(with_calls(piece(text, [ev] if has_lp else [], False), found))]

    def end_payloads(result: dict) -> list[bytes]:
        text, found = calls.finish() if calls is not None else ("", [])
        return [line(with_calls(final(result, text, []), found))]

    await stream_generation(s, res, generate, content_type="application/x-ndjson", token_payloads=token_payloads,
                            end_payloads=end_payloads,
                            error_payloads=lambda message: [line({"error": message})], fields=OLLAMA_FIELDS)


#: path -> (methods, handler), registered in kafilad/control/openai_api.py's route table
ROUTES = {
    "/api/version": (("GET", "HEAD"), _version),
    "/api/tags": (("GET", "HEAD"), _tags),
    "/api/ps": (("GET", "HEAD"), _ps),
    "/api/show": (("POST",), _show),
    "/api/generate": (("POST",), _generate_route),
    "/api/chat": (("POST",), _chat_route),
}

__all__ = ["ROUTES", "OLLAMA_API_VERSION", "GenerateRequest", "ChatRequest", "Options"]
