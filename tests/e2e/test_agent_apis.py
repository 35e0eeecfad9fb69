"""The Anthropic Messages API, the OpenAI Responses API and GET /metrics (issue 23 items 4-6) against a
real 3-member ring on the synthesised Llama, with the official clients: `anthropic` (messages whole
and streamed, stop sequences, count_tokens, refusals) and `openai`'s `responses.create` (plain and
stream=True). Greedy text equals the OpenAI chat route's for the same conversation (one generation
path); the raw Server-Sent Events come in the order each API documents; /metrics parses with
prometheus_client's parser and its counters move as requests run; the OpenAI Agents SDK runs a
two-step tool loop with its default model class; hypothesis fires arbitrary JSON
bodies at the new routes: every answer is a 4xx or a 200, never a 5xx, and the host serves on.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from typing import Literal

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic import BaseModel

from kafila_ctl.demo import LoopbackCluster

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
prometheus_parser = pytest.importorskip("prometheus_client.parser")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="Linux loopback")]

STORY = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, synth_llama):
    with LoopbackCluster(3, root=str(tmp_path_factory.mktemp("c"))) as c:
        c.form(str(synth_llama), context=4096)
        c.base = c.call(0, "status")["http"].removesuffix("/v1")
        c.port = int(c.base.rsplit(":", 1)[1])
        c.model = synth_llama.name
        c.openai = openai.OpenAI(base_url=c.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        c.anthropic = anthropic.Anthropic(base_url=c.base, api_key="unused", max_retries=0, timeout=120)
        yield c


def chat_text(c, messages: list[dict], n: int) -> tuple[str, object]:
    out = c.openai.chat.completions.create(model=c.model, messages=messages, max_tokens=n)
    return out.choices[0].message.content, out.usage


def post(c, path: str, body, *, raw: bool = False) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=120)
    try:
        conn.request("POST", path, body=body if raw else json.dumps(body), headers={"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def sse_events(data: bytes) -> list[tuple[str, dict]]:
    """(event name, data) of each Server-Sent Event."""
    out = []
    for block in data.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields:
            out.append((fields.get("event"), json.loads(fields["data"])))
    return out


def scrape(c) -> dict:
    """{(sample name, labels as sorted tuple): value} of GET /metrics, parsed by prometheus_client."""
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    text = r.read().decode()
    assert r.status == 200 and r.getheader("content-type").startswith("text/plain")
    out = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# ---- Anthropic -------------------------------------------------------------------------------------
def test_anthropic_messages_whole_streamed_and_counted(served):
    c = served
    expected, usage = chat_text(c, STORY, 10)
    msg = c.anthropic.messages.create(model=c.model, max_tokens=10, messages=STORY)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == c.model and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == expected
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 10
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == usage.prompt_tokens
    assert msg.usage.cache_read_input_tokens > 0  # the chat route's same prompt just ran: the prompt cache has it

    system = "You are a storyteller."
    with_system, _ = chat_text(c, [{"role": "system", "content": system}, *STORY], 8)
    blocks = c.anthropic.messages.create(model=c.model, max_tokens=8, system=[{"type": "text", "text": system}],
                                         messages=[{"role": "user", "content": [
                                             {"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story."}]}])
    assert blocks.content[0].text == with_system

    with c.anthropic.messages.stream(model=c.model, max_tokens=10, messages=STORY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == expected and final.content[0].text == expected and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == usage.prompt_tokens

    events = list(c.anthropic.messages.create(model=c.model, max_tokens=6, messages=STORY, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"} and all(e.delta.type == "text_delta" for e in events[2:-3])
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 6

    status, body = post(c, "/v1/messages", {"model": c.model, "max_tokens": 4, "messages": STORY, "stream": True})
    raw = sse_events(body)
    assert status == 200 and [e for e, _ in raw][:3] == ["message_start", "ping", "content_block_start"]
    assert all(e == d["type"] for e, d in raw)  # each event named by its type, as Anthropic streams

    count = c.anthropic.messages.count_tokens(model=c.model, messages=STORY)
    assert count.input_tokens == usage.prompt_tokens


def test_anthropic_stop_sequences_and_refusals(served):
    c = served
    full = c.anthropic.messages.create(model=c.model, max_tokens=40, messages=STORY).content[0].text
    stop = full[12:15]
    cut = full[:full.find(stop)]
    out = c.anthropic.messages.create(model=c.model, max_tokens=40, messages=STORY, stop_sequences=["\x00", stop])
    assert out.content[0].text == cut and out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    with c.anthropic.messages.stream(model=c.model, max_tokens=40, messages=STORY, stop_sequences=[stop]) as s:
        assert "".join(s.text_stream) == cut
        assert s.get_final_message().stop_reason == "stop_sequence"

    # sampling fields (older clients send them; newer ones with extra_body) reach the head's sampler:
    # top_k 1 is greedy at any temperature
    top1 = c.anthropic.messages.create(model=c.model, max_tokens=40, messages=STORY,
                                       extra_body={"temperature": 1.0, "top_k": 1, "top_p": 0.9})
    assert top1.content[0].text == full

    with pytest.raises(anthropic.NotFoundError) as e:
        c.anthropic.messages.create(model="claude-opus-4", max_tokens=4, messages=STORY)
    assert e.value.body["error"]["type"] == "not_found_error" and c.model in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        c.anthropic.messages.create(model=c.model, max_tokens=4, messages=STORY, extra_body={"temperature": 1.5})
    assert e.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "'temperature' must be a number between 0 and 1."}}
    with pytest.raises(anthropic.BadRequestError) as e:
        c.anthropic.messages.create(model=c.model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}]}])
    assert e.value.body["error"]["message"].startswith("'messages[0].content' holds a block of type 'image'")
    with pytest.raises(anthropic.BadRequestError) as e:
        c.anthropic.messages.create(model=c.model, max_tokens=5000, messages=STORY)
    assert "exceeds the session's context of 4096 tokens" in e.value.body["error"]["message"]
    status, body = post(c, "/v1/messages", {"messages": STORY})
    assert status == 400 and json.loads(body)["error"]["message"] == "'max_tokens' is required."
    status, body = post(c, "/v1/messages/count_tokens", b"{not json", raw=True)
    assert status == 400 and json.loads(body)["type"] == "error"  # Anthropic's shape on every /v1/messages path


CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "days"], "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": CITY, "get_time": ZONE}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def matches(doc: dict, schema: dict) -> bool:
    props = schema["properties"]
    return set(doc) == set(schema["required"]) and all(
        (doc[k] in p["enum"]) if "enum" in p else (p["minimum"] <= doc[k] <= p["maximum"]) for k, p in props.items())


def test_anthropic_tool_use_forced_whole_streamed_and_round_trip(served):
    """With random weights a forced call (tool_choice any / tool) still parses and matches its schema."""
    c = served
    tools = [{"name": "get_weather", "description": "Weather for a city", "input_schema": CITY},
             {"name": "get_time", "input_schema": ZONE}]
    msg = c.anthropic.messages.create(model=c.model, max_tokens=300, messages=WEATHER_Q, tools=tools,
                                      tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    call = msg.content[0]
    assert call.id.startswith("toolu_") and matches(call.input, SCHEMAS[call.name])

    with c.anthropic.messages.stream(model=c.model, max_tokens=300, messages=WEATHER_Q, tools=tools,
                                     tool_choice={"type": "tool", "name": "get_time"}) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and uses and all(b.name == "get_time" and matches(b.input, ZONE)
                                                            for b in uses)

    follow = [*WEATHER_Q, {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                            "input": call.input}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}]}]
    again = c.anthropic.messages.create(model=c.model, max_tokens=300, messages=follow, tools=tools,
                                        tool_choice={"type": "tool", "name": "get_weather"})
    assert again.stop_reason == "tool_use" and matches(again.content[0].input, CITY)
    free = c.anthropic.messages.create(model=c.model, max_tokens=6, messages=follow, tools=tools)  # auto: any reply
    assert free.stop_reason in ("max_tokens", "end_turn", "tool_use") and free.usage.output_tokens <= 6
    assert c.anthropic.messages.count_tokens(model=c.model, messages=follow, tools=tools).input_tokens > \
        c.anthropic.messages.count_tokens(model=c.model, messages=follow).input_tokens  # the tools are in the prompt


# ---- Responses --------------------------------------------------------------------------------------
def test_responses_plain_and_streamed(served):
    c = served
    expected, usage = chat_text(c, STORY, 10)
    r = c.openai.responses.create(model=c.model, input="Tell me a story.", max_output_tokens=10)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == expected
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 10 and r.usage.input_tokens == usage.prompt_tokens
    assert r.usage.total_tokens == 10 + usage.prompt_tokens
    assert r.usage.input_tokens_details.cached_tokens > 0  # the same prompt ran just before: the prompt cache
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"

    system = "You are a storyteller."
    with_system, _ = chat_text(c, [{"role": "system", "content": system}, *STORY], 8)
    items = c.openai.responses.create(model=c.model, instructions=system, max_output_tokens=8, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me "},
                                     {"type": "input_text", "text": "a story."}]}])
    assert items.output_text == with_system and items.instructions == system

    events = list(c.openai.responses.create(model=c.model, input="Tell me a story.", max_output_tokens=10,
                                            stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events[4:-4]) == expected == events[-4].text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == expected and events[-1].response.usage.output_tokens == 10

    with pytest.raises(openai.BadRequestError) as e:
        c.openai.responses.create(model=c.model, input="hi", previous_response_id="resp_abc")
    assert e.value.param == "previous_response_id" and "stateless" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.openai.responses.create(model=c.model, input="hi", tools=[{"type": "web_search"}])
    assert e.value.param == "tools" and "function tools only" in e.value.message


def test_responses_function_tools_and_json_schema(served):
    c = served
    tools = [{"type": "function", "name": "get_weather", "description": "Weather for a city", "parameters": CITY,
              "strict": True}, {"type": "function", "name": "get_time", "parameters": ZONE, "strict": True}]
    r = c.openai.responses.create(model=c.model, input="What is the weather in Paris?", tools=tools,
                                  tool_choice="required", parallel_tool_calls=False, max_output_tokens=300)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.call_id.startswith("call_") and matches(json.loads(call.arguments), SCHEMAS[call.name])

    events = list(c.openai.responses.create(model=c.model, input="What is the weather in Paris?", tools=tools,
                                            tool_choice={"type": "function", "name": "get_time"},
                                            max_output_tokens=300, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" not in kinds and kinds.count("response.function_call_arguments.done") >= 1
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert all(e.name == "get_time" and matches(json.loads(e.arguments), ZONE) for e in done)
    assert [o.type for o in events[-1].response.output] == ["function_call"] * len(done)

    with c.openai.responses.stream(model=c.model, input="What is the weather in Paris?", tools=tools,
                                   tool_choice="required", parallel_tool_calls=False,
                                   max_output_tokens=300) as stream:
        final = stream.get_final_response()
    assert matches(json.loads(final.output[0].arguments), SCHEMAS[final.output[0].name])

    follow = c.openai.responses.create(model=c.model, tools=tools, tool_choice="required", parallel_tool_calls=False,
                                       max_output_tokens=300, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
    assert follow.output[0].type == "function_call"
    assert matches(json.loads(follow.output[0].arguments), SCHEMAS[follow.output[0].name])

    shaped = c.openai.responses.create(model=c.model, input="A city, please.", max_output_tokens=200, text={
        "format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}})
    assert shaped.status == "completed" and matches(json.loads(shaped.output_text), CITY)


# ---- /metrics ---------------------------------------------------------------------------------------
def test_metrics_parse_and_move_as_requests_run(served):
    c = served
    before = scrape(c)
    assert value(before, "kafila_session_state", state="ready") == 1.0
    assert value(before, "kafila_session_state", state="loading") == 0.0
    assert value(before, "kafila_members", status="ready") == 3.0
    assert value(before, "kafila_replans_total") == 0.0
    assert value(before, "kafila_concurrency") == 1.0 and value(before, "kafila_requests_queued") == 0.0
    members = [m["name"] for m in c.call(0, "status")["members"]]
    assert all(value(before, "kafila_stage_predicted_step_seconds", member=m) > 0 for m in members)
    edges = [k for k in before if k[0] == "kafila_edge_path"]
    assert len(edges) == 3 and all(dict(k[1])["path"] in ("direct", "relayed", "pending") for k in edges)

    whole = c.anthropic.messages.create(model=c.model, max_tokens=5, messages=STORY)
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=120)  # a stream, scraped while it runs
    conn.request("POST", "/v1/messages", body=json.dumps({"model": c.model, "max_tokens": 200, "messages": STORY,
                                                         "stream": True}))
    r = conn.getresponse()
    first = r.readline()
    assert first.startswith(b"event: message_start")
    during = scrape(c)
    assert value(during, "kafila_requests_running") == 1.0
    route = "/v1/messages"
    assert value(during, "kafila_time_to_first_token_seconds_count", route=route) == \
        value(before, "kafila_time_to_first_token_seconds_count", route=route) + 2
    [delta] = [d for e, d in sse_events(first + r.read()) if e == "message_delta"]
    conn.close()
    n1, n2 = whole.usage.output_tokens, delta["usage"]["output_tokens"]
    after = scrape(c)
    assert value(after, "kafila_requests_running") == 0.0
    assert value(after, "kafila_http_requests_total", route=route, method="POST", code="200") == \
        value(before, "kafila_http_requests_total", route=route, method="POST", code="200") + 2
    outcomes = {"max_tokens": "length", "end_turn": "stop"}
    for reason in {whole.stop_reason, delta["delta"]["stop_reason"]}:
        n = [whole.stop_reason, delta["delta"]["stop_reason"]].count(reason)
        assert value(after, "kafila_generations_total", route=route, outcome=outcomes[reason]) == \
            value(before, "kafila_generations_total", route=route, outcome=outcomes[reason]) + n
    assert value(after, "kafila_generated_tokens_total", route=route) == \
        value(before, "kafila_generated_tokens_total", route=route) + n1 + n2
    assert value(after, "kafila_inter_token_seconds_count", route=route) == \
        value(before, "kafila_inter_token_seconds_count", route=route) + (n1 - 1) + (n2 - 1)
    prompt_n = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert value(after, "kafila_prompt_tokens_total", route=route) == \
        value(before, "kafila_prompt_tokens_total", route=route) + 2 * prompt_n
    assert value(after, "kafila_prompt_cached_tokens_total", route=route) >= \
        value(before, "kafila_prompt_cached_tokens_total", route=route) + whole.usage.cache_read_input_tokens
    cache = c.call(0, "status")["prompt_cache"]  # what /metrics reads (nothing ran since the scrape)
    assert value(after, "kafila_prompt_cache_enabled") == 1.0 == float(cache["on"])
    if "hits" in cache:  # the host is the head: its cache's own counts
        assert value(after, "kafila_prompt_cache_hits_total") == cache["hits"] >= 1
        assert value(after, "kafila_prompt_cache_saved_tokens_total") == cache["tokens_saved"] > 0
    assert value(after, "kafila_generation_seconds_count", route=route) == \
        value(before, "kafila_generation_seconds_count", route=route) + 2
    assert all(value(after, "kafila_stage_measured_step_seconds", member=m) > 0 for m in members)
    scrapes = value(after, "kafila_http_requests_total", route="/metrics", method="GET", code="200")
    assert scrapes == value(before, "kafila_http_requests_total", route="/metrics", method="GET", code="200") + 2


# ---- fuzzed bodies ----------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10)
blocks = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "output_text", "image",
                                                                  "tool_use"]) | json_values},
                                        optional={"text": st.text(max_size=10) | json_values}), max_size=2)
turns = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | json_values,
     "content": st.text(max_size=12) | blocks | json_values}, optional={"type": st.just("message") | json_values}),
    max_size=2)
agent_bodies = st.fixed_dictionaries({}, optional={
    "model": st.just("synth-llama") | json_values, "messages": turns | json_values, "input": turns | st.text(max_size=12)
    | json_values, "system": st.text(max_size=8) | blocks | json_values, "instructions": json_values,
    "max_tokens": st.integers(-2, 3) | json_values, "max_output_tokens": st.integers(-2, 3) | json_values,
    "temperature": st.floats() | json_values, "top_p": json_values, "top_k": json_values,
    "stop_sequences": st.lists(st.text(max_size=3), max_size=2) | json_values, "stream": st.booleans() | json_values,
    "tools": json_values, "tool_choice": json_values, "previous_response_id": json_values, "store": json_values,
    "metadata": json_values, "text": json_values, "truncation": json_values,
})


valid_turns = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                              "content": st.text(max_size=12)}), min_size=1, max_size=2)
requests = st.one_of(
    st.tuples(st.sampled_from(["/v1/messages", "/v1/messages/count_tokens", "/v1/responses"]),
              agent_bodies | json_values),
    st.tuples(st.just("/v1/messages"), st.fixed_dictionaries(
        {"max_tokens": st.integers(1, 3), "messages": valid_turns},
        optional={"stream": st.booleans(), "system": st.text(max_size=8), "temperature": st.floats(0, 1),
                  "stop_sequences": st.lists(st.text(min_size=1, max_size=2), max_size=2)})),
    st.tuples(st.just("/v1/responses"), st.fixed_dictionaries(
        {"max_output_tokens": st.integers(1, 3), "input": st.text(max_size=12) | valid_turns},
        optional={"stream": st.booleans(), "instructions": st.text(max_size=8), "temperature": st.floats(0, 2)})),
)


def test_fuzzed_bodies_are_4xx_never_5xx(served):
    c = served
    statuses: dict[int, int] = {}

    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(requests)
    def fire(request):
        path, body = request
        status, answer = post(c, path, json.dumps(body, allow_nan=True).encode(), raw=True)
        statuses[status] = statuses.get(status, 0) + 1
        assert status == 200 or 400 <= status < 500, (path, body, status, answer[:300])
        if status != 200:
            doc = json.loads(answer)
            message = doc["error"]["message"]
            assert (doc.get("type") == "error") == path.startswith("/v1/messages")  # each API's own error shape
            assert isinstance(message, str) and message and "Traceback" not in message

    fire()
    print("statuses:", statuses)
    assert statuses.get(200, 0) > 20 and sum(n for s, n in statuses.items() if s >= 400) > 50
    expected, _ = chat_text(c, STORY, 6)
    assert c.anthropic.messages.create(model=c.model, max_tokens=6, messages=STORY).content[0].text == expected
    assert c.call(0, "status")["state"] == "ready"


class TimeAnswer(BaseModel):
    zone: Literal["UTC", "CET"]
    time: Literal["12:00", "13:00"]


def test_openai_agents_sdk_default_model_runs_a_two_step_tool_loop(served):
    """The OpenAI Agents SDK's default model class (the Responses API): the first turn must call
    the tool (tool_choice required, constrained: its argument is one of the enum's); the SDK runs it,
    resets tool_choice to auto and sends the call and its output back as input items; the second turn
    answers with the agent's output_type (text.format json_schema, constrained), which ends the run.
    With random weights free text never ends before max_output_tokens, which the SDK takes as a
    failed run (response.incomplete), so the final answer is structured."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    c = served
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(AsyncOpenAI(base_url=c.base + "/v1", api_key="unused", max_retries=0,
                                                 timeout=120), use_for_tracing=False)
    asked: list[str] = []

    @agents.function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time now in a time zone."""
        asked.append(zone)
        return "12:00"

    agent = agents.Agent(name="clock", instructions="Answer with the time.", model=c.model, tools=[get_time],
                         output_type=TimeAnswer,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=200))
    result = agents.Runner.run_sync(agent, "What time is it in Paris?", max_turns=3)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert len(asked) == kinds.count("tool_call_item") >= 1 and set(asked) <= {"UTC", "CET"}
    assert isinstance(result.final_output, TimeAnswer) and result.final_output.zone in ("UTC", "CET")
    assert len(result.raw_responses) == 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_debian_prometheus_scrapes_the_metrics(served, tmp_path):
    """Debian's `prometheus` (apt, .ci/run) lints the exposition (`promtool check metrics`) and
    scrapes /metrics from the running host: its query API then answers the session's state and the
    request counters."""
    if shutil.which("prometheus") is None or shutil.which("promtool") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Debian's prometheus package is not installed; .ci/run installs it.")
        pytest.skip("Debian's prometheus package is not installed (apt-get install prometheus).")
    c = served
    c.anthropic.messages.create(model=c.model, max_tokens=3, messages=STORY)
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read()
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert lint.returncode == 0, (lint.stdout + lint.stderr).decode()[:2000]

    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: kafila, static_configs: [{{targets: ['127.0.0.1:{c.port}']}}]}}]\n")
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))

    def query(q: str) -> list:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q}),
                                    timeout=10) as r:
            return json.loads(r.read())["data"]["result"]
    try:
        deadline = time.monotonic() + 120
        ready: list = []
        while time.monotonic() < deadline and not ready:
            time.sleep(1)
            try:
                ready = query('kafila_session_state{state="ready"} == 1')
            except OSError:  # prometheus still starting
                continue
        assert ready, (tmp_path / "prometheus.log").read_text()[-2000:]
        [requests] = query('sum(kafila_http_requests_total{route="/v1/messages",code="200"})')
        assert float(requests["value"][1]) >= 1
        assert query("kafila_members") and query("kafila_edge_path")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
