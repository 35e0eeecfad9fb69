#!/usr/bin/env python3
"""Write model directories holding only config.json and safetensors headers (issue 4 item 5).

The tensor data is left as a sparse hole (the file is extended with truncate, so a 64 GB
checkpoint costs a few kilobytes of disk), which is all the planner reads (kafilad.modelinfo).
Shapes follow the published Qwen3 configs (Hugging Face Qwen/Qwen3-8B, -14B, -32B config.json):

```
 model       layers  hidden  intermediate  heads  kv_heads  head_dim  vocab   tied
 qwen3-8b        36    4096         12288     32         8       128  151936  no
 qwen3-14b       40    5120         17408     40         8       128  151936  no
 qwen3-32b       64    5120         25600     64         8       128  151936  no
```
Every tensor is stored as BF16, as published. Layouts: "single" (one model.safetensors) or
"sharded" (model-0000i-of-0000N.safetensors + model.safetensors.index.json).

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

SHAPES = {
    "qwen3-8b": dict(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "qwen3-14b": dict(num_hidden_layers=40, hidden_size=5120, intermediate_size=17408,
                      num_attention_heads=40, num_key_value_heads=8, head_dim=128),
    "qwen3-32b": dict(num_hidden_layers=64, hidden_size=5120, intermediate_size=25600,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128),
}
VOCAB = 151936


def config_for(name: str) -> dict:
    """The config.json of a Qwen3 shape (fields mlx-lm's qwen3 model reads)."""
    s = SHAPES[name]
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
        "vocab_size": VOCAB, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "tie_word_embeddings": False, "attention_bias": False,
        "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645, **s,
    }


def tensors_for(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor, in checkpoint order."""
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
    ap.add_argument("--models", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--layout", choices=("single", "sharded", "both"), default="single")
    ap.add_argument("--shard-bytes", type=int, default=5_000_000_000)
    a = ap.parse_args(argv)
    for name in a.models.split(","):
        if name not in SHAPES:
            print(f"Unknown model {name!r}; choose from {', '.join(SHAPES)}.", file=sys.stderr)
            return 2
        for layout in (("single", "sharded") if a.layout == "both" else (a.layout,)):
            print(make_model(a.out_dir, name, layout, a.shard_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
