"""A request that goes on after the tokens it already generated (kafilad/node/serving/ring.py
`generate(continue_ids=...)`, proto_spec 05 §2 `gen` "cont"; issue 25 item 4): the head prefills
the prompt and those tokens in one pass and generates the rest, its text going on after theirs.
Real stages on an in-process ring (tests/node/test_ring_batch.py's harness)."""

from __future__ import annotations

import pytest
from trio.testing import trio_test

from kafilad.errors import GenerationError
from node.test_ring_batch import BOUNDS, _ignore, ring_of, synth_model  # noqa: F401 - fixture

PROMPT = "Once upon a time"


@trio_test
async def test_a_greedy_request_continued_after_k_tokens_gives_the_rest_of_the_whole_run(synth_model):
    async with ring_of(synth_model, BOUNDS) as ring:
        head = ring[0]
        whole = await head.generate("w", PROMPT, max_tokens=16, temperature=0.0, on_event=_ignore)
        k = 6
        events: list = []

        async def keep(ev):
            events.append(ev)
        rest = await head.generate("c", PROMPT, max_tokens=16 - k, temperature=0.0, on_event=keep,
                                   continue_ids=list(whole.generated[:k]))
        assert list(rest.generated) == list(whole.generated[k:])  # the prefill pass lands where decoding did
        assert len(rest.prompt_ids) == len(whole.prompt_ids) + k
        detok = head.tokenizer.continuation_detokenizer(whole.prompt_ids)
        for t in whole.generated[:k]:
            detok.add_token(t)
        assert detok.text + rest.text == whole.text  # the text goes on where the first k tokens' ended
        assert "".join(ev["text"] for ev in events) == rest.text


@pytest.mark.parametrize("bad", [[-1], [10 ** 9], [True], ["7"]])
@trio_test
async def test_a_continuation_outside_the_vocabulary_fails_only_that_request(synth_model, bad):
    async with ring_of(synth_model, BOUNDS) as ring:
        head = ring[0]
        with pytest.raises(GenerationError, match="vocabulary"):
            await head.generate("bad", PROMPT, max_tokens=4, temperature=0.0, on_event=_ignore, continue_ids=bad)
        ok = await head.generate("ok", PROMPT, max_tokens=4, temperature=0.0, on_event=_ignore)
        assert len(ok.generated) == 4 and not head.broken
