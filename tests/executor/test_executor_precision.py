"""Stages in the dtype the plan gave them, and rings that mix dtypes (issue 12 item 4).

A member told bfloat16 builds a bf16 stage from the fetched bytes (as kafilad/node/session/member.py
does), holding exactly the bytes the planner counted for it (ModelInfo.profiles); a ring whose
stages hold different dtypes produces tokens, each stage casting what arrives to its own dtype;
an all-bf16 ring of a bf16 checkpoint is token-identical to single-process mlx-lm, as the all-f32
ring is (tests/executor/test_executor_ring.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from kafilad.executor.runner import StageRunner, array_from_wire, array_to_wire, generate_local
from kafilad.executor.stage import build_stage, load_stage_from_dir, read_tensor_bytes, tensor_from_bytes
from kafilad.executor.synth import synthesize_model
from kafilad.modelinfo import read_model_info
from tests.conftest import STORIES_PROMPT_IDS, STORIES_REFERENCE_IDS


def member_stage(model_dir, start, end, head, dtype):
    """A stage built as a member builds it: each tensor's raw bytes, cast on arrival, then build_stage."""
    info = read_model_info(model_dir)
    arrays = {t.name: tensor_from_bytes(t, read_tensor_bytes(info.model_dir, t), dtype=dtype)
              for t in info.stage_tensors(start, end, head)}
    return build_stage(info.config, start, end, head, arrays)


@pytest.mark.parametrize("head", [False, True])
def test_a_member_told_bfloat16_builds_a_bf16_stage_of_the_planned_bytes(stories260k, head):
    start = 0 if head else 1  # the head holds the first blocks
    stage = member_stage(stories260k, start, 4, head, "bfloat16")
    assert stage.dtype == mx.bfloat16 and stage.dtype_name == "bfloat16"
    floats = [v.dtype for _, v in tree_flatten(stage.model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    assert floats and set(floats) == {mx.bfloat16}
    prof = read_model_info(stories260k).profiles(["bfloat16"])["bfloat16"]
    assert stage.nbytes() == sum(prof.block_bytes[start:4]) + (prof.head_resident_bytes if head else 0)
    f32 = member_stage(stories260k, start, 4, head, "float32")
    assert f32.dtype == mx.float32 and f32.nbytes() == 2 * stage.nbytes()


def test_a_stage_casts_incoming_activations_to_its_dtype(stories260k):
    bf16 = StageRunner(load_stage_from_dir(stories260k, 2, 4, False, dtype="bfloat16"))
    f32_in = mx.random.normal((1, 3, 64)).astype(mx.float32)
    out = bf16.run("r", array_from_wire(array_to_wire(f32_in)))
    assert out.dtype == mx.bfloat16 and array_to_wire(out)["dtype"] == "bfloat16"
    assert bf16._caches["r"][0].keys.dtype == mx.bfloat16  # its KV cache is bf16 too
    # the same input already in bf16 gives the same output: the cast is the stage's first step
    again = StageRunner(load_stage_from_dir(stories260k, 2, 4, False, dtype="bfloat16"))
    assert mx.array_equal(again.run("r", f32_in.astype(mx.bfloat16)), out).item()
    head = load_stage_from_dir(stories260k, 0, 2, True)  # an f32 head samples from f32 logits of bf16 input
    assert head.logits(out).dtype == mx.float32
    assert load_stage_from_dir(stories260k, 0, 2, True, dtype="bfloat16").logits(f32_in).dtype == mx.bfloat16


@pytest.mark.parametrize("dtypes", [("float32", "bfloat16", "float32"), ("bfloat16", "float32", "bfloat16"),
                                    ("float16", "bfloat16", "float32")])
def test_a_ring_with_mixed_dtypes_produces_tokens(stories260k, dtypes):
    bounds = [(0, 2), (2, 4), (4, 5)]
    runners = [StageRunner(load_stage_from_dir(stories260k, a, b, i == 0, dtype=dt))
               for i, ((a, b), dt) in enumerate(zip(bounds, dtypes))]
    n = len(STORIES_REFERENCE_IDS)
    got = generate_local(runners, STORIES_PROMPT_IDS, n)
    assert len(got) == n and all(0 <= t < 512 for t in got)
    # over the wire (each hop in its sender's dtype) exactly as handed over in memory
    assert generate_local(runners, STORIES_PROMPT_IDS, n, wire=False) == got
    # a story, not noise: the reduced-precision ring follows the f32 reference for its first tokens
    assert got[:4] == STORIES_REFERENCE_IDS[:4]
    assert all(r.active_requests == [] for r in runners)


def test_a_mixed_ring_decodes_in_batches(stories260k):
    runners = [StageRunner(load_stage_from_dir(stories260k, a, b, i == 0, dtype=dt))
               for i, ((a, b), dt) in enumerate(zip([(0, 2), (2, 5)], ["float32", "bfloat16"]))]
    head, tail = runners
    hop = lambda a: array_from_wire(array_to_wire(a))  # noqa: E731
    toks = []
    for rid in ("x", "y"):  # each request prefilled alone, then decoded in one batch
        h = tail.run(rid, hop(head.head_embed_and_run(rid, STORIES_PROMPT_IDS)))
        toks.append(head.head_sample(rid, hop(h), 0.0))
    h = tail.run_batch(["x", "y"], hop(head.head_embed_and_run_batch(["x", "y"], toks)))
    assert h.dtype == mx.bfloat16 and h.shape[0] == 2
    nxt = head.head_sample_batch(["x", "y"], hop(h), 0.0)
    assert nxt[0] == nxt[1]  # the same prompt: the same next token in both rows
    singles = generate_local(runners, STORIES_PROMPT_IDS, 2, request_id="z")
    assert [toks[0], nxt[0]] == singles


def test_an_all_bf16_ring_of_a_bf16_checkpoint_matches_mlx_lm(tmp_path):
    model_dir = synthesize_model(tmp_path, arch="qwen3", seed=7, dtype="bfloat16")
    assert read_model_info(model_dir).float_dtype == "bfloat16"
    runners = [StageRunner(load_stage_from_dir(model_dir, a, b, i == 0, dtype="bfloat16"))
               for i, (a, b) in enumerate([(0, 2), (2, 5), (5, 6)])]
    assert all(r.stage.dtype == mx.bfloat16 for r in runners)
    prompt = [256] + list(b"Once upon a time there was")
    got = generate_local(runners, prompt, 16)
    model, _ = mlx_lm.load(str(model_dir))
    ref = [int(y) for (y, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=16), range(16))]
    assert got == ref and len(set(got)) > 2
