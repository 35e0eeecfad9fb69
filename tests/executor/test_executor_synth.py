"""The synthetic model (synth.py): deterministic, loadable by mlx-lm and transformers offline."""

from __future__ import annotations

import os

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from kafilad.executor.synth import BOS_ID, EOS_ID, default_synth_model_dir, load_tokenizer, synthesize_model

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_same_seed_gives_byte_identical_files(tmp_path, arch):
    a = synthesize_model(tmp_path / "a", arch=arch, seed=5, num_hidden_layers=3)
    b = synthesize_model(tmp_path / "b", arch=arch, seed=5, num_hidden_layers=3)
    c = synthesize_model(tmp_path / "c", arch=arch, seed=6, num_hidden_layers=3)
    assert sorted(os.listdir(a)) == FILES
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_byte_level_tokenizer_through_mlx_lm_and_transformers(tmp_path):
    d = synthesize_model(tmp_path / "m", num_hidden_layers=1)
    tok = load_tokenizer(d)
    text = "Once upon a time, café ☕"
    ids = tok.encode(text)
    assert ids == [BOS_ID] + list(text.encode("utf-8"))
    assert tok.decode(ids[1:]) == text
    assert tok.eos_token_ids == {EOS_ID}
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    assert hf.encode(text) == ids
    assert hf.eos_token_id == EOS_ID and hf.bos_token_id == BOS_ID


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_loads_in_mlx_lm_and_generation_is_not_degenerate(tmp_path, arch):
    d = synthesize_model(tmp_path / arch, arch=arch)
    model, tok = mlx_lm.load(str(d))
    prompt = mx.array(tok.encode("Hello there"))
    out = [int(y) for (y, _), _ in zip(generate_step(prompt, model, max_tokens=30), range(30))]
    assert len(out) == 30
    assert len(set(out)) >= 5, out


def test_default_dir_is_created_once_and_keyed_by_parameters(tmp_path):
    a = default_synth_model_dir(tmp_path)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert default_synth_model_dir(tmp_path) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp
    b = default_synth_model_dir(tmp_path, num_hidden_layers=2)
    assert b != a and b.parent == a.parent
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.name, b.name])  # no temp dirs left


def test_bad_arguments_are_explained(tmp_path):
    with pytest.raises(ValueError, match="Unknown synthetic architecture 'gpt2'"):
        synthesize_model(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="float32 or bfloat16, not 'int8'"):
        synthesize_model(tmp_path, dtype="int8")
