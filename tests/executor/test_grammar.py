"""Constrained decoding on the head (issue 23 item 2, kafilad/executor/grammar.py): every token keeps the
output within the request's grammar, greedy or sampled, alone or as one row of a batch with its own
grammar; a bad grammar is refused with a sentence. On a synthesised Llama (random weights: without the
grammar its output is byte noise, never JSON)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from kafilad.control.api_common import HttpError
from kafilad.control.grammars import ANY_OBJECT, json_grammar, tool_call_schema
from kafilad.errors import RemoteProtocolError
from kafilad.executor.grammar import GrammarError, Grammars
from kafilad.executor.runner import StageRunner, array_from_wire, array_to_wire, generate_local, prefill_chunks
from kafilad.executor.stage import load_stage_from_dir
from kafilad.executor.synth import load_tokenizer, synthesize_model
from kafilad.proto.sampling import MAX_GRAMMAR_BYTES, Sampling

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["city", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    d = synthesize_model(tmp_path_factory.mktemp("g"), arch="llama", seed=3)
    tok = load_tokenizer(d)
    runners = [StageRunner(load_stage_from_dir(d, a, b, i == 0)) for i, (a, b) in enumerate([(0, 3), (3, 6)])]
    runners[0].grammars = Grammars(tok, 258)
    return runners, tok


def run(ring, prompt: str, sampling: Sampling, n: int = 80) -> str:
    runners, tok = ring
    out = generate_local(runners, tok.encode(prompt), n, sampling=sampling, eos_token_ids=tok.eos_token_ids)
    assert out[-1] in tok.eos_token_ids, "the grammar ended the output with an end-of-sequence token"
    return tok.decode(out[:-1])


def test_free_output_is_not_json(ring):
    runners, tok = ring
    text = tok.decode(generate_local(runners, tok.encode("hello"), 40))
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.5, 7)])
def test_schema_output_parses_and_matches(ring, temperature, seed):
    doc = json.loads(run(ring, "hello", Sampling(grammar=json_grammar(CITY, param="s"), temperature=temperature,
                                                 seed=seed)))
    assert set(doc) == {"city", "n"} and doc["city"] in ("Paris", "Rome", "Oslo") and 0 <= doc["n"] <= 99


def test_any_object_and_a_forced_tool_call(ring):
    assert isinstance(json.loads(run(ring, "x", Sampling(grammar=json_grammar(ANY_OBJECT, param="s")), 200)), dict)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
             {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                              "additionalProperties": False}}}]
    call = json.loads(run(ring, "x", Sampling(grammar=json_grammar(
        tool_call_schema(tools, name="get_weather", parallel=False), param="tool_choice"))))
    assert call["name"] == "get_weather" and set(call["arguments"]) == {"city", "n"}
    calls = json.loads(run(ring, "y", Sampling(grammar=json_grammar(
        tool_call_schema(tools, name=None, parallel=True), param="tool_choice")), 400))
    assert calls and all(c["name"] in ("get_weather", "noop") for c in calls)


def test_batched_rows_keep_their_own_grammars(ring):
    """Two requests decoded in one batch, one under a schema and one free: each row as alone."""
    runners, tok = ring
    hop = lambda a: array_from_wire(array_to_wire(a))  # noqa: E731
    g = Sampling(grammar=json_grammar(CITY, param="s"))
    free = Sampling(seed=3, temperature=1.0)
    alone = {"a": generate_local(runners, tok.encode("hi"), 24, sampling=g, eos_token_ids=tok.eos_token_ids,
                                 request_id="a"),
             "b": generate_local(runners, tok.encode("yo"), 24, sampling=free, request_id="b")}
    head = runners[0]
    out = {}
    for rid, p, s in (("a", "hi", g), ("b", "yo", free)):
        for chunk in prefill_chunks(tok.encode(p)):
            h = head.head_embed_and_run(rid, chunk)
            h = runners[1].run(rid, hop(h))
        out[rid] = [head.head_sample_rows([rid], hop(h), [s], [None])[0][0]]
    rids = ["a", "b"]
    while any(len(out[r]) < len(alone[r]) for r in rids):
        h = head.head_embed_and_run_batch(rids, [out[r][-1] for r in rids])
        h = runners[1].run_batch(rids, hop(h))
        rows = head.head_sample_rows(rids, hop(h), [g, free], [None, None])
        for r, (t, _) in zip(rids, rows):
            if len(out[r]) < len(alone[r]):
                out[r].append(t)
    assert out == alone
    for r in rids:
        for x in runners:
            x.drop(r)
    assert not head.grammars._matchers


def test_bad_grammars_are_refused(ring):
    runners, tok = ring
    with pytest.raises(HttpError, match="'response_format.json_schema.schema' is not a JSON schema") as e:
        json_grammar({"type": "nonsense"}, param="response_format.json_schema.schema")
    assert e.value.status == 400
    with pytest.raises(HttpError, match="must be a JSON schema"):
        json_grammar([1, 2], param="format")
    with pytest.raises(GrammarError, match="grammar cannot be used"):
        generate_local(runners, tok.encode("x"), 4, sampling=Sampling(grammar="start: %%% nonsense"))


def test_grammar_on_the_wire():
    g = json_grammar(CITY, param="s")
    assert Sampling.from_wire(Sampling(grammar=g).to_wire()).grammar == g
    assert not Sampling(grammar=g).plain
    with pytest.raises(RemoteProtocolError, match="'grammar' is 7"):
        Sampling.from_wire({"grammar": 7})
    with pytest.raises(RemoteProtocolError, match="at most"):
        Sampling.from_wire({"grammar": "x" * (MAX_GRAMMAR_BYTES + 1)})
    _ = mx
