"""Tool calls in and out of chat text (kafilad/control/tools.py, issue 23 item 1), with real tokenizers:
the synthesised model's, once with a Qwen-style chat template that takes tools (mlx-lm infers its
json_tools parser from it) and once without a template (the Hermes convention)."""

from __future__ import annotations

import json
import random

import pytest

from kafilad.control.api_common import HttpError
from kafilad.control.tools import HERMES_START, ToolCallText, plan_tools, template_messages
from kafilad.executor.synth import load_tokenizer, synthesize_model

QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls %}{%- for tool_call in m.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}{%- endif %}<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    plain = synthesize_model(tmp_path_factory.mktemp("plain"), arch="llama", seed=1, num_hidden_layers=2)
    templated = synthesize_model(tmp_path_factory.mktemp("tmpl"), arch="llama", seed=1, num_hidden_layers=2)
    cfg = json.loads((templated / "tokenizer_config.json").read_text())
    (templated / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": QWEN_STYLE}))
    return load_tokenizer(plain), load_tokenizer(templated)


def feed_in_pieces(split: ToolCallText, text: str, seed: int) -> tuple[str, list]:
    rng = random.Random(seed)
    content, calls, i = "", [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        c, found = split.feed(text[i:i + n])
        content, calls, i = content + c, calls + found, i + n
    c, found = split.finish()
    return content + c, calls + found


def test_a_template_that_takes_tools(tokenizers):
    _, tok = tokenizers
    plan = plan_tools(tok, TOOLS, None, None)
    assert plan.native and plan.choice == "auto" and plan.start == "<tool_call>" and plan.grammar() is None
    messages = template_messages([{"role": "user", "content": "Weather in Oslo?"},
                                  {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                                  {"role": "tool", "tool_call_id": "c1", "content": "rain"}], plan)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # an object for the template
    prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '"name": "get_weather"' in prompt and '{"city": "Oslo"}' in prompt and "<tools>" in prompt
    reply = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><tool_ca'
    for seed in range(20):  # any split of the stream into pieces gives the same content and calls
        content, calls = feed_in_pieces(ToolCallText(plan), reply, seed)
        assert content == "Let me look.<tool_ca"  # an unfinished marker at the end is text after all
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
            [("get_weather", {"city": "Rome"})]
    content, calls = feed_in_pieces(ToolCallText(plan), "a<tool_call>not json</tool_call>b", 3)
    assert (content, calls) == ("a<tool_call>not json</tool_call>b", [])  # never dropped


def test_a_template_without_tools_gets_the_hermes_convention(tokenizers):
    tok, _ = tokenizers
    plan = plan_tools(tok, TOOLS, "auto", None)
    assert not plan.native and plan.start == HERMES_START
    messages = template_messages([{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                                  {"role": "tool", "tool_call_id": "c1", "content": "rain"}], plan)
    assert messages[0]["role"] == "system" and '"get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert messages[3] == {"role": "user", "content": "<tool_response>\nrain\n</tool_response>"}
    content, calls = feed_in_pieces(ToolCallText(plan), '<tool_call>{"name": "get_weather", "arguments": {}}'
                                    '</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "x"}}', 1)
    assert content == "" and [json.loads(c["function"]["arguments"]) for c in calls] == [{}, {"city": "x"}]


def test_forced_and_none(tokenizers):
    tok, _ = tokenizers
    forced = plan_tools(tok, TOOLS, {"type": "function", "function": {"name": "get_weather"}}, False)
    assert forced.forced and forced.grammar()
    content, calls = feed_in_pieces(ToolCallText(forced), '{"name": "get_weather", "arguments": {"city": "Oslo"}}', 2)
    assert content == "" and calls[0]["function"]["name"] == "get_weather"
    cut = feed_in_pieces(ToolCallText(forced), '{"name": "get_wea', 2)  # cut short by max_tokens: text as it is
    assert cut == ('{"name": "get_wea', [])
    assert not plan_tools(tok, TOOLS, "none", None).parses
    assert plan_tools(tok, None, None, None) is None
    with pytest.raises(HttpError, match="names function 'nope'"):
        plan_tools(tok, TOOLS, {"type": "function", "function": {"name": "nope"}}, None)
    with pytest.raises(HttpError, match="needs 'tools'"):
        plan_tools(tok, None, "required", None)
