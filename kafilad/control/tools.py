"""Tool calls for the chat APIs (issue 23 item 1): tools into the chat template, calls out of the text.

The call format is the model family's, never code of ours per family: the host's chat tokenizer
is mlx-lm's `TokenizerWrapper` (kafilad/executor/tokenizer.py), which infers the family's tool
parser from the chat template (mlx_lm/tokenizer_utils.py `_infer_tool_parser`: Qwen/Hermes
`<tool_call>` JSON, Mistral `[TOOL_CALLS]`, pythonic, GLM, Kimi, Gemma, ...) and gives its
`tool_call_start` / `tool_call_end` markers and `tool_parser(text, tools)`. The request's `tools`
go into the template (`apply_chat_template(..., tools=...)`), and the generated text between the
markers is parsed by the family's parser, as mlx-lm's own server does.

A template that knows no tools (a base model, or one such as SmolLM2's ChatML template) gets
the Hermes convention, which mlx-lm parses with its `json_tools` parser (plain JSON): a system
message lists the tools as JSON and asks for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
earlier calls and tool results are written into the conversation as that text.

`tool_choice`:
- "auto" (the default with tools): the model decides; its calls are parsed from its text.
- "none": the tools are described but no call is parsed; the reply is text.
- "required", or {"type": "function", "function": {"name"}}: the reply is a call, and its
  arguments are valid JSON for the function's parameter schema by construction: the whole output
  is constrained (kafilad/control/grammars.py `tool_call_schema`, enforced on the head by
  llguidance) to {"name", "arguments"} (a list of them with `parallel_tool_calls`), so no
  family marker is needed to find it.

`ToolCallText` is the sans-IO splitter of generated text into content and calls, fed token
texts as they stream. Calls are OpenAI's shape: {"id": "call_...", "type": "function",
"function": {"name": str, "arguments": JSON str}}.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Optional

import attrs

from kafilad.control.api_common import HttpError
from kafilad.control.grammars import json_grammar, tool_call_schema

#: the Hermes convention for templates without tool support (mlx-lm's json_tools parser)
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def _hermes_parser(text: str, tools: Any = None) -> Any:
    return json.loads(text.strip())


def hermes_system_text(tools: list[dict]) -> str:
    """The system message describing `tools` in the Hermes convention."""
    specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to help with the user's request. The functions are listed "
            "as JSON schemas inside <tools></tools>:\n<tools>\n" + specs + "\n</tools>\n"
            "To call a function, reply with a JSON object holding its name and arguments inside "
            f"{HERMES_START}{HERMES_END} tags, one per call:\n"
            f'{HERMES_START}{{"name": <function-name>, "arguments": <args-json-object>}}{HERMES_END}')


@attrs.frozen
class ToolPlan:
    """What a chat request's tools mean for its prompt, its sampling and its output.

    Attributes:
        tools: the request's tools (OpenAI objects, checked).
        choice: "auto", "none", "required", or the name of the one function to call.
        parallel: more than one call allowed (`parallel_tool_calls`, default true).
        native: the chat template takes `tools` itself (mlx-lm found the family's parser);
            otherwise the Hermes convention (module docstring).
        start, end: the family's call markers. parser: the family's `tool_parser(text, tools)`.
    """

    tools: tuple
    choice: str
    parallel: bool
    native: bool
    start: str
    end: str
    parser: Callable[[str, Any], Any]

    @property
    def forced(self) -> bool:
        """The reply must be a call: the whole output is a constrained JSON call."""
        return self.choice not in ("auto", "none")

    @property
    def parses(self) -> bool:
        """Calls are looked for in the reply."""
        return self.choice != "none"

    def grammar(self) -> Optional[str]:
        """The llguidance grammar of a forced reply (`tool_call_schema`), else None."""
        if not self.forced:
            return None
        name = None if self.choice == "required" else self.choice
        return json_grammar(tool_call_schema(list(self.tools), name=name, parallel=self.parallel),
                            param="tool_choice")


def plan_tools(tokenizer, tools: Optional[list[dict]], tool_choice: Any, parallel: Optional[bool]) -> Optional[ToolPlan]:
    """The ToolPlan of a request's checked `tools`, `tool_choice` and `parallel_tool_calls` (None
    when it has no tools and no choice).

    Raises:
        HttpError: 400 for a tool_choice naming no listed function, or a choice without tools.
    """
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise HttpError(400, "'tool_choice' needs 'tools' to choose from.", param="tool_choice")
        return None
    names = [t["function"]["name"] for t in tools]
    choice = tool_choice or "auto"
    if isinstance(choice, dict):
        choice = choice["function"]["name"]
        if choice not in names:
            raise HttpError(400, f"'tool_choice' names function '{choice[:64]}', which 'tools' does not list "
                                 f"(it lists {', '.join(names[:20])}).", param="tool_choice")
    native = bool(getattr(tokenizer, "has_tool_calling", False))
    return ToolPlan(tools=tuple(tools), choice=choice, parallel=True if parallel is None else parallel,
                    native=native, start=tokenizer.tool_call_start if native else HERMES_START,
                    end=tokenizer.tool_call_end if native else HERMES_END,
                    parser=tokenizer.tool_parser if native else _hermes_parser)


def _arguments_object(arguments: Any) -> Any:
    """A call's arguments as the chat templates take them: an object (OpenAI sends a JSON string)."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def template_messages(messages: list[dict], plan: Optional[ToolPlan]) -> list[dict]:
    """Checked chat messages (with assistant `tool_calls` and `tool` results) as the chat
    template takes them: calls' arguments as objects for a template that takes tools; for the
    Hermes convention, calls and results written out as text and the tools in a system message."""
    if plan is not None and not plan.native:
        out = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = "".join(f'{HERMES_START}{json.dumps({"name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])}, ensure_ascii=False)}{HERMES_END}'
                                for c in m["tool_calls"])
                out.append({"role": "assistant", "content": (m.get("content") or "") + calls})
            elif m["role"] == "tool":
                out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
            else:
                out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
        system = hermes_system_text(list(plan.tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
        return out
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": _arguments_object(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
            m["content"] = m.get("content") or ""
        out.append(m)
    return out


def openai_call(parsed: Any) -> dict:
    """One parsed call ({"name", "arguments"}; "parameters" as some families write it) in OpenAI's shape.

    Raises:
        ValueError: not a call object.
    """
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        raise ValueError("a tool call is an object with a 'name'")
    args = parsed.get("arguments", parsed.get("parameters", {}))
    return {"id": str(parsed.get("id") or f"call_{uuid.uuid4().hex[:24]}"), "type": "function",
            "function": {"name": parsed["name"],
                         "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


class ToolCallText:
    """Splits a reply's text, fed as it streams, into content and tool calls (sans-IO).

    `feed(text)` returns (content safe to show now, calls completed now); `finish()` returns what
    is left. Text that may be the start of a call marker is held back until it is known not to
    be one. A forced reply is one JSON call (or list) parsed at `finish`. Text between markers that
    the family's parser cannot read is returned as content, as written (never dropped).
    """

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self._buf = ""
        self._in_call = False
        self.calls: list[dict] = []

    def _parse(self, text: str) -> tuple[str, list[dict]]:
        try:
            parsed = self.plan.parser(text, list(self.plan.tools))
            calls = [openai_call(p) for p in (parsed if isinstance(parsed, list) else [parsed])]
        except (ValueError, TypeError, KeyError, AttributeError):
            return text, []
        self.calls += calls
        return "", calls

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.plan.forced:
            self._buf += text
            return "", []
        self._buf += text
        content, calls = "", []
        while True:
            if self._in_call:
                i = self._buf.find(self.plan.end)
                if i < 0:
                    return content, calls
                bad, got = self._parse(self._buf[:i])
                content += (self.plan.start + bad + self.plan.end) if bad else ""
                calls += got
                self._buf = self._buf[i + len(self.plan.end):]
                self._in_call = False
            else:
                i = self._buf.find(self.plan.start)
                if i >= 0:
                    content += self._buf[:i]
                    self._buf = self._buf[i + len(self.plan.start):]
                    self._in_call = True
                    continue
                keep = _marker_prefix(self._buf, self.plan.start)
                content += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                return content, calls

    def finish(self) -> tuple[str, list[dict]]:
        rest, self._buf = self._buf, ""
        if self.plan.forced:
            try:
                parsed = json.loads(rest)
                calls = [openai_call(p) for p in (parsed if isinstance(parsed, list) else [parsed])]
            except (ValueError, TypeError):  # cut short by max_tokens: the text as it is
                return rest, []
            self.calls += calls
            return "", calls
        if self._in_call:  # an unterminated call (max_tokens): parse what came, or show it
            self._in_call = False
            bad, calls = self._parse(rest)
            return (self.plan.start + bad) if bad else "", calls
        return rest, []


def _marker_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
