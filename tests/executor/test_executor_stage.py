"""Stage building and tensor loading (DESIGN §6): only a stage's tensors are read, bf16 casts."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kafilad.errors import ModelFormatError
from kafilad.executor.stage import build_stage, load_stage_from_dir, read_tensor_bytes, tensor_from_bytes
from kafilad.executor.synth import synthesize_model
from kafilad.modelinfo import TensorInfo, read_model_info


def info(dtype, shape, nbytes, name="t"):
    return TensorInfo(name, "model.safetensors", dtype, tuple(shape), 0, nbytes, None)


def test_tensor_from_bytes_bf16_to_f32_exact():
    # bf16 bit patterns of 1.0, -2.5, 2^-10, +inf, the largest finite bf16 and -0.0
    bits = np.array([0x3F80, 0xC020, 0x3A80, 0x7F80, 0x7F7F, 0x8000], dtype="<u2")
    a = tensor_from_bytes(info("BF16", (2, 3), 12), bits.tobytes())
    assert a.dtype == mx.float32 and a.shape == (2, 3)
    expected = (bits.astype(np.uint32) << 16).view(np.float32).reshape(2, 3)
    got = np.array(a)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert got[0, 0] == 1.0 and got[0, 1] == -2.5 and got[1, 1] == 3.3895313892515355e38


def test_tensor_from_bytes_keeps_dtype_when_asked_and_never_casts_integers():
    bits = np.array([0x3F80, 0xC020], dtype="<u2")
    kept = tensor_from_bytes(info("BF16", (2,), 4), bits.tobytes(), dtype=None)
    assert kept.dtype == mx.bfloat16
    assert np.array_equal(np.array(kept.view(mx.uint16)), bits)
    half = tensor_from_bytes(info("F16", (1,), 2), np.array([1.5], "<f2").tobytes())
    assert half.dtype == mx.float32 and half.item() == 1.5
    packed = tensor_from_bytes(info("U32", (2,), 8), np.array([0xDEADBEEF, 7], "<u4").tobytes())
    assert packed.dtype == mx.uint32 and np.array(packed).tolist() == [0xDEADBEEF, 7]


def test_tensor_from_bytes_rejects_wrong_length():
    with pytest.raises(ModelFormatError, match="should be 8 bytes but 6 arrived"):
        tensor_from_bytes(info("F32", (2,), 8, name="w"), b"\0" * 6)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return synthesize_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=3)


def test_non_head_stage_holds_only_its_blocks(llama_dir):
    s = load_stage_from_dir(llama_dir, 2, 5, head=False)
    assert (s.start, s.end, s.head, s.n_blocks, len(s.layers)) == (2, 5, False, 3, 3)
    mi = read_model_info(llama_dir)
    names = {k for k, _ in tree_flatten(s.model.parameters())}
    # checkpoint names kept (no renumbering): exactly blocks 2-4, no embedding, final norm or lm_head
    assert names == {t.name for t in mi.stage_tensors(2, 5, False)}
    assert all(k.startswith(("model.layers.2.", "model.layers.3.", "model.layers.4.")) for k in names)
    assert len(s.model.model.layers) == 6 and not s.model.model.layers[0].parameters()
    assert s.nbytes() == sum(t.held_bytes(4) for t in mi.stage_tensors(2, 5, False))
    with pytest.raises(ModelFormatError, match=r"Stage \[2, 5\) is not the head and cannot run from token ids"):
        s.run_tokens([1, 2], s.make_cache())
    with pytest.raises(ModelFormatError, match="not the head and cannot compute logits"):
        s.logits(mx.zeros((1, 1, 64)))


def test_load_stage_reads_only_its_tensors(llama_dir, tmp_path):
    """Every tensor outside the stage is overwritten with NaN bytes: the stage must not notice."""
    spoiled = tmp_path / "spoiled"
    shutil.copytree(llama_dir, spoiled)
    mi = read_model_info(spoiled)
    mine = {t.name for t in mi.stage_tensors(1, 3, head=False)}
    with open(spoiled / "model.safetensors", "r+b") as f:
        for t in mi.tensors.values():
            if t.name not in mine:
                f.seek(t.offset_bytes)
                f.write(b"\xff" * t.nbytes)
    clean = load_stage_from_dir(llama_dir, 1, 3, head=False)
    dirty = load_stage_from_dir(spoiled, 1, 3, head=False)
    h = mx.random.normal((1, 5, 64), key=mx.random.key(1))
    a, b = clean.run_blocks(h, clean.make_cache()), dirty.run_blocks(h, dirty.make_cache())
    assert not mx.isnan(b).any().item()
    assert mx.array_equal(a, b).item()


def test_build_stage_names_missing_and_surplus_tensors(llama_dir):
    mi = read_model_info(llama_dir)
    weights = {t.name: tensor_from_bytes(t, read_tensor_bytes(llama_dir, t)) for t in mi.stage_tensors(2, 4, False)}
    missing = {k: v for k, v in weights.items() if "layers.3.mlp.up_proj" not in k}
    with pytest.raises(ModelFormatError, match=r"^Weights for stage \[2, 4\) head=False do not fit the model: "
                                               r"Missing 1 parameters: model\.layers\.3\.mlp\.up_proj\.weight\.$"):
        build_stage(mi.config, 2, 4, False, missing)
    surplus = {**weights, "model.layers.4.mlp.up_proj.weight": weights["model.layers.3.mlp.up_proj.weight"]}
    with pytest.raises(ModelFormatError, match=r"model\.layers\.4\.mlp\.up_proj\.weight"):
        build_stage(mi.config, 2, 4, False, surplus)
    with pytest.raises(ModelFormatError, match=r"Block range \[4, 9\) is not within the model's 6 blocks"):
        build_stage(mi.config, 4, 9, False, {})


def test_bf16_checkpoint_loads_as_f32(tmp_path):
    d = synthesize_model(tmp_path / "bf16", arch="qwen3", seed=1, num_hidden_layers=2, dtype="bfloat16")
    head = load_stage_from_dir(d, 0, 2, head=True)
    kept = load_stage_from_dir(d, 0, 2, head=True, dtype=None)
    assert head.model.model.layers[0].mlp.up_proj.weight.dtype == mx.float32
    assert kept.model.model.layers[0].mlp.up_proj.weight.dtype == mx.bfloat16
    assert mx.array_equal(head.model.model.layers[0].mlp.up_proj.weight,
                          kept.model.model.layers[0].mlp.up_proj.weight.astype(mx.float32)).item()
    logits = head.logits(head.run_tokens([256, 72, 105], head.make_cache()))
    assert logits.shape == (1, 258) and logits.dtype == mx.float32
