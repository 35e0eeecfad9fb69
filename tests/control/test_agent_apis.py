"""The Anthropic Messages and OpenAI Responses request bodies (kafilad/control/anthropic_api.py,
responses_api.py), their routes' errors, and /metrics' metering (kafilad/control/metrics.py),
without daemons: bodies are fed to the typed models (and fuzzed with hypothesis: any JSON object is
a request or a 400, never another exception); routes are served over trio's memory streams to a
node without a session, or to a real HostSession holding stories260K's real tokenizer
(tests/node/healing_host.py); the metering runs a generation function under a fake clock.
"""

from __future__ import annotations

import json
from functools import partial

import pytest
import trio
import trio.testing
from hypothesis import given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kafila_ctl.demo import packaged_model_dir
from kafilad.proto.status import NodeStatus
from kafilad.control import openai_api
from kafilad.control.anthropic_api import parse_count_tokens, parse_messages, stop_reason, tool_use
from kafilad.control.api_common import HttpError
from kafilad.control.auth import ApiKeys
from kafilad.control.http_server import HttpServer
from kafilad.control.metrics import SESSION_STATES, ApiMetrics, RequestMeter, metered
from kafilad.control.responses_api import parse_responses
from kafilad.errors import GenerationCancelled
from kafilad.executor.tokenizer import load_tokenizer
from kafilad.modelinfo import read_model_info
from kafilad.proto.session_events import HostState
from kafilad.control.node_view import SessionOnly

from control.http_harness import exchange, http_request
from node.healing_host import ready_host

STORY = [{"role": "user", "content": "Tell me a story."}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Weather for a city", "input_schema": CITY}
IDLE = SessionOnly(None, NodeStatus.from_json({"role": None, "state": "idle"}))


def refused(parse, body: dict) -> tuple[str, str]:
    with pytest.raises(HttpError) as e:
        parse(body)
    assert e.value.status == 400
    return e.value.param, e.value.message


# ---- Anthropic bodies ---------------------------------------------------------------------------
def test_anthropic_bodies():
    r = parse_messages({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be "},
                                                                   {"type": "text", "text": "brief.",
                                                                    "cache_control": {"type": "ephemeral"}}],
                        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                                  {"type": "text", "text": "there"}]},
                                     {"role": "assistant", "content": "Hello."}, *STORY],
                        "tools": [], "tool_choice": {"type": "auto"}, "metadata": {"user_id": "u"},
                        "cache_control": {"type": "ephemeral"}, "output_config": {"effort": "low"}})
    assert r.prompt_messages() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                                   {"role": "assistant", "content": "Hello."}, *STORY]
    assert parse_count_tokens({"messages": STORY}).prompt_messages() == STORY
    assert refused(parse_messages, {"messages": STORY}) == ("max_tokens", "'max_tokens' is required.")
    assert refused(parse_messages, {"messages": [], "max_tokens": 1}) == (
        "messages", "'messages' must be a non-empty list of {role, content} objects.")
    assert refused(parse_messages, {"messages": STORY, "max_tokens": 0}) == (
        "max_tokens", "'max_tokens' must be a positive integer of at most 2147483647.")
    assert refused(parse_messages, {"messages": STORY, "max_tokens": 1, "temperature": 1.5}) == (
        "temperature", "'temperature' must be a number between 0 and 1.")
    assert refused(parse_messages, {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": "aGk="}}]}], "max_tokens": 1}) == (
        "messages[0].content", "'messages[0].content' holds a block of type 'image' (block 0); this server takes "
        "text, tool_use and tool_result blocks: it does not read images or documents.")
    assert refused(parse_messages, {"messages": [{"role": "system", "content": "x"}], "max_tokens": 1})[0] == \
        "messages[0].role"
    assert refused(parse_messages, {"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}], "max_tokens": 1}) == (
        "messages[0]", "'messages[0]' holds a tool_use block, which only an assistant message may hold.")
    assert refused(parse_messages, {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f"}]}], "max_tokens": 1}) == (
        "messages[0].content[0]", "'messages[0].content[0]' is a tool_use block and needs 'input'.")
    assert refused(parse_messages, {"messages": STORY, "max_tokens": 1, "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}) == (
        "tools", "'tools[0]' is a tool of type 'web_search_20250305', which is not supported: this server calls "
        "client tools ({\"name\", \"description\", \"input_schema\"}) only.")
    assert refused(parse_messages, {"messages": STORY, "max_tokens": 1, "tools": [{"name": "f"}]}) == (
        "tools[0].input_schema", "'tools[0].input_schema' is required.")
    assert refused(parse_messages, {"messages": STORY, "max_tokens": 1, "tool_choice": {"type": "tool"}}) == (
        "tool_choice", "'tool_choice' of type 'tool' needs 'name' (and only it has one).")
    assert refused(parse_messages, {"messages": STORY, "max_tokens": 1, "thinking": {"type": "enabled"}}) == (
        "thinking", "'thinking' is not supported: this server does not offer extended thinking.")
    assert refused(parse_messages, {"messages": STORY, "max_tokens": 1, "stop_sequences": [""]}) == (
        "stop_sequences", "'stop_sequences' must be a list of at most 64 non-empty strings.")
    assert refused(parse_messages, {"messages": STORY, "max_tokens": 1, "output_config": {"format": {}}})[0] == \
        "output_config.format.type"
    shaped = parse_messages({"messages": STORY, "max_tokens": 1, "tools": [WEATHER], "tool_choice": {"type": "any"},
                             "output_config": {"format": {"type": "json_schema", "schema": CITY}}})
    assert shaped.grammar_schema() == CITY and shaped.tool_choice_value() == "required"  # the call's grammar wins


def test_anthropic_tools_become_the_openai_chat_routes():
    r = parse_messages({"max_tokens": 5, "tools": [WEATHER], "tool_choice": {
        "type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, "messages": [
        *STORY, {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                  {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "rain"}]},
                                     {"type": "text", "text": "And tomorrow?"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                      "content": "no such city"}]}]})
    assert r.prompt_messages() == [
        *STORY, {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"}, {"role": "user", "content": "And tomorrow?"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"}]
    assert r.tool_dicts() == [{"type": "function", "function": {"name": "get_weather", "parameters": CITY,
                                                                "description": "Weather for a city"}}]
    assert r.tool_choice_value() == {"type": "function", "function": {"name": "get_weather"}}
    assert r.parallel() is False
    assert parse_messages({"max_tokens": 1, "messages": STORY, "tools": [WEATHER],
                           "tool_choice": {"type": "any"}}).tool_choice_value() == "required"
    assert tool_use({"id": "call_abc", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}) == \
        {"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {"a": 1}}
    assert refused(parse_messages, {"messages": STORY, "max_tokens": 1, "n": 2}) == (
        "n", "'n' is not supported by this server (it is not a field of this request).")


def test_stop_reasons():
    assert stop_reason({"finish_reason": "length"}) == ("max_tokens", None)
    assert stop_reason({"finish_reason": "length"}, called=True) == ("max_tokens", None)
    assert stop_reason({"finish_reason": "stop"}, called=True) == ("tool_use", None)
    assert stop_reason({"finish_reason": "stop"}) == ("end_turn", None)
    assert stop_reason({"finish_reason": "stop", "stop_sequence": "\n\n"}) == ("stop_sequence", "\n\n")


# ---- Responses bodies ---------------------------------------------------------------------------
def test_responses_bodies():
    r = parse_responses({"input": "Tell me a story.", "instructions": "Be brief.", "store": True, "tools": [],
                         "include": [], "tool_choice": "auto", "parallel_tool_calls": True, "truncation": "disabled",
                         "text": {"format": {"type": "text"}}, "metadata": {"k": "v"}})
    assert r.prompt_messages() == [{"role": "system", "content": "Be brief."}, *STORY]
    r = parse_responses({"input": [{"type": "message", "role": "developer", "content": "Rules."},
                                   {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                                   {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                                    "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]}]})
    assert r.prompt_messages() == [{"role": "system", "content": "Rules."}, {"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello."}]
    assert refused(parse_responses, {"input": "x", "previous_response_id": "resp_1"}) == (
        "previous_response_id", "'previous_response_id' is not supported: this server is stateless and keeps no "
        "responses; send the whole conversation in 'input'.")
    assert refused(parse_responses, {"input": [{"type": "reasoning", "summary": []}]}) == (
        "input", "'input[0]' is an item of type 'reasoning', which is not supported: this server takes message, "
        "function_call and function_call_output items.")
    assert refused(parse_responses, {"input": [{"type": "function_call_output", "call_id": "c"}]}) == (
        "input[0]", "'input[0]' is a function_call_output item and needs 'output'.")
    assert refused(parse_responses, {"input": [{"role": "user", "content": "x", "call_id": "c"}]}) == (
        "input[0]", "'input[0]' is a message item and cannot carry 'call_id'.")
    assert refused(parse_responses, {"input": [{"role": "user", "content": [{"type": "input_image"}]}]})[0] == \
        "input[0].content"
    assert refused(parse_responses, {"input": "x", "tools": [{"type": "web_search"}]}) == (
        "tools", "'tools[0]' is a tool of type 'web_search', which is not supported: this server calls function "
        "tools only.")
    assert refused(parse_responses, {"input": "x", "tool_choice": {"type": "function"}})[0] == "tool_choice"
    assert refused(parse_responses, {"input": "x", "truncation": "auto"})[0] == "truncation"
    assert refused(parse_responses, {"input": "x", "text": {"format": {"type": "json_schema"}}}) == (
        "text.format", "'text.format' of type 'json_schema' needs 'schema' (and only it has one).")
    assert refused(parse_responses, {"input": "x", "text": {"format": {"type": "xml"}}})[0] == "text.format.type"
    assert refused(parse_responses, {"input": "x", "stream_options": {"include_obfuscation": False}}) == (
        "stream_options", "'stream_options' is only allowed when 'stream' is true.")
    assert refused(parse_responses, {"input": "x", "reasoning": {"effort": "low"}})[0] == "reasoning"
    assert refused(parse_responses, {"input": "x", "max_output_tokens": 0}) == (
        "max_output_tokens", "'max_output_tokens' must be a positive integer of at most 2147483647 (or null).")
    assert refused(parse_responses, {"input": 5}) == (
        "input", "'input' must be a string or a list of message items ({\"role\", \"content\"}).")


def test_responses_tools_become_the_openai_chat_routes():
    r = parse_responses({"instructions": "Be brief.", "tools": [{"type": "function", "name": "get_weather",
                                                                 "parameters": CITY, "strict": True}],
                         "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
                         "input": [*STORY, {"type": "message", "role": "assistant", "content": "Let me look."},
                                   {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                    "arguments": '{"city": "Oslo"}', "id": "fc_1", "status": "completed"},
                                   {"type": "function_call", "call_id": "call_2", "name": "get_weather",
                                    "arguments": '{"city": "Rome"}'},
                                   {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
                                   {"type": "function_call_output", "call_id": "call_2",
                                    "output": [{"type": "input_text", "text": "sun"}]}]})
    assert r.prompt_messages() == [
        {"role": "system", "content": "Be brief."}, *STORY,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sun"}]
    assert r.tool_dicts() == [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    assert r.tool_choice_value() == {"type": "function", "function": {"name": "get_weather"}}
    only_call = parse_responses({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]})
    assert only_call.prompt_messages() == [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert parse_responses({"input": "x", "text": {"format": {"type": "json_schema", "name": "city",
                                                              "schema": CITY}}}).grammar() is not None
    assert parse_responses({"input": "x", "text": {"format": {"type": "text"}}}).grammar() is None
    with pytest.raises(HttpError) as e:
        parse_responses({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": 5}}}}).grammar()
    assert e.value.param == "text.format.schema"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12)
fields = st.sampled_from(["model", "messages", "input", "system", "instructions", "max_tokens", "max_output_tokens",
                          "temperature", "top_p", "top_k", "stop_sequences", "stream", "stream_options", "tools",
                          "tool_choice", "metadata", "store", "previous_response_id", "text", "truncation",
                          "output_config", "include"]) | st.text(max_size=6)
turn = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "developer"]) | json_values,
                              "content": st.text(max_size=8) | st.lists(st.fixed_dictionaries(
                                  {"type": st.sampled_from(["text", "input_text", "image"]) | json_values,
                                   "text": st.text(max_size=5) | json_values}), max_size=2) | json_values},
                             optional={"type": st.just("message") | json_values})
bodies = st.dictionaries(fields, json_values | st.lists(turn, max_size=2), max_size=6)


@settings(max_examples=600, deadline=None)
@given(bodies)
def test_any_json_body_is_a_request_or_a_400_naming_a_field(body):
    for parse in (parse_messages, parse_count_tokens, parse_responses):
        try:
            parse(body)
        except HttpError as e:
            assert e.status == 400 and e.message.endswith(".") and e.message[:1] in "'T", e.message
            assert e.param is None or e.message.startswith(f"'{e.param.split('.')[0].split('[')[0]}")


# ---- routes -------------------------------------------------------------------------------------
def run(raw: bytes, node=IDLE) -> tuple[int, dict, bytes]:
    return trio.run(exchange, raw, node)


def post(path: str, body: dict) -> bytes:
    return http_request("POST", path, body=json.dumps(body).encode())


def test_each_api_answers_errors_in_its_own_shape():
    status, headers, body = run(post("/v1/messages", {"messages": STORY}))
    assert status == 400 and json.loads(body) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "'max_tokens' is required."}}
    status, headers, body = run(post("/v1/messages", {"messages": STORY, "max_tokens": 3}))
    assert status == 503 and json.loads(body)["error"]["type"] == "overloaded_error"
    status, _, body = run(http_request("GET", "/v1/messages/count_tokens"))
    assert status == 405 and json.loads(body)["type"] == "error"
    status, _, body = run(post("/v1/responses", {"input": "x", "previous_response_id": "r"}))
    assert status == 400 and json.loads(body)["error"]["param"] == "previous_response_id"
    status, _, body = run(post("/v1/responses", {"input": "x"}))
    assert status == 503 and json.loads(body)["error"]["type"] == "service_unavailable"


async def tokenizing_host(context: int):
    """A ready HostSession holding stories260K's tokenizer (its ring is not needed to count or refuse)."""
    h = await ready_host()
    h.model_dir = str(packaged_model_dir())
    h.info = read_model_info(h.model_dir)
    h.context = context
    h._chat_tokenizer = load_tokenizer(h.model_dir)
    return h


def test_count_tokens_and_prompts_past_the_context():
    async def main():
        h = await tokenizing_host(512)
        node = SessionOnly(h)
        long = [{"role": "user", "content": "the cat sat on the mat. " * 200}]
        answers = [await exchange(post("/v1/messages/count_tokens", {"messages": STORY, "system": "Be brief."}), node),
                   await exchange(post("/v1/messages", {"messages": long, "max_tokens": 5}), node),
                   await exchange(post("/v1/responses", {"input": long}), node),
                   await exchange(post("/v1/responses", {"input": "Hi", "max_output_tokens": 600}), node)]
        prompt = h.chat_prompt([{"role": "system", "content": "Be brief."}, *STORY])
        return answers, len(h._chat_tokenizer.encode(prompt)), h.chat_prompt(long)
    answers, n, long_prompt = trio.run(main)
    (s1, _, counted), (s2, _, messages), (s3, _, responses), (s4, _, output) = answers
    assert s1 == 200 and json.loads(counted) == {"input_tokens": n}
    assert s2 == 400 and json.loads(messages)["error"]["message"].endswith(
        "plus 'max_tokens' 5 exceeds the session's context of 512 tokens.")
    error = json.loads(responses)["error"]
    assert s3 == 400 and error["param"] == "input" and error["message"].endswith(
        "leaves no room to generate in the session's context of 512 tokens; shorten the input.")
    error = json.loads(output)["error"]
    assert s4 == 400 and error["param"] == "max_output_tokens" and "plus 'max_output_tokens' 600 exceeds" in \
        error["message"]


# ---- metrics ------------------------------------------------------------------------------------
def samples(text: bytes) -> dict:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metered_generation_under_a_fake_clock():
    now = [100.0]
    metrics = ApiMetrics()
    meter = RequestMeter(metrics, "/v1/messages", "POST", clock=lambda: now[0])

    async def generate(emit):  # the session's contract: token events, then the result
        for i, step_s in enumerate([0.5, 0.02, 0.03]):
            now[0] += step_s
            await emit({"t": "token", "token_id": i, "text": "ab"[:i]})
        await emit({"t": "token", "token_id": None, "text": "tail"})  # detokenizer tail: not a token
        return {"text": "a", "token_ids": [0, 1, 2], "prompt_tokens": 7, "cached_tokens": 4, "finish_reason": "length"}

    async def cancelled(emit):
        now[0] += 0.25
        await emit({"t": "token", "token_id": 5, "text": "x"})
        raise GenerationCancelled("The client went away.", tokens=1)

    seen: list[dict] = []

    async def emit(ev):
        seen.append(ev)

    async def main():
        await metered(generate, meter)(emit)
        meter.t0_s = now[0]
        with pytest.raises(GenerationCancelled):
            await metered(cancelled, meter)(emit)
    trio.run(main)
    assert len(seen) == 5  # every event still reaches the answer
    got = samples(metrics.render(None))
    route = (("route", "/v1/messages"),)
    assert got[("kafila_time_to_first_token_seconds_count", route)] == 2
    assert got[("kafila_time_to_first_token_seconds_sum", route)] == pytest.approx(0.75)
    assert got[("kafila_inter_token_seconds_count", route)] == 2
    assert got[("kafila_inter_token_seconds_sum", route)] == pytest.approx(0.05)
    assert got[("kafila_inter_token_seconds_bucket", (("le", "0.025"), *route))] == 1
    assert got[("kafila_generated_tokens_total", route)] == 4 and got[("kafila_prompt_tokens_total", route)] == 7
    assert got[("kafila_prompt_cached_tokens_total", route)] == 4
    assert got[("kafila_generations_total", (("outcome", "length"), *route))] == 1
    assert got[("kafila_generations_total", (("outcome", "client_gone"), *route))] == 1
    assert got[("kafila_generation_seconds_count", route)] == 1


def test_the_snapshot_as_metrics():
    assert SESSION_STATES == tuple(s.value for s in HostState)
    snapshot = {"role": "host", "state": "recovering", "session_id": "s1", "model_id": "stories260K", "epoch": 3,
                "requests": {"running": 1, "queued": 2, "concurrency": 1, "queue_limit": 8},
                "members": [{"name": "m0", "ready": True, "predicted_stage_s": 0.004, "measured_stage_s": 0.005},
                            {"name": "m1", "ready": False, "lost": "its connection closed", "predicted_stage_s": None},
                            {"name": "m2", "ready": True, "standby": True}],
                "edges": [{"from": "m0", "to": "m2", "path": "direct", "rtt_ms": 1.5, "bytes_sent": 4096},
                          {"from": "m2", "to": "m0", "path": "relayed", "rtt_ms": None, "bytes_sent": 0}],
                "last_generation": {"decode_tokens_per_s": 40.0},
                "prompt_cache": {"on": True, "entries": 2, "entry_tokens": 300, "budget_tokens": 4096, "hits": 5,
                                 "tokens_saved": 1200}}
    metrics = ApiMetrics()
    got = samples(metrics.render(NodeStatus.from_json(snapshot)))
    assert got[("kafila_session_state", (("state", "recovering"),))] == 1
    assert sum(v for (name, _), v in got.items() if name == "kafila_session_state") == 1
    assert got[("kafila_replans_total", ())] == 2
    assert got[("kafila_requests_queued", ())] == 2 and got[("kafila_queue_limit", ())] == 8
    assert [got[("kafila_members", (("status", k),))] for k in ("ready", "lost", "standby")] == [1, 1, 1]
    assert got[("kafila_stage_predicted_step_seconds", (("member", "m0"),))] == 0.004
    assert got[("kafila_stage_measured_step_seconds", (("member", "m0"),))] == 0.005
    assert ("kafila_stage_predicted_step_seconds", (("member", "m1"),)) not in got
    assert got[("kafila_edge_path", (("from", "m2"), ("path", "relayed"), ("to", "m0")))] == 1
    assert got[("kafila_edge_rtt_seconds", (("from", "m0"), ("to", "m2")))] == 0.0015
    assert ("kafila_edge_rtt_seconds", (("from", "m2"), ("to", "m0"))) not in got
    assert got[("kafila_edge_sent_bytes_total", (("from", "m0"), ("to", "m2")))] == 4096
    assert got[("kafila_last_generation_tokens_per_second", ())] == 40
    assert [got[(f"kafila_prompt_cache_{k}", ())] for k in ("enabled", "hits_total", "saved_tokens_total", "entries",
                                                            "tokens", "budget_tokens")] == [1, 5, 1200, 2, 300, 4096]
    off = samples(metrics.render(NodeStatus.from_json({**snapshot, "prompt_cache": {"on": False, "why": "sliding windows"}})))
    assert off[("kafila_prompt_cache_enabled", ())] == 0 and ("kafila_prompt_cache_hits_total", ()) not in off
    idle = samples(metrics.render(NodeStatus.from_json({"role": None, "state": "idle"})))
    assert not [k for k in idle if k[0].startswith("kafila_session") or k[0].startswith("kafila_members")]


def test_metrics_route_counts_requests_by_route_template():
    def scrape() -> dict:
        status, headers, body = run(http_request("GET", "/metrics"))
        assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
        return samples(body)
    before = scrape()
    run(post("/v1/messages", {"messages": STORY}))
    run(http_request("GET", "/v1/models/some%20model"))
    run(http_request("GET", "/no/such/path"))
    after = scrape()

    def moved(route: str, method: str, code: str) -> float:
        key = ("kafila_http_requests_total", (("code", code), ("method", method), ("route", route)))
        return after.get(key, 0) - before.get(key, 0)
    assert moved("/v1/messages", "POST", "400") == 1
    assert moved("/v1/models/{id}", "GET", "503") == 1
    assert moved("other", "GET", "404") == 1
    assert moved("/metrics", "GET", "200") == 1  # the first scrape, counted once it was answered


def test_api_keys_guard_the_new_routes_and_metrics():
    """With keys set, /v1/messages answers 401 in Anthropic's shape (its clients send `x-api-key`),
    and /metrics needs the key too; each answer is counted in this server's own metrics."""
    key = "k" * 24
    metrics = ApiMetrics()

    async def ask(raw: bytes) -> tuple[int, bytes]:
        server = HttpServer(partial(openai_api.handle, IDLE, keys=ApiKeys([key]), metrics=metrics))
        client, srv = trio.testing.memory_stream_pair()
        out = bytearray()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve_stream, srv)
            await client.send_all(raw)
            while data := await client.receive_some(65536):
                out += data
        head, _, body = bytes(out).partition(b"\r\n\r\n")
        return int(head.split()[1]), body

    body = json.dumps({"messages": STORY, "max_tokens": 3}).encode()
    status, answer = trio.run(ask, http_request("POST", "/v1/messages", body=body))
    assert status == 401 and json.loads(answer)["error"]["type"] == "authentication_error"
    status, answer = trio.run(ask, http_request("POST", "/v1/messages", {"x-api-key": key}, body))
    assert status == 503 and json.loads(answer)["error"]["type"] == "overloaded_error"  # past the key: no session
    status, _ = trio.run(ask, http_request("GET", "/metrics"))
    assert status == 401
    status, text = trio.run(ask, http_request("GET", "/metrics", {"authorization": f"Bearer {key}"}))
    got = samples(text)
    assert status == 200
    assert got[("kafila_http_requests_total", (("code", "401"), ("method", "POST"), ("route", "/v1/messages")))] == 1
    assert got[("kafila_http_requests_total", (("code", "503"), ("method", "POST"), ("route", "/v1/messages")))] == 1
    assert got[("kafila_http_requests_total", (("code", "401"), ("method", "GET"), ("route", "/metrics")))] == 1
