"""Speculative passes through a chain of stages (issue 24 item 1; kafilad/executor/runner.py
`head_verify`, `trim`; proto_spec 05 §3.1).

Greedy speculation over prompt-lookup drafts gives the ring's plain greedy tokens (and mlx-lm's)
while taking drafts; the other stages' caches end each pass at the head's length; a model whose
caches cannot be trimmed (Qwen3-Next's linear-attention ArraysCache) is refused by name; sampling
by the rejection rule keeps the model's distribution.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from kafilad.errors import RemoteProtocolError
from kafilad.executor import archs
from kafilad.executor.runner import StageRunner, generate_local, prefill_chunks
from kafilad.executor.stage import load_stage_from_dir
from tests.conftest import STORIES_PROMPT_IDS, STORIES_REFERENCE_IDS
from tests.executor.test_executor_ring import mlx_lm_greedy, ring_runners

BOUNDS = [(0, 2), (2, 4), (4, 5)]
#: a passage the model is asked to continue after seeing it once: lookup drafts well on it
REPEAT = STORIES_PROMPT_IDS + STORIES_REFERENCE_IDS[:20] + STORIES_PROMPT_IDS


@pytest.mark.parametrize("prompt", [STORIES_PROMPT_IDS, REPEAT])
def test_speculative_ring_gives_plain_greedy_tokens(stories260k, prompt):
    n = 40
    plain = generate_local(ring_runners(stories260k, BOUNDS), prompt, n)
    counts: dict = {}
    spec = generate_local(ring_runners(stories260k, BOUNDS), prompt, n, draft_k=4, counts=counts)
    assert spec == plain == mlx_lm_greedy(stories260k, prompt, n)[0]
    if prompt is REPEAT:
        assert counts["accepted"] > 0  # drafts were taken, not only sent
        assert counts["passes"] < n - 1  # fewer passes than tokens after the first


def test_stages_trim_to_the_heads_length(stories260k):
    runners = ring_runners(stories260k, BOUNDS)
    head = runners[0]
    h = None
    for chunk in prefill_chunks(REPEAT):
        h = head.head_embed_and_run("r", chunk)
        for r in runners[1:]:
            h = r.run("r", h)
    tok = head.head_sample("r", h)
    drafts = [STORIES_REFERENCE_IDS[0] + 1, 7, 9]  # surely rejected from the first
    h = head.head_embed_and_run("r", [tok] + drafts)
    for r in runners[1:]:
        h = r.run("r", h)
    out = head.head_verify("r", h, drafts)
    assert out == [mlx_lm_greedy(stories260k, REPEAT, 2)[0][1]]
    assert head.cache_length("r") == len(REPEAT) + 1  # the prompt and the sampled token
    assert [r.cache_length("r") for r in runners[1:]] == [len(REPEAT) + 4] * 2
    for r in runners[1:]:
        r.trim("r", 3)
    assert [r.cache_length("r") for r in runners] == [len(REPEAT) + 1] * 3
    with pytest.raises(RemoteProtocolError):
        runners[1].trim("r", 10_000)
    with pytest.raises(RemoteProtocolError):
        runners[1].trim("unknown", 1)
    with pytest.raises(RemoteProtocolError):
        head.head_verify("r", h[:, :2], drafts)


def test_a_batched_request_trims_out_of_its_batch(stories260k):
    runners = ring_runners(stories260k, BOUNDS)
    stage = runners[1]
    for rid in ("a", "b"):
        stage.run(rid, runners[0].head_embed_and_run(rid, STORIES_PROMPT_IDS))
    stage.run_batch(["a", "b"], runners[0].head_embed_and_run_batch(["a", "b"], [5, 6]))
    assert stage.batch_ids == ["a", "b"]
    stage.trim("a", 1)
    assert stage.cache_length("a") == len(STORIES_PROMPT_IDS)
    assert stage.cache_length("b") == len(STORIES_PROMPT_IDS) + 1


def test_llama_stage_speculates_and_linear_attention_is_refused(stories260k, tmp_path):
    assert load_stage_from_dir(stories260k, 0, 2, head=True).speculation_refusal is None
    model = archs.synthesize_arch(tmp_path / "qn", "qwen3_next", "float32", seed=archs.seed_for("qwen3_next"))
    refusal = load_stage_from_dir(model, 0, 2, head=True, dtype=None).speculation_refusal
    assert refusal is not None and "ArraysCache" in refusal


def test_sampled_acceptance_keeps_the_models_distribution(stories260k):
    """At temperature 1, the first token of a speculative pass follows the model's own distribution:
    the empirical frequency of each token over many passes (fresh seeds) matches p within 4 sigma."""
    head = StageRunner(load_stage_from_dir(stories260k, 0, 5, head=True))
    h = None
    for chunk in prefill_chunks(STORIES_PROMPT_IDS):
        h = head.head_embed_and_run("r", chunk)
    tok = int(mx.argmax(head.stage.logits(h), axis=-1).item())
    base = head.cache_length("r")
    h2 = head.head_embed_and_run("r", [tok])
    p = mx.softmax(head.stage.logits(h2)[0], axis=-1)
    head.trim("r", 1)
    draft = int(mx.argmax(p).item())  # the likeliest token: accepted often, rejected sometimes
    counts: dict = {}
    n = 400
    for i in range(n):
        mx.random.seed(i)
        hv = head.head_embed_and_run("r", [tok, draft])
        first = head.head_verify("r", hv, [draft], temperature=1.0)[0]
        counts[first] = counts.get(first, 0) + 1
        head.trim("r", head.cache_length("r") - base)
    for t in sorted(counts, key=counts.get, reverse=True)[:3]:
        q = float(p[t].item())
        assert abs(counts[t] / n - q) < 4 * (q * (1 - q) / n) ** 0.5 + 1e-3, (t, counts[t] / n, q)
    assert len(counts) > 1
