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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kafilad.errors import RemoteProtocolError
from kafilad.executor import archs
from kafilad.executor.runner import StageRunner, array_from_wire, array_to_wire, generate_local, prefill_chunks
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


def hop(a):
    return array_from_wire(array_to_wire(a))


def _batched_speculation(runners, prompts: dict, n: int, k_max: int, wrong_at) -> tuple[dict, dict]:
    """Decode `prompts` together in batched speculative passes, as the ring does (proto_spec 05
    §3.1): every row carries the same k drafts, the head verifies them all (`head_verify_batch`,
    which trims its own rows) and the other stages trim each row before the next pass
    (`trim_rows`). The drafts are each row's plain greedy continuation with the draft at
    `wrong_at(pass, row)` changed, so rows accept different counts. Returns (tokens per row,
    counts of passes and accepted drafts)."""
    head, rest = runners[0], runners[1:]
    ref = {r: generate_local(runners, p, n + k_max, request_id="ref-" + r) for r, p in prompts.items()}
    out: dict = {}
    for r, p in prompts.items():
        h = None
        for chunk in prefill_chunks(p):
            h = head.head_embed_and_run(r, chunk)
            for s in rest:
                h = s.run(r, hop(h))
        out[r] = [head.head_sample(r, hop(h))]
    due = {r: 0 for r in prompts}
    counts = {"passes": 0, "accepted": 0}
    while True:
        rows = [r for r in prompts if len(out[r]) < n]
        if not rows:
            return out, counts
        k = min([k_max] + [n - len(out[r]) - 1 for r in rows])
        drafts = []
        for i, r in enumerate(rows):
            d = list(ref[r][len(out[r]):len(out[r]) + k])
            j = wrong_at(counts["passes"], i)
            if j < k:
                d[j] = (d[j] + 1) % head.stage.config["vocab_size"]
            drafts.append(d)
        for s in runners:
            for r in list(s.batch_ids):
                if r not in rows:
                    s.drop(r)
        h = head.head_embed_and_run_batch(rows, [[out[r][-1]] + d for r, d in zip(rows, drafts)])
        for s in rest:
            s.trim_rows(rows, [due[r] for r in rows])
            h = s.run_batch(rows, hop(h))
        got = head.head_verify_batch(rows, hop(h), drafts, [0.0] * len(rows))
        for r, toks in zip(rows, got):
            out[r] += toks
            due[r] = k + 1 - len(toks)
            counts["accepted"] += len(toks) - 1
        counts["passes"] += 1


@pytest.fixture(scope="module", params=["stories260k", "synth-llama"])
def spec_model(request, tmp_path_factory):
    """stories260K and its twin synthesised by the project."""
    if request.param == "stories260k":
        return request.getfixturevalue("stories260k")
    from kafilad.executor.synth import synthesize_model
    return synthesize_model(tmp_path_factory.mktemp("spec-synth"), arch="llama", seed=5)


def test_batched_speculative_passes_give_each_rows_plain_greedy_tokens(spec_model):
    """Rows of unequal lengths accept unequal numbers of drafts in the same passes; every row's
    tokens are its plain greedy ones, and the rows stay in their batch caches while trimmed."""
    runners = ring_runners(spec_model, BOUNDS)
    vocab = runners[0].stage.config["vocab_size"]
    prompts = {r: [t % vocab for t in p] for r, p in
               {"a": STORIES_PROMPT_IDS, "b": [1, 403, 407], "c": STORIES_PROMPT_IDS + [432, 383, 286, 9]}.items()}
    n = 24
    got, counts = _batched_speculation(runners, prompts, n, 4, lambda p, i: (p + 2 * i) % 6)
    for r, p in prompts.items():
        assert got[r][:n] == generate_local(runners, p, n, request_id="alone-" + r), r
    assert counts["accepted"] > counts["passes"]  # more than one draft a pass was taken
    assert counts["passes"] < n - 1


def test_trim_rows_keeps_rows_in_their_batch(spec_model):
    runners = ring_runners(spec_model, BOUNDS)
    head, stage = runners[0], runners[1]
    for rid, n in (("a", 9), ("b", 6), ("c", 4)):
        stage.run(rid, head.head_embed_and_run(rid, list(range(1, n + 1))))
    stage.run_batch(["a", "b", "c"], head.head_embed_and_run_batch(["a", "b", "c"], [[5, 6, 7]] * 3))
    stage.trim_rows(["a", "b", "c"], [3, 1, 2])
    assert stage.batch_ids == ["a", "b", "c"]  # trimmed in place, not taken out
    stage.trim_rows(["a", "b", "c"], [0, 0, 0])
    with pytest.raises(RemoteProtocolError, match="cannot take"):
        stage.trim_rows(["a", "b", "c"], [1, 9, 0])
    with pytest.raises(RemoteProtocolError, match="trim"):
        stage.trim_rows(["a", "b", "c"], [1, -1, 0])
    with pytest.raises(RemoteProtocolError, match="3 rows carried 2 trims"):
        stage.trim_rows(["a", "b", "c"], [1, 1])
    with pytest.raises(RemoteProtocolError, match="must be equal"):
        head.head_embed_and_run_batch(["a", "b"], [[1, 2], [3]])
    assert [stage.cache_length(r) for r in ("a", "b", "c")] == [9 + 3 - 3, 6 + 3 - 1, 4 + 3 - 2]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_pattern_of_accepted_drafts_keeps_every_rows_tokens(spec_model, data):
    """Hypothesis: rows of random prompts, a random k and a random draft wrong in each row of each
    pass (or none); every row's tokens are still its plain greedy ones."""
    runners = ring_runners(spec_model, BOUNDS)
    vocab = runners[0].stage.config["vocab_size"]
    rows = data.draw(st.integers(2, 4), label="rows")
    prompts = {f"r{i}": data.draw(st.lists(st.integers(1, vocab - 1), min_size=1, max_size=12), label=f"prompt {i}")
               for i in range(rows)}
    k_max = data.draw(st.integers(1, 6), label="k")
    wrong = data.draw(st.lists(st.integers(0, 7), min_size=64, max_size=64), label="wrong draft per pass and row")
    n = 12
    got, _ = _batched_speculation(runners, prompts, n, k_max, lambda p, i: wrong[(p * rows + i) % 64])
    for r, p in prompts.items():
        assert got[r][:n] == generate_local(runners, p, n, request_id="alone-" + r), r


def test_alternating_acceptance_keeps_batch_padding_bounded(spec_model):
    """Two rows take turns accepting none and all of their drafts: every pass trims them unequally,
    yet after every trim the batch caches hold no column that every row pads (mlx-lm's `filter`
    drops them), so a row's padding stays within the rows' length difference."""
    runners = ring_runners(spec_model, BOUNDS)
    vocab = runners[0].stage.config["vocab_size"]
    prompts = {"a": [t % vocab for t in STORIES_PROMPT_IDS], "b": [t % vocab for t in STORIES_PROMPT_IDS[:4]]}
    seen = []
    stage = runners[1]
    real = stage.trim_rows

    def trim_rows(ids, n_tokens, group=0):
        real(ids, n_tokens, group)
        if any(n_tokens):
            c = stage._groups[group][1][0]
            seen.append((min(c.left_padding.tolist()), c.size(), max(c.offset.tolist())))
    stage.trim_rows = trim_rows
    n = 60
    got, counts = _batched_speculation(runners, prompts, n, 4, lambda p, i: 0 if i == p % 2 else 99)
    for r, p in prompts.items():
        assert got[r][:n] == generate_local(runners, p, n, request_id="alone-" + r), r
    assert len(seen) > 10
    assert all(pad == 0 and size == longest for pad, size, longest in seen), seen
