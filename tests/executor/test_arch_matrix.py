"""The architecture matrix (issue 21 item 2): every listed mlx-lm architecture, in every precision,
divided 1, 2 and 3 ways, gives single-process mlx-lm's greedy tokens.

Each case is a tiny random model written from the architecture's own ModelArgs
(kafilad/executor/archs.py), read back the way members read a model (`load_stage_from_dir`, only
its own tensors), its stages chained in this process with every hop through the wire format.
Prompts: 5 tokens (shorter than every sliding window, 8) and 40 tokens (longer than every window
and than the prefill chunk of 16 used on both sides); 32 greedy tokens each, alone and decoded
together in one batch (mlx-lm's batch caches).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from kafilad.errors import KafilaError
from kafilad.executor import archs
from kafilad.modelinfo import read_model_info, unsplittable_reason

SHORT = [(i * 37 + 11) % 500 for i in range(5)]
LONG = [(i * 53 + 7) % 500 for i in range(40)]
TOKENS = 32
CHUNK = 16
#: 3-way divisions used by every case; the 2-way boundary moves with the precision
THREE_WAY = ([(0, 1), (1, 4), (4, 6)], [(0, 3), (3, 5), (5, 6)])
TWO_WAY_AT = {"float32": 2, "bfloat16": 3, "q4": 4, "q8": 1, "mxfp4": 5}

CASES = [(a, p) for a in archs.ARCHS for p in archs.precisions_for(a)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    made = {}

    def get(arch, precision):
        if (arch, precision) not in made:
            made[arch, precision] = archs.synthesize_arch(tmp_path_factory.mktemp(f"{arch}-{precision}"), arch,
                                                          precision, seed=archs.seed_for(arch))
        return made[arch, precision]
    return get


@pytest.mark.parametrize("arch,precision", CASES, ids=[f"{a}-{p}" for a, p in CASES])
def test_divided_model_matches_mlx_lm(model_dirs, arch, precision):
    if precision == "bfloat16" and arch in archs.GATHER_MM_ARCHS and mx.default_device() == mx.cpu:
        pytest.skip("MLX's CPU backend runs gather_mm (routed experts) in float32 only; single-process mlx-lm "
                    "cannot run this case either, and Kafila's CPU members hold float32")
    d = model_dirs(arch, precision)
    refs = [archs.reference_tokens(d, p, TOKENS, prefill_step_size=CHUNK) for p in (SHORT, LONG)]
    # the model depends on its context: greedy output is not one repeated token
    assert len(set(refs[1])) >= 3, refs
    b = TWO_WAY_AT[precision]
    for bounds in ([(0, 6)], [(0, b), (b, 6)], *THREE_WAY):
        for prompt, ref in zip((SHORT, LONG), refs):
            got = archs.ring_tokens(d, bounds, prompt, TOKENS, prefill_step_size=CHUNK)
            assert got == ref, (bounds, len(prompt))
    batched = archs.ring_batch_tokens(d, THREE_WAY[0], [SHORT, LONG], TOKENS, prefill_step_size=CHUNK)
    assert batched == refs


def test_every_block_matters():
    """Scaled blocks (archs.BLOCK_GAIN): a model missing one block's contribution answers
    differently, so a wrong boundary or a block run with a wrong mask cannot pass the matrix."""
    import tempfile

    d = archs.synthesize_arch(tempfile.mkdtemp(), "llama", "float32", seed=3)
    ref = archs.reference_tokens(d, LONG, TOKENS)
    from kafilad.executor.runner import StageRunner, generate_local
    from kafilad.executor.stage import load_stage_from_dir

    for dropped in range(6):
        head = load_stage_from_dir(d, 0, 6, True, dtype=None)
        block = head.model.model.layers[dropped]
        block.update({"mlp": {"down_proj": {"weight": mx.zeros_like(block.mlp.down_proj.weight)}}})
        assert generate_local([StageRunner(head)], LONG, TOKENS) != ref, dropped


@pytest.mark.parametrize("variant", list(archs.UNSPLITTABLE))
def test_unsplittable_gemma4_runs_whole_and_is_refused_divided(tmp_path, variant):
    config = archs.UNSPLITTABLE[variant]
    d = archs.synthesize_arch(tmp_path / "m", variant, config=config)
    ref = archs.reference_tokens(d, LONG, TOKENS, prefill_step_size=CHUNK)
    assert archs.ring_tokens(d, [(0, 6)], LONG, TOKENS, prefill_step_size=CHUNK) == ref
    info = read_model_info(d)
    reason = unsplittable_reason(info.config)
    assert reason and "gemma4_text" in reason
    from kafilad.node.serving.admission import check_session_arguments

    assert check_session_arguments(info, members=1, context=None, concurrency=1) > 0
    with pytest.raises(KafilaError, match="cannot be divided among machines.*--members 1"):
        check_session_arguments(info, members=2, context=None, concurrency=1)


def test_splittable_architectures_are_not_refused():
    assert all(unsplittable_reason(cfg) is None for cfg in archs.ARCHS.values())
