"""Sampling parameters on the ring (kafilad/node/serving/ring.py `generate(sampling=)`; kafilad/proto/sampling.py).

Real stages of the packaged stories260K on a 3-member ring of RingMembers over in-memory links.
Requests with different parameters decode in one lockstep batch, each row with its own: the
greedy row keeps its alone-tokens, a logit_bias row follows its bias, a logprobs row streams
"logprob"/"top_logprobs", two requests with the same seed draw the same tokens; a seeded request
alone draws them again; a logit_bias outside the vocabulary is a sentence, not a broken batch.
"""

from __future__ import annotations

import pytest
import trio
from trio.testing import trio_test

from kafila_ctl.demo import packaged_model_dir
from kafilad.errors import GenerationError
from kafilad.proto.sampling import Sampling
from tests.node.test_ring_batch import ring_of

BOUNDS = [(0, 2), (2, 3), (3, 5)]
PROMPT = "Once upon a time"


async def run_jobs(head, jobs):
    """jobs: {req: (max_tokens, Sampling | None)} started together; returns req -> (state, events)."""
    out = {}

    async def one(req, n, s):
        events = []

        async def ev(e):
            events.append(e)
        st = await head.generate(req, PROMPT, max_tokens=n, temperature=0.0, on_event=ev, sampling=s)
        out[req] = (st, events)
    async with trio.open_nursery() as nursery:
        for req, (n, s) in jobs.items():
            nursery.start_soon(one, req, n, s)
    return out


@trio_test
async def test_rows_of_one_batch_keep_their_parameters():
    model = packaged_model_dir()
    async with ring_of(model, BOUNDS) as ring:
        alone = (await run_jobs(ring[0], {"g": (12, None)}))["g"][0].generated
        seeded = Sampling(temperature=1.0, top_p=0.95, seed=1234)
        again = (await run_jobs(ring[0], {"s": (12, seeded)}))["s"][0].generated
        got = await run_jobs(ring[0], {
            "greedy": (12, None),
            "bias": (12, Sampling(logit_bias=((300, 100.0),))),
            "lp": (12, Sampling(logprobs=2)),
            "s1": (12, seeded),
            "s2": (12, seeded),
        })
        assert ring[0].max_batch_rows == 5
        assert got["greedy"][0].generated == alone == got["lp"][0].generated
        assert got["bias"][0].generated == [300] * 12
        assert got["s1"][0].generated == got["s2"][0].generated == again != alone
        lp_events = [e for e in got["lp"][1] if e["token_id"] is not None]
        assert len(lp_events) == 12
        for e in lp_events:
            assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 2
            assert e["top_logprobs"][0] == [e["token_id"], e["logprob"]]  # greedy: the chosen is the best
        assert all("logprob" not in e for e in got["greedy"][1])
        for m in ring:
            assert m.runner.active_requests == []
            assert m.runner._keys == {} and m.runner._processors == {}


@trio_test
async def test_a_logit_bias_outside_the_vocabulary_is_refused_before_it_starts():
    async with ring_of(packaged_model_dir(), BOUNDS) as ring:
        with pytest.raises(GenerationError, match="outside this model's vocabulary of 512 tokens"):
            await ring[0].generate("x", PROMPT, max_tokens=3, temperature=0.0, on_event=None,
                                   sampling=Sampling(logit_bias=((9999, 1.0),)))
        st = (await run_jobs(ring[0], {"ok": (3, Sampling(seed=5, temperature=0.5))}))["ok"][0]
        assert st.error is None and len(st.generated) == 3
