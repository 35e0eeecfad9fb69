"""Grammars for structured output and forced tool calls, made by the HTTP APIs (issue 23 items 1-2).

Every grammar here is llguidance's JSON form of a JSON schema (`LLMatcher.grammar_from_json_schema`,
compact: `JSON_OPTIONS`), carried to the head in the request's Sampling (kafilad/proto/sampling.py
`grammar`) and enforced token by token there (kafilad/executor/grammar.py):

```
OpenAI response_format {"type": "json_object"}                 -> any JSON object
OpenAI response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                                                -> documents matching "schema"
Ollama format "json"                                            -> any JSON object
Ollama format {JSON schema}                                     -> documents matching it
tool_choice "required" / {"type": "function", "function": {"name"}}
                                                                -> `tool_call_schema`: {"name", "arguments"}
                                                                   objects (a list of them when parallel)
```
A schema llguidance cannot compile is a 400 naming the field. Pure of mlx: llguidance only.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from kafilad.control.api_common import HttpError

#: llguidance JSON compile options: no free whitespace between tokens (a model cannot stall in
#: whitespace), oneOf taken as anyOf (as the OpenAI API does)
JSON_OPTIONS = {"whitespace_flexible": False, "coerce_one_of": True}
#: the schema of "any JSON object" (response_format json_object, Ollama format "json")
ANY_OBJECT = {"type": "object"}


def json_grammar(schema: Any, *, param: str) -> str:
    """llguidance's grammar for JSON documents matching `schema`.

    Raises:
        HttpError: 400 naming `param` when the schema is not an object (or boolean) llguidance
            can compile, with llguidance's reason.
    """
    import llguidance

    if not isinstance(schema, (dict, bool)):
        raise HttpError(400, f"'{param}' must be a JSON schema (an object).", param=param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        problem = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as e:
        problem = str(e)
    if problem:
        first = problem.strip().splitlines()[0] if problem.strip() else "it cannot be compiled"
        raise HttpError(400, f"'{param}' is not a JSON schema this server can enforce: {first[:300]}", param=param)
    return grammar


def tool_call_schema(tools: list[dict], *, name: Optional[str], parallel: bool) -> dict:
    """The JSON schema of a forced tool call: {"name": <a tool's name>, "arguments": <its
    parameters>} (only the named tool when `name`), a non-empty list of them when `parallel`.

    Args:
        tools: OpenAI tool objects, checked ({"type": "function", "function": {"name", "parameters"?}}).
    """
    calls = []
    for t in tools:
        f = t["function"]
        if name is not None and f["name"] != name:
            continue
        params = f.get("parameters") or {"type": "object", "properties": {}}
        calls.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one
