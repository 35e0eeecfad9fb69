"""A ring of 3 stages in one process is token-identical to single-process mlx-lm (DESIGN §6).

Stories260K (../shared/models) against its README reference ids, and twins on synthesised Llama
and Qwen3 models. Hops go through the wire encoding, as between machines.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from kafilad.executor.runner import StageRunner, array_from_wire, array_to_wire, generate_local, prefill_chunks
from kafilad.executor.stage import load_stage_from_dir
from kafilad.executor.synth import synthesize_model
from tests.conftest import STORIES_PROMPT_IDS, STORIES_REFERENCE_IDS


def mlx_lm_greedy(model_dir, prompt_ids, n, prefill_step_size=2048):
    """Tokens and log-probs of single-process mlx-lm, greedy."""
    model, _ = mlx_lm.load(str(model_dir))
    toks, lps = [], []
    for (y, lp), _ in zip(generate_step(mx.array(prompt_ids), model, max_tokens=n,
                                        prefill_step_size=prefill_step_size), range(n)):
        toks.append(int(y))
        lps.append(lp)
    return toks, lps


def ring_runners(model_dir, bounds):
    return [StageRunner(load_stage_from_dir(model_dir, a, b, head=(i == 0))) for i, (a, b) in enumerate(bounds)]


def ring_logprobs(runners, prompt_ids, n, prefill_step_size):
    """Like generate_local, but also returns each step's log-probs (for the bit-exact check)."""
    head, rid = runners[0], "r"
    hop = lambda a: array_from_wire(array_to_wire(a))  # noqa: E731

    def around(chunk):
        h = head.head_embed_and_run(rid, chunk)
        for r in runners[1:]:
            h = r.run(rid, hop(h))
        return hop(h)

    chunks = prefill_chunks(prompt_ids, prefill_step_size)
    for c in chunks[:-1]:
        around(c)
    h, toks, lps = around(chunks[-1]), [], []
    for _ in range(n):
        logits = head.stage.logits(h)
        lps.append((logits - mx.logsumexp(logits, keepdims=True)).squeeze(0))
        toks.append(head.head_sample(rid, h, 0.0))
        h = around([toks[-1]])
    return toks, lps


def test_stories_three_stages_match_reference_and_mlx_lm(stories260k):
    runners = ring_runners(stories260k, [(0, 2), (2, 4), (4, 5)])
    got = generate_local(runners, STORIES_PROMPT_IDS, len(STORIES_REFERENCE_IDS))
    assert got == STORIES_REFERENCE_IDS
    ref, _ = mlx_lm_greedy(stories260k, STORIES_PROMPT_IDS, len(STORIES_REFERENCE_IDS))
    assert got == ref
    assert all(r.active_requests == [] for r in runners)


def test_stories_ring_logprobs_bit_exact(stories260k):
    runners = ring_runners(stories260k, [(0, 1), (1, 3), (3, 5)])
    toks, lps = ring_logprobs(runners, STORIES_PROMPT_IDS, 8, 2048)
    ref_toks, ref_lps = mlx_lm_greedy(stories260k, STORIES_PROMPT_IDS, 8)
    assert toks == ref_toks
    for a, b in zip(lps, ref_lps):
        assert mx.array_equal(a, b).item()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def synth_dir(request, tmp_path_factory):
    return synthesize_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=7)


@pytest.mark.parametrize("prefill_step_size", [2048, 4])
def test_synth_three_stages_match_mlx_lm(synth_dir, prefill_step_size):
    prompt = [256] + list(b"Once upon a time there was")
    runners = ring_runners(synth_dir, [(0, 1), (1, 4), (4, 6)])
    toks, lps = ring_logprobs(runners, prompt, 24, prefill_step_size)
    ref_toks, ref_lps = mlx_lm_greedy(synth_dir, prompt, 24, prefill_step_size)
    assert toks == ref_toks
    assert len(set(toks)) > 3  # the synthetic model does not collapse to one token
    for a, b in zip(lps, ref_lps):
        assert mx.array_equal(a, b).item()


def test_generate_local_stops_at_eos(synth_dir):
    prompt = [256] + list(b"abc")
    runners = ring_runners(synth_dir, [(0, 3), (3, 6)])
    free = generate_local(runners, prompt, 10)
    eos = free[4]
    stopped = generate_local(runners, prompt, 10, eos_token_ids={eos})
    assert stopped == free[: free.index(eos) + 1]


def test_prefill_chunks_follow_generate_step():
    assert prefill_chunks([5]) == [[5]]
    assert prefill_chunks([1, 2, 3, 4, 5, 6], 2) == [[1, 2], [3, 4], [5], [6]]
    assert prefill_chunks([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    with pytest.raises(ValueError, match="at least one token"):
        prefill_chunks([])


def test_ring_driven_from_trio_worker_threads(stories260k):
    """The node calls the runner with trio.to_thread.run_sync (DESIGN §6); two requests interleave."""
    import trio

    runners = ring_runners(stories260k, [(0, 2), (2, 3), (3, 5)])
    results = {}

    async def request(rid, prompt, n):
        head = runners[0]
        out = []

        async def around(chunk):
            h = await trio.to_thread.run_sync(head.head_embed_and_run, rid, chunk)
            for r in runners[1:]:
                h = await trio.to_thread.run_sync(r.run, rid, array_from_wire(array_to_wire(h)))
            return h

        chunks = prefill_chunks(prompt)
        for c in chunks[:-1]:
            await around(c)
        h = await around(chunks[-1])
        while len(out) < n:
            out.append(await trio.to_thread.run_sync(head.head_sample, rid, h, 0.0))
            h = await around([out[-1]])
        for r in runners:
            r.drop(rid)
        results[rid] = out

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(request, "one", STORIES_PROMPT_IDS, 20)
            nursery.start_soon(request, "two", STORIES_PROMPT_IDS[:3], 20)

    trio.run(main)
    assert results["one"] == STORIES_REFERENCE_IDS[:20]
    assert results["two"] == generate_local(runners, STORIES_PROMPT_IDS[:3], 20)
