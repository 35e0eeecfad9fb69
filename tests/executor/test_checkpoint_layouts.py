"""Real checkpoint layouts (issue 21 item 7): sharded safetensors with an index, multimodal
checkpoints whose text weights carry a `language_model.` prefix (Gemma 3, Qwen3.5, with vision
tensors the text model drops), per-module quantisation overrides in the config, and tied
embeddings. Each is divided 3 ways and must give single-process mlx-lm's greedy tokens."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model, save_model

from kafilad.executor import archs
from kafilad.executor.synth import write_tokenizer_files
from kafilad.modelinfo import read_model_info

PROMPT = [(i * 53 + 7) % 500 for i in range(30)]
THREE = [(0, 2), (2, 3), (3, 6)]


def write_checkpoint(out, config: dict, tensors: dict[str, mx.array], shards: int = 1) -> None:
    """config.json and the tensors as `shards` safetensors files (with model.safetensors.index.json
    when more than one), as Hugging Face writes a checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            mx.save_safetensors(str(out / fname), part, metadata={"format": "mlx"})
            weight_map.update({n: fname for n in part})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_tokenizer_files(out, model_max_length=4096)


def check(d) -> None:
    ref = archs.reference_tokens(d, PROMPT, 24)
    assert len(set(ref)) >= 3
    assert archs.ring_tokens(d, THREE, PROMPT, 24) == ref
    assert archs.ring_tokens(d, [(0, 6)], PROMPT, 24) == ref


def test_sharded_checkpoint_with_index(tmp_path):
    config = archs.ARCHS["qwen3_moe"]
    model = archs.build_model(config, seed=5)
    write_checkpoint(tmp_path / "m", config, dict(tree_flatten(model.parameters())), shards=3)
    info = read_model_info(tmp_path / "m")
    assert len({t.file for t in info.tensors.values()}) == 3
    check(tmp_path / "m")


@pytest.mark.parametrize("rename", ["gemma3", "qwen3_5"])
def test_multimodal_checkpoint_text_weights(tmp_path, rename):
    """Hugging Face names of the text weights and a vision tensor the text model drops: Gemma 3
    keeps `language_model.model.*`; Qwen3.5 writes `model.language_model.*` and a top-level
    `lm_head`; both sanitize to mlx-lm's `language_model.model.*`."""
    if rename == "gemma3":
        config = {"model_type": "gemma3", "vocab_size": archs.VOCAB,
                  "text_config": dict(archs.ARCHS["gemma3_text"])}
        model = archs.build_model(config, seed=9)
        tensors = dict(tree_flatten(model.parameters()))
        tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = mx.ones((8, 3, 2, 2))
    else:
        config = archs.ARCHS["qwen3_5"]
        model = archs.build_model(config, seed=9)
        tensors = {}
        for k, v in tree_flatten(model.parameters()):
            k = k.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head", "lm_head")
            tensors[k] = v
        tensors["model.visual.blocks.0.attn.qkv.weight"] = mx.ones((8, 8))
    write_checkpoint(tmp_path / "m", config, tensors)
    info = read_model_info(tmp_path / "m")
    assert info.config["model_type"] == rename and info.num_hidden_layers == 6
    assert info.tensors and all(t.block is None or 0 <= t.block < 6 for t in info.tensors.values())
    check(tmp_path / "m")


def test_per_module_quantisation_overrides(tmp_path):
    """mlx-lm's mixed quantisation: some modules 8-bit group 64, the rest 4-bit group 32, and one
    left in float, written per module path in the config's "quantization" entry."""
    config = dict(archs.ARCHS["llama"])
    model = archs.build_model(config, seed=13)

    def predicate(path, module):
        if path.endswith("layers.1.mlp.down_proj") or path.endswith("layers.4.self_attn.v_proj"):
            return {"group_size": 64, "bits": 8}
        if path.endswith("layers.2.mlp.up_proj"):
            return False
        return True

    model, config = quantize_model(model, config, 32, 4, quant_predicate=predicate)
    q = config["quantization"]
    assert q["model.layers.1.mlp.down_proj"] == {"group_size": 64, "bits": 8}
    assert "model.layers.2.mlp.up_proj.scales" not in dict(tree_flatten(model.parameters()))  # left in float
    save_model(tmp_path / "m", model)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    write_tokenizer_files(tmp_path / "m", model_max_length=4096)
    check(tmp_path / "m")


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_tied_embeddings(tmp_path, arch):
    """No lm_head tensor in the checkpoint: the output projection is the embedding (Qwen3's
    `as_linear`; mlx-lm's Gemma 3 sanitize copies the embedding into its lm_head), held by the
    head only."""
    config = archs.ARCHS[arch]
    model = archs.build_model(config, seed=archs.seed_for(arch))
    tensors = {k: v for k, v in tree_flatten(model.parameters()) if not k.startswith("lm_head")}
    write_checkpoint(tmp_path / "m", config, tensors)
    info = read_model_info(tmp_path / "m")
    assert not any("lm_head" in n for n in info.tensors)
    assert [t.name for t in info.head_tensors() if "embed" in t.name] == ["model.embed_tokens.weight"]
    check(tmp_path / "m")


def hf_mixtral(params: dict) -> dict:
    """Mixtral's Hugging Face layout: experts unstacked (block_sparse_moe.experts.E.w1/w2/w3)."""
    out = {}
    for k, v in params.items():
        m = k.split(".block_sparse_moe.switch_mlp.")
        if len(m) == 2:
            proj, leaf = m[1].split(".", 1)
            w = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[proj]
            for e in range(v.shape[0]):
                out[f"{m[0]}.block_sparse_moe.experts.{e}.{w}.{leaf}"] = v[e]
        else:
            out[k] = v
    return out


def hf_qwen35(params: dict) -> dict:
    """Qwen3.5's Hugging Face layout: conv1d weights (C, 1, K), RMSNorm weights stored minus one,
    text weights under model.language_model, lm_head at the top."""
    norms = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight",
             ".k_norm.weight")
    out = {}
    for k, v in params.items():
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)
        elif k.endswith(norms) and v.ndim == 1:
            v = v - 1.0
        k = k.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head", "lm_head")
        out[k] = v
    return out


@pytest.mark.parametrize("arch,to_hf,bounds", [
    ("mixtral", hf_mixtral, [(0, 2), (2, 4), (4, 6)]),  # mlx-lm stacks experts only when block 0's are unstacked
    ("qwen3_5", hf_qwen35, [(0, 2), (2, 3), (3, 6)]),  # [2, 3) holds only a full-attention block: no conv1d
])
def test_raw_hugging_face_checkpoints_sanitized_over_the_whole_checkpoint(tmp_path, arch, to_hf, bounds):
    """mlx-lm's sanitize decides by what the whole checkpoint holds; a stage sees its own tensors
    plus the shapes of the rest (the plan frame's "checkpoint"), so it converts as mlx_lm.load."""
    model = archs.build_model(archs.ARCHS[arch], seed=21)
    write_checkpoint(tmp_path / "m", archs.ARCHS[arch], to_hf(dict(tree_flatten(model.parameters()))))
    ref = archs.reference_tokens(tmp_path / "m", PROMPT, 24)
    assert archs.ring_tokens(tmp_path / "m", bounds, PROMPT, 24) == ref
    # the stage alone could not tell: without the checkpoint view it fails to load or answers otherwise
    from kafilad.errors import ModelFormatError
    from kafilad.executor.runner import StageRunner, generate_local
    from kafilad.executor.stage import build_stage, load_stage_from_dir, read_tensor_bytes, tensor_from_bytes

    info = read_model_info(tmp_path / "m")
    a, b = bounds[1]
    own = {t.name: tensor_from_bytes(t, read_tensor_bytes(info.model_dir, t), dtype=None)
           for t in info.stage_tensors(a, b, False)}
    try:
        blind = build_stage(info.config, a, b, False, own)
    except ModelFormatError:
        return
    runners = [StageRunner(load_stage_from_dir(tmp_path / "m", *bounds[0], True, dtype=None)), StageRunner(blind),
               StageRunner(load_stage_from_dir(tmp_path / "m", *bounds[2], False, dtype=None))]
    assert generate_local(runners, PROMPT, 24) != ref
