"""The head's fused sample-and-run (kafilad/executor/runner.py `head_sample_and_run`, issue 12).

Sampling a token and running the next step's head blocks in one MLX graph gives the token and the
bits of the two separate calls; `trim_last` takes the step back so that the cache decodes on as
if it had never run; a ring of 3 stages driven by the fused call matches single-process mlx-lm.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kafilad.executor.runner import StageRunner, array_from_wire, array_to_wire, prefill_chunks
from kafilad.executor.stage import load_stage_from_dir
from tests.conftest import STORIES_PROMPT_IDS, STORIES_REFERENCE_IDS
from tests.executor.test_executor_ring import mlx_lm_greedy, ring_runners


def _prefilled(model_dir, prompt_ids):
    head = StageRunner(load_stage_from_dir(model_dir, 0, 2, head=True))
    h = None
    for chunk in prefill_chunks(prompt_ids):
        h = head.head_embed_and_run("r", chunk)
    return head, h


def test_fused_call_equals_sample_then_embed(stories260k):
    fused, h1 = _prefilled(stories260k, STORIES_PROMPT_IDS)
    plain, h2 = _prefilled(stories260k, STORIES_PROMPT_IDS)
    for _ in range(6):
        token, out = fused.head_sample_and_run("r", h1, 0.0)
        ref_token = plain.head_sample("r", h2, 0.0)
        ref_out = plain.head_embed_and_run("r", [ref_token])
        assert token == ref_token
        assert np.array_equal(np.array(out), np.array(ref_out))  # bit for bit
        assert fused.cache_length("r") == plain.cache_length("r")
        h1, h2 = out, ref_out


def test_trim_last_takes_the_step_back(stories260k):
    spec, h1 = _prefilled(stories260k, STORIES_PROMPT_IDS)
    plain, h2 = _prefilled(stories260k, STORIES_PROMPT_IDS)
    n0 = spec.cache_length("r")
    token, out = spec.head_sample_and_run("r", h1, 0.0)
    assert spec.cache_length("r") == n0 + 1
    spec.trim_last("r")
    assert spec.cache_length("r") == n0
    again = spec.head_embed_and_run("r", [token])  # the step, sent after all (e.g. in another form)
    ref = plain.head_embed_and_run("r", [plain.head_sample("r", h2, 0.0)])
    assert np.array_equal(np.array(again), np.array(ref)) and np.array_equal(np.array(out), np.array(ref))
    spec.trim_last("unknown")  # nothing to take back: no error


def test_ring_driven_by_the_fused_call_matches_mlx_lm(stories260k):
    runners = ring_runners(stories260k, [(0, 2), (2, 4), (4, 5)])
    head, hop = runners[0], (lambda a: array_from_wire(array_to_wire(a)))

    def rest(h):
        for r in runners[1:]:
            h = r.run("r", hop(h))
        return hop(h)

    h = None
    for chunk in prefill_chunks(STORIES_PROMPT_IDS):
        h = rest(head.head_embed_and_run("r", chunk))
    toks = []
    for _ in range(len(STORIES_REFERENCE_IDS)):
        token, out = head.head_sample_and_run("r", h, 0.0)
        toks.append(token)
        h = rest(out)
    assert toks == STORIES_REFERENCE_IDS
    assert toks == mlx_lm_greedy(stories260k, STORIES_PROMPT_IDS, len(toks))[0]


def test_batched_fused_call_equals_sample_then_embed(stories260k):
    prompts = {"a": STORIES_PROMPT_IDS, "b": STORIES_PROMPT_IDS[:5], "c": STORIES_PROMPT_IDS[2:9]}
    runners = [StageRunner(load_stage_from_dir(stories260k, 0, 2, head=True)) for _ in range(2)]
    hs = []
    for r in runners:
        rows = []
        for rid, ids in prompts.items():
            for chunk in prefill_chunks(ids):
                h = r.head_embed_and_run(rid, chunk)
            rows.append(h)
        hs.append(mx.concatenate(rows, axis=0))
    fused, plain = runners
    rids = list(prompts)
    h1, h2 = hs
    for _ in range(5):
        tokens, out = fused.head_sample_batch_and_run(rids, h1, 1)
        ref_tokens = plain.head_sample_batch(rids, h2, 0.0)
        ref_out = plain.head_embed_and_run_batch(rids, ref_tokens, 1)
        assert tokens == ref_tokens and np.array_equal(np.array(out), np.array(ref_out))
        h1, h2 = out, ref_out
    fused.trim_last_group(1)  # the last step taken back: it runs again to the same bits
    again = fused.head_embed_and_run_batch(rids, tokens, 1)
    assert np.array_equal(np.array(again), np.array(out))
    fused.trim_last_group(7)  # a group with no caches: nothing to take back
