#!/usr/bin/env python3
"""Measure a stage's working memory in prefill and compare it with the planner's formula
(issue 12 item 3; kafilad/planner/workmem.py; results in docs/planner.md "Working memory").

For each model shape and declared context C, a stage is loaded, a prompt of C tokens is
prefilled exactly as the ring does it (kafilad.executor.runner: chunks of 2048 tokens, then
the last token alone; the head embeds and samples, other stages take hidden states in), and
MLX's allocator is read around it:

    weights   = mx.get_active_memory() once the stage is loaded
    kv        = active memory after the prompt - weights          (the KV cache it left)
    measured  = mx.get_peak_memory() - weights - kv               (working memory in MLX)
    formula   = working_terms(shape, context=C, concurrency=1, head)["mlx"]  (the MLX part)
    admitted  = n_blocks * kv_bytes_per_block_token * C + working_bytes(...)  (what admission
                adds to the weights: also the wire copies outside MLX, not measured here)

A middle stage's input is made as the wire makes it (an mx.array from numpy bytes).

`mx.get_peak_memory()` / `mx.reset_peak_memory()` work on the CPU backend too.

    python scripts/measure_working_memory.py [--contexts 256,1024,2048,3000,4096] [--markdown]

About 2 minutes on the 2-core VM. Synthesised models are written to a temporary directory.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import kafilad.executor  # noqa: F401 - loads the optimised BLAS before mlx (DESIGN §6)
import mlx.core as mx
import numpy as np

from kafilad.executor.runner import StageRunner, prefill_chunks
from kafilad.executor.stage import build_random_stage, load_stage_from_dir
from kafilad.executor.synth import synth_config, synthesize_model
from kafilad.planner.workmem import arch_from_config, working_bytes, working_terms

MiB = 2 ** 20
#: (name, arch, hidden, heads, kv heads, head_dim (None = hidden / heads), intermediate, blocks, head stage too)
SHAPES = (
    ("synth-llama-512", "llama", 512, 8, 4, None, 1536, 4, True),
    ("synth-qwen3-1024", "qwen3", 1024, 16, 8, None, 3072, 4, True),
    ("qwen3-0.6b-shape", "qwen3", 1024, 16, 8, 128, 3072, 2, False),
)


def _stages(tmp: Path, name: str, arch: str, d: int, h: int, kv: int, hd, f: int, blocks: int, head: bool):
    """(config, [(role, loader)]) for one shape: the head and a middle stage of all its blocks."""
    if hd is None:
        model_dir = synthesize_model(tmp / name, arch=arch, num_hidden_layers=blocks, hidden_size=d,
                                     num_attention_heads=h, num_key_value_heads=kv, intermediate_size=f)
        import json
        config = json.loads((model_dir / "config.json").read_text())
        roles = [("mid", lambda: load_stage_from_dir(model_dir, 0, blocks, False))]
        if head:
            roles.insert(0, ("head", lambda: load_stage_from_dir(model_dir, 0, blocks, True)))
        return config, roles
    config = synth_config(arch, num_hidden_layers=blocks, hidden_size=d, num_attention_heads=h,
                          num_key_value_heads=kv, intermediate_size=f)
    config["head_dim"] = hd
    return config, [("mid", lambda: build_random_stage(config, blocks))]


def measure(stage, role: str, context: int, hidden: int) -> tuple[int, int, int]:
    """(weights, kv, working) bytes of one prompt of `context` tokens through `stage`."""
    runner = StageRunner(stage)
    gc.collect()
    mx.clear_cache()
    weights = mx.get_active_memory()
    mx.reset_peak_memory()
    ids = [3 + i % 250 for i in range(context)]
    rng = np.random.default_rng(0)
    for chunk in prefill_chunks(ids):
        if role == "head":
            h = runner.head_embed_and_run("r", chunk)
            if len(chunk) == 1:
                runner.head_sample("r", h)
        else:
            h = mx.array(rng.standard_normal((1, len(chunk), hidden), dtype=np.float32))
            h = runner.run("r", h)
        del h
    gc.collect()
    after = mx.get_active_memory()
    peak = mx.get_peak_memory()
    runner.drop("r")
    return weights, after - weights, peak - after


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="256,1024,2048,3000,4096")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, arch, d, h, kv, hd, f, blocks, head in SHAPES:
            config, roles = _stages(Path(tmp), name, arch, d, h, kv, hd, f, blocks, head)
            shape = arch_from_config(config, 4)
            kv_token = blocks * 2 * shape.num_key_value_heads * shape.head_dim * 4
            for role, load in roles:
                stage = load()
                for c in contexts:
                    _, kv_bytes, work = measure(stage, role, c, d)
                    pred = working_terms(shape, context=c, concurrency=1, head=role == "head")["mlx"]
                    admitted = kv_token * c + working_bytes(shape, context=c, concurrency=1, head=role == "head")
                    rows.append((name, role, c, work, pred, kv_bytes, admitted))
                    print(f"{name} {role} C={c}: measured {work / MiB:.1f} MiB, formula {pred / MiB:.1f} MiB "
                          f"({pred / work - 1:+.1%}); peak - weights {(work + kv_bytes) / MiB:.1f} MiB "
                          f"<= admitted {admitted / MiB:.1f} MiB: {work + kv_bytes <= admitted}", flush=True)
                del stage
                gc.collect()
    errs = [abs(p / w - 1) for *_, w, p, _, _ in rows]
    print(f"largest |formula / measured - 1|: {max(errs):.1%}; every peak within admitted: "
          f"{all(w + k <= a for *_, w, _, k, a in rows)}")
    if args.markdown:
        print("\n| model | stage | context | measured MiB | formula MiB | error | peak − weights MiB | admitted MiB |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for name, role, c, w, p, k, a in rows:
            print(f"| {name} | {role} | {c} | {w / MiB:.1f} | {p / MiB:.1f} | {p / w - 1:+.1%} | "
                  f"{(w + k) / MiB:.1f} | {a / MiB:.1f} |")
    return 0 if max(errs) <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
