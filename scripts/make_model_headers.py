#!/usr/bin/env python3
"""Write model directories holding only config.json and safetensors headers (issue 4 item 5;
mixture-of-experts shapes: issue 21 item 4).

The tensor data is left as a sparse hole (the file is extended with truncate, so a 64 GB
checkpoint costs a few kilobytes of disk), which is all the planner reads (kafilad.modelinfo).
Dense shapes follow the published Qwen3 configs (Hugging Face Qwen/Qwen3-8B, -14B, -32B config.json):

```
 model       layers  hidden  intermediate  heads  kv_heads  head_dim  vocab   tied
 qwen3-8b        36    4096         12288     32         8       128  151936  no
 qwen3-14b       40    5120         17408     40         8       128  151936  no
 qwen3-32b       64    5120         25600     64         8       128  151936  no
```

Mixture-of-experts shapes: the configs in MOE_CONFIGS are written here from the published
config.json files as we know them (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, openai/gpt-oss-120b,
deepseek-ai/DeepSeek-V3, zai-org/GLM-4.5-Air on Hugging Face), not downloaded; the keys the
planner and mlx-lm read are those of the published files. Tensor names follow the published
checkpoints: Hugging Face's per-expert `mlp.experts.N.{gate,up,down}_proj.weight` (Qwen3-MoE,
DeepSeek-V3, GLM-4.5) and gpt-oss's stacked `mlp.experts.gate_up_proj` / `down_proj` (with
biases, as in its bf16 conversion).

```
 model               layers  hidden  experts  per token  shared  expert width  dense blocks  params total / active
 qwen3-30b-a3b           48    2048      128          8       -           768             -   30.5 B / 3.3 B
 qwen3-235b-a22b         94    4096      128          8       -          1536             -    235 B / 22 B
 gpt-oss-120b            36    2880      128          4       -          2880             -    117 B / 5.1 B
 deepseek-v3             61    7168      256          8       1          2048       0, 1, 2    671 B / 37 B
 glm-4.5-air             46    4096      128          8       1          1408             0    106 B / 12 B
```
(the last column is the publishers' own figures; tests/planner/test_planner_moe.py checks the
headers against them.) Differences from the published checkpoints, all stated in the configs'
absence of the keys involved: every tensor is BF16 (gpt-oss publishes its experts in MXFP4,
DeepSeek-V3 in FP8 with block scales, which mlx-lm dequantises to bf16 on load); the
multi-token-prediction layers of DeepSeek-V3 and GLM-4.5-Air (`num_nextn_predict_layers`,
stored as block `num_hidden_layers`, unused for decoding) are not written, as the published
parameter counts leave them out; the `quantization_config` of gpt-oss and DeepSeek-V3 is dropped.

Usage:
    python scripts/make_model_headers.py OUT_DIR [--models qwen3-8b,qwen3-14b,qwen3-32b]
        [--layout single|sharded|both] [--shard-bytes 5000000000]
Never commit the output.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kafilad.planner import moe  # noqa: E402  (pure: which blocks are MoE, E and k)

SHAPES = {
    "qwen3-8b": dict(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "qwen3-14b": dict(num_hidden_layers=40, hidden_size=5120, intermediate_size=17408,
                      num_attention_heads=40, num_key_value_heads=8, head_dim=128),
    "qwen3-32b": dict(num_hidden_layers=64, hidden_size=5120, intermediate_size=25600,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128),
}
VOCAB = 151936


_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
    "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 40960,
    "mlp_only_layers": [], "norm_topk_prob": True, "num_experts": 128, "num_experts_per_tok": 8,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
#: published config.json of each mixture-of-experts model (module docstring), as written here.
MOE_CONFIGS = {
    "qwen3-30b-a3b": {**_QWEN3_MOE, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_hidden_layers": 48, "max_window_layers": 48, "num_attention_heads": 32},
    "qwen3-235b-a22b": {**_QWEN3_MOE, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                        "num_hidden_layers": 94, "max_window_layers": 94, "num_attention_heads": 64},
    "gpt-oss-120b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 200002, "pad_token_id": 199999, "experts_per_token": 4,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
        "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
        "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "num_local_experts": 128, "output_router_logits": False, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088,
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
        "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
        "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
        "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
    },
    "glm-4.5-air": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
        "attention_dropout": 0.0, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338],
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "partial_rotary_factor": 0.5,
        "initializer_range": 0.02, "intermediate_size": 10944, "max_position_embeddings": 131072,
        "moe_intermediate_size": 1408, "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1,
        "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_qk_norm": False,
        "vocab_size": 151552,
    },
}
#: every model this script writes.
MODELS = (*SHAPES, *MOE_CONFIGS)


def config_for(name: str) -> dict:
    """The config.json of a model of MODELS (the fields mlx-lm's model class reads)."""
    if name in MOE_CONFIGS:
        return dict(MOE_CONFIGS[name])
    s = SHAPES[name]
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
        "vocab_size": VOCAB, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "tie_word_embeddings": False, "attention_bias": False,
        "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645, **s,
    }


def _mlp(p: str, h: int, i: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(p + "gate_proj.weight", (i, h)), (p + "up_proj.weight", (i, h)), (p + "down_proj.weight", (h, i))]


def _moe_block(cfg: dict, p: str) -> list[tuple[str, tuple[int, ...]]]:
    """The attention and MLP tensors of one block of a mixture-of-experts model (prefix `p`)."""
    h, typ = cfg["hidden_size"], cfg["model_type"]
    L = int(p.split(".")[2])
    out = [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    a = p + "self_attn."
    if typ == "deepseek_v3":  # multi-head latent attention
        nh, ql, kvl = cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
        nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        out += [(a + "q_a_proj.weight", (ql, h)), (a + "q_a_layernorm.weight", (ql,)),
                (a + "q_b_proj.weight", (nh * (nope + rope), ql)),
                (a + "kv_a_proj_with_mqa.weight", (kvl + rope, h)), (a + "kv_a_layernorm.weight", (kvl,)),
                (a + "kv_b_proj.weight", (nh * (nope + vd), kvl)), (a + "o_proj.weight", (h, nh * vd))]
    else:
        d = cfg["head_dim"]
        q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
        out += [(a + "q_proj.weight", (q, h)), (a + "k_proj.weight", (kv, h)), (a + "v_proj.weight", (kv, h)),
                (a + "o_proj.weight", (h, q))]
        if cfg.get("attention_bias"):
            out += [(a + "q_proj.bias", (q,)), (a + "k_proj.bias", (kv,)), (a + "v_proj.bias", (kv,))]
            if typ == "gpt_oss":
                out += [(a + "o_proj.bias", (h,))]
        if typ == "qwen3_moe":
            out += [(a + "q_norm.weight", (d,)), (a + "k_norm.weight", (d,))]
        if typ == "gpt_oss":
            out += [(a + "sinks", (cfg["num_attention_heads"],))]
    m = p + "mlp."
    if not moe.is_moe_block(cfg, L):
        return out + _mlp(m, h, cfg["intermediate_size"])
    spec = moe.moe_spec(cfg)
    e = spec.num_experts
    if typ == "gpt_oss":
        f = cfg["intermediate_size"]
        return out + [(m + "router.weight", (e, h)), (m + "router.bias", (e,)),
                      (m + "experts.gate_up_proj", (e, h, 2 * f)), (m + "experts.gate_up_proj_bias", (e, 2 * f)),
                      (m + "experts.down_proj", (e, f, h)), (m + "experts.down_proj_bias", (e, h))]
    f = cfg["moe_intermediate_size"]
    out += [(m + "gate.weight", (e, h))]
    if typ in ("deepseek_v3", "glm4_moe"):
        out += [(m + "gate.e_score_correction_bias", (e,))]
    for x in range(e):
        out += _mlp(f"{m}experts.{x}.", h, f)
    if cfg.get("n_shared_experts"):
        out += _mlp(m + "shared_experts.", h, f * int(cfg["n_shared_experts"]))
    return out


def tensors_for(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor, in checkpoint order."""
    if cfg["model_type"] != "qwen3":
        h, v = cfg["hidden_size"], cfg["vocab_size"]
        out = [("model.embed_tokens.weight", (v, h))]
        for L in range(cfg["num_hidden_layers"]):
            out += _moe_block(cfg, f"model.layers.{L}.")
        return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (VOCAB, h))]
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "self_attn.q_norm.weight", (d,)),
            (p + "self_attn.k_norm.weight", (d,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (VOCAB, h))]
    return out


def _nbytes(shape: tuple[int, ...], dtype_bytes: int = 2) -> int:
    n = dtype_bytes
    for s in shape:
        n *= s
    return n


def write_safetensors_header(path: Path, tensors: list[tuple[str, tuple[int, ...]]]) -> int:
    """Write a safetensors file whose data is a sparse hole; returns the data size in bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape in tensors:
        nb = _nbytes(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + off)  # the hole: no data blocks are allocated
    return off


def make_model(out_dir: Path, name: str, layout: str, shard_bytes: int = 5_000_000_000) -> Path:
    """Write `out_dir/<name>` (single) or `out_dir/<name>-sharded` and return its path."""
    cfg = config_for(name)
    d = out_dir / (name if layout == "single" else f"{name}-sharded")
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = tensors_for(cfg)
    if layout == "single":
        write_safetensors_header(d / "model.safetensors", tensors)
        return d
    shards: list[list] = [[]]
    size = 0
    for t in tensors:
        nb = _nbytes(t[1])
        if shards[-1] and size + nb > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nb
    weight_map, total = {}, 0
    for k, group in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors_header(d / fname, group)
        weight_map.update({n: fname for n, _ in group})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--models", default=",".join(SHAPES), help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--layout", choices=("single", "sharded", "both"), default="single")
    ap.add_argument("--shard-bytes", type=int, default=5_000_000_000)
    a = ap.parse_args(argv)
    for name in a.models.split(","):
        if name not in MODELS:
            print(f"Unknown model {name!r}; choose from {', '.join(MODELS)}.", file=sys.stderr)
            return 2
        for layout in (("single", "sharded") if a.layout == "both" else (a.layout,)):
            print(make_model(a.out_dir, name, layout, a.shard_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
