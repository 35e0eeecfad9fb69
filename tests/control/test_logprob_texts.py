"""The texts of `top_logprobs` alternatives are what each token adds where it stands, as the chosen
token's text is (kafilad/control/api_common.py `TokenText`, `token_reports`).

A new user's report: `/v1/completions` with `logprobs` gave "tokens": [",", " there", " was"] but
"top_logprobs": [{",": ..}, {"there": ..}, ...] - a lone `decode([id])` of the SentencePiece
tokenizer drops the leading space, so "▁he" and "he" fell on one key and the chosen token " "
listed itself as "". The packaged stories260K's real tokenizer; the events are the ring's (text
from the real ContinuationDetokenizer, "top_logprobs" as [[id, logprob]]).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kafila_ctl.demo import packaged_model_dir
from kafilad.control.api_common import TokenText
from kafilad.control.openai_api import _chat_logprobs, _completion_logprobs
from kafilad.executor.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(packaged_model_dir())


def events_of(tok, prompt: str, generated: list[int], alternatives: list[list[int]]) -> list[dict]:
    """The ring's token events for `generated` after `prompt`; alternative k has logprob -1 - k."""
    detok = tok.continuation_detokenizer(tok.encode(prompt))
    out = []
    for token, alts in zip(generated, alternatives):
        detok.add_token(token)
        top = [[token, -0.5]] + [[a, -1.0 - k] for k, a in enumerate(alts)]
        out.append({"t": "token", "token_id": token, "text": detok.last_segment, "logprob": -0.5, "top_logprobs": top})
    return out


def test_completion_alternatives_keep_their_leading_space(tok):
    he, bare_he, there = tok.convert_tokens_to_ids(["▁he", "he", "▁there"])
    comma, was = tok.convert_tokens_to_ids([",", "▁was"])
    events = events_of(tok, "Once upon a time", [comma, there, was], [[he, bare_he], [he, bare_he], [comma]])
    lp = _completion_logprobs(events, TokenText(SimpleNamespace(chat_tokenizer=lambda: tok)))
    assert lp["tokens"] == [",", " there", " was"]
    assert lp["top_logprobs"] == [{",": -0.5, " he": -1.0, "he": -2.0},
                                  {" there": -0.5, " he": -1.0, "he": -2.0},
                                  {" was": -0.5, ",": -1.0}]
    assert all(t in top for t, top in zip(lp["tokens"], lp["top_logprobs"]))


def test_chat_alternatives_decode_as_the_chosen_token(tok):
    space, he, once = tok.convert_tokens_to_ids(["▁", "▁he", "▁Once"])
    events = events_of(tok, "Hello", [space, once, he], [[he], [space], [once]])
    content = _chat_logprobs(events, TokenText(SimpleNamespace(chat_tokenizer=lambda: tok)))["content"]
    assert [c["token"] for c in content] == [" ", " Once", " he"]
    for c in content:
        chosen = c["top_logprobs"][0]
        assert (chosen["token"], chosen["bytes"]) == (c["token"], c["bytes"]) == (c["token"], list(c["token"].encode()))
    assert [[(a["token"], a["bytes"]) for a in c["top_logprobs"][1:]] for c in content] == [
        [(" he", [32, 104, 101])], [(" ", [32])], [(" Once", [32, 79, 110, 99, 101])]]


def test_a_sampled_token_outside_the_top_alternatives_is_listed_too(tok):
    """A trial (2026-12-02): at temperature 1.8 the sampled ' n' (-4.166) was missing from its own
    top_logprobs {' b', ' f'}; OpenAI's completions list it too (up to logprobs + 1 entries)."""
    n, b, f = tok.convert_tokens_to_ids(["▁n", "▁b", "▁f"])
    detok = tok.continuation_detokenizer(tok.encode("Once upon a time"))
    detok.add_token(n)
    events = [{"t": "token", "token_id": n, "text": detok.last_segment, "logprob": -4.166,
               "top_logprobs": [[b, -2.174], [f, -2.538]]}]
    lp = _completion_logprobs(events, TokenText(SimpleNamespace(chat_tokenizer=lambda: tok)))
    assert lp["tokens"] == [" n"] and lp["top_logprobs"] == [{" b": -2.174, " f": -2.538, " n": -4.166}]
