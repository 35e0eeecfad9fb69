"""Speculative decoding through three real daemons (issue 24 item 1): the head drafts by prompt
lookup and the ring's stages trim what it rejects; greedy output is token-identical with
speculation off (`kafila-ctl speculate off`) and on, the head's status counts accepted drafts, and
a generation's trace record carries its drafted and accepted counts."""

from __future__ import annotations

import pytest

from kafila_testing import STORIES_PROMPT, reference_tokens

pytestmark = pytest.mark.slow


def test_three_daemons_speculate_with_the_same_greedy_tokens(stories260k, cluster3):
    c = cluster3
    c.form(str(stories260k))
    assert c.call(0, "status")["speculation"]["on"] is True  # on by default
    first = c.generate(STORIES_PROMPT, 64)
    prompt = f"{STORIES_PROMPT}{first['text']}\n{STORIES_PROMPT}"  # the story again: lookup drafts well
    off_status = c.call(0, "speculate", mode="off")
    assert off_status["on"] is False and "KAFILA_SPECULATE=0" in off_status["why"]
    off = c.generate(prompt, 48)
    assert c.call(0, "speculate")["passes"] == off_status["passes"]  # nothing drafted while off
    on_status = c.call(0, "speculate", mode="k=4")
    on = c.generate(prompt, 48)
    after = c.call(0, "status")["speculation"]
    assert on["token_ids"] == off["token_ids"] and on["text"] == off["text"]
    assert len(on["token_ids"]) == 48
    assert after["accepted"] > on_status["accepted"] and after["passes"] > on_status["passes"]
    assert on["accepted"] == after["accepted"] - on_status["accepted"] and on["drafted"] > 0
    assert on["decode_tokens"] == 47  # the decode rate counts tokens, not passes
    ids = reference_tokens(stories260k, prompt, 48)
    assert on["token_ids"] == ids[:48]  # and both are single-process mlx-lm's
    records = [r for r in c.call(0, "trace") if r.get("event") == "generation"]
    assert records[-1]["accepted"] == on["accepted"]
    with pytest.raises(Exception, match="speculation mode"):
        c.call(0, "speculate", mode="fast")
