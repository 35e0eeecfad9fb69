#!/usr/bin/env python3
"""Benchmark: what a decode step of B rows costs against one of 1 row, in mlx-lm alone (issue 12).

The issue's target "4 concurrent requests >= 3.5x the 1-request tokens/s" assumes a batch of 4 costs
about one of 1 (memory-bound decode: the weights are read once for every row). Whether it does is
the BLAS's and the machine's, not the ring's: this runs the whole model in one process with mlx-lm's
own classes (`load_model`, one `KVCache` per layer, every row the same length so no mask), greedy,
B = 1, 2, 4 rows, and prints each step's median ms and ratio to B = 1, then the same for single
matrix products of the model's shapes (x @ W.T, f32) at M = 1 and 4. No Kafila code runs here
but the BLAS loader (kafilad.executor, as the daemons load it).

    python scripts/bench_batch_cost.py [MODEL_DIR] [--steps 40] [--rounds 3]

MODEL_DIR defaults to the 100 MB synthesised Llama of issue 12 (hidden 512, 8 blocks). The bound it
implies for any batched server on this machine: B concurrent ÷ 1 <= B ÷ (step(B) ÷ step(1)).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import kafilad.executor  # noqa: F401 - loads the optimised BLAS before mlx (DESIGN §6)
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model


def step_ms(model, rows: int, steps: int, prompt_len: int = 19) -> float:
    """Median ms of a greedy decode step of `rows` equal-length rows after a `prompt_len` prefill."""
    cache = [KVCache() for _ in model.layers]
    logits = model(mx.array([list(range(1, prompt_len + 1))] * rows), cache=cache)
    token = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(token)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(token[:, None], cache=cache)
        token = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(token)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[5:]) * 1e3


def matmul_ms(rows: int, k: int, n: int, n_weights: int = 32, reps: int = 12) -> float:
    """Median ms of x (rows, k) @ W.T for W (n, k) f32, over `n_weights` weights (more bytes than a
    cache holds), per product."""
    weights = [mx.random.normal((n, k)) for _ in range(n_weights)]
    x = mx.random.normal((rows, k))
    mx.eval(weights, x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval([x @ w.T for w in weights])
        times.append((time.perf_counter() - t0) / n_weights)
    return statistics.median(times[3:]) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", default=None)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.model_dir is None:
        from kafilad.executor.synth import default_synth_model_dir
        args.model_dir = str(default_synth_model_dir(hidden_size=512, num_hidden_layers=8))
    model, config = load_model(Path(args.model_dir))
    model.set_dtype(mx.float32)
    from kafilad.executor.blas import blas_status
    print(f"model {args.model_dir} (f32), BLAS {blas_status()}")
    for r in range(1, args.rounds + 1):
        ms = {b: step_ms(model, b, args.steps) for b in (1, 2, 4)}
        print(f"round {r}: decode step " + ", ".join(f"B={b} {t:.2f} ms ({t / ms[1]:.2f}x)" for b, t in ms.items())
              + f"; bound on 4 concurrent ÷ 1: {4 / (ms[4] / ms[1]):.2f}")
    h, i = int(config["hidden_size"]), int(config["intermediate_size"])
    kv = int(config.get("num_key_value_heads", config["num_attention_heads"])) * int(
        config.get("head_dim") or h // int(config["num_attention_heads"]))
    for name, (k, n) in {"q/o": (h, h), "k/v": (h, kv), "gate/up": (h, i), "down": (i, h)}.items():
        one, four = matmul_ms(1, k, n), matmul_ms(4, k, n)
        print(f"x @ W.T {name} ({k} -> {n}): M=1 {one:.3f} ms, M=4 {four:.3f} ms ({four / one:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
