"""The head's sampler with a request's Sampling (kafilad/proto/sampling.py; runner `head_sample_rows`).

Oracle: single-process mlx-lm `generate_step` with `make_sampler` / `make_logits_processors` and
`mx.random.seed(seed)`. A 3-stage ring of the packaged stories260K with the same parameters and
seed draws the same tokens; logprobs are the ones generate_step yields; rows of one batch keep
their own parameters.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from kafila_ctl.demo import packaged_model_dir
from kafilad.executor.runner import StageRunner, generate_local
from kafilad.executor.stage import load_stage_from_dir
from kafilad.proto.sampling import Sampling

PROMPT_IDS = [1, 403, 407, 261, 378]  # "Once upon a time" (tests/kafila_testing.py)


@pytest.fixture(scope="module")
def model_dir():
    return packaged_model_dir()


@pytest.fixture(scope="module")
def mlx_model(model_dir):
    return mlx_lm.load(str(model_dir))[0]


def ring(model_dir):
    return [StageRunner(load_stage_from_dir(model_dir, a, b, head=(i == 0)))
            for i, (a, b) in enumerate([(0, 2), (2, 4), (4, 5)])]


def mlx_lm_tokens(model, n, *, seed, sampler, processors=None):
    mx.random.seed(seed)
    out = []
    for (y, _), _ in zip(generate_step(mx.array(PROMPT_IDS), model, max_tokens=n, sampler=sampler,
                                       logits_processors=processors), range(n)):
        out.append(int(y))
    return out


@pytest.mark.parametrize("params", [
    dict(temperature=0.9, seed=3),
    dict(temperature=0.8, top_p=0.9, seed=11),
    dict(temperature=1.2, top_k=20, min_p=0.05, seed=2**40 + 5),
])
def test_seeded_sampling_matches_mlx_lm(model_dir, mlx_model, params):
    s = Sampling(**params)
    got = generate_local(ring(model_dir), PROMPT_IDS, 24, sampling=s)
    want = mlx_lm_tokens(mlx_model, 24, seed=s.seed,
                         sampler=make_sampler(s.temperature, top_p=s.top_p if s.top_p < 1 else 0.0,
                                              min_p=s.min_p, top_k=s.top_k))
    assert got == want
    assert got == generate_local(ring(model_dir), PROMPT_IDS, 24, sampling=s)  # same seed, same tokens
    other = generate_local(ring(model_dir), PROMPT_IDS, 24, sampling=Sampling(**{**params, "seed": s.seed + 1}))
    assert other != got


def test_penalties_and_logit_bias_match_mlx_lm(model_dir, mlx_model):
    s = Sampling(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5, logit_bias=((286, -100.0), (432, 5.0)))
    got = generate_local(ring(model_dir), PROMPT_IDS, 24, sampling=s)
    procs = make_logits_processors({286: -100.0, 432: 5.0}, None, 20, 1.5, 20, 0.5, 20)
    want = mlx_lm_tokens(mlx_model, 24, seed=0, sampler=None, processors=procs)
    assert got == want
    assert 286 not in got and got != generate_local(ring(model_dir), PROMPT_IDS, 24)
    rep = Sampling(repetition_penalty=1.3, penalty_context_tokens=8)
    assert generate_local(ring(model_dir), PROMPT_IDS, 24, sampling=rep) == mlx_lm_tokens(
        mlx_model, 24, seed=0, sampler=None, processors=make_logits_processors(None, 1.3, 8))


def test_plain_sampling_is_the_greedy_path(model_dir):
    assert Sampling().plain and Sampling(temperature=0.7).plain
    assert not Sampling(seed=1).plain and not Sampling(logprobs=0).plain and not Sampling(top_p=0.5).plain
    greedy = generate_local(ring(model_dir), PROMPT_IDS, 16)
    assert generate_local(ring(model_dir), PROMPT_IDS, 16, sampling=Sampling(logprobs=3)) == greedy
    assert generate_local(ring(model_dir), PROMPT_IDS, 16, sampling=Sampling(temperature=0.9, top_p=0.0,
                                                                            seed=1)) == greedy


def test_logprobs_are_generate_steps(model_dir, mlx_model):
    runners = ring(model_dir)
    head = runners[0]
    h = head.head_embed_and_run("r", PROMPT_IDS)
    for r in runners[1:]:
        h = r.run("r", h)
    [(tok, (lp, best))] = head.head_sample_rows(["r"], h, [Sampling(logprobs=5)], [PROMPT_IDS])
    y, ref = next(generate_step(mx.array(PROMPT_IDS), mlx_model, max_tokens=1))
    assert tok == int(y) == best[0][0]
    assert lp == pytest.approx(float(ref[tok]), abs=1e-6) == pytest.approx(best[0][1], abs=0)
    assert len(best) == 5 and [p[1] for p in best] == sorted((p[1] for p in best), reverse=True)
    top5 = sorted(ref.tolist(), reverse=True)[:5]
    assert [p[1] for p in best] == pytest.approx(top5, abs=1e-6)
    for r in runners:
        r.drop("r")
    assert head._keys == {} and head._processors == {}


def test_batch_rows_keep_their_own_parameters(model_dir):
    runners = ring(model_dir)
    head = runners[0]
    for rid in ("a", "b", "c"):
        h = head.head_embed_and_run(rid, PROMPT_IDS)
        for r in runners[1:]:
            h = r.run(rid, h)
        head.head_sample(rid, h)  # prefill done; the batch below samples the next rows
    toks = [403, 403, 403]
    h = head.head_embed_and_run_batch(["a", "b", "c"], toks)
    for r in runners[1:]:
        h = r.run_batch(["a", "b", "c"], h)
    hist = [PROMPT_IDS + [t] for t in toks]
    rows = head.head_sample_rows(["a", "b", "c"], h, [None, Sampling(logit_bias=((7, 100.0),)), Sampling(logprobs=1)],
                                 hist)
    greedy = head.head_sample_batch(["a", "b", "c"], h, 0.0)
    assert rows[0] == (greedy[0], None) and rows[1][0] == 7 and rows[2][0] == greedy[2]
    assert rows[2][1][1][0][0] == greedy[2]
    with pytest.raises(ValueError, match="outside this model's vocabulary of 512 tokens"):
        head.head_sample_rows(["x"], h[:1], [Sampling(logit_bias=((512, 1.0),))], [[]])
