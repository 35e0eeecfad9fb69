#!/usr/bin/env python3
"""Benchmarks of the executor (DESIGN §6, §5.1). Prints ratios measured in the same run (§8).

1. BLAS: MLX f32 matmul and a Qwen3-0.6B-shaped decode/prefill with MLX's bundled reference BLAS
   vs OpenBLAS loaded by kafilad.executor.blas (each in its own child process, since the choice
   is made before `import mlx.core`).
2. Probes: the matrix-vector probe vs timing blocks of the architecture, and how well each
   predicts a measured multi-block stage step (DESIGN §5.1 cost model).
3. Ring overhead: a 3-stage in-process ring (wire encoding on every hop) vs single-process
   mlx-lm on the same model, tokens/s.

Usage: python scripts/bench_executor.py [--model DIR] [--skip-blas]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

QWEN06 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
              num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
              max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)


def median_s(fn, repeats=15):
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def child_blas() -> dict:
    """Run inside a child: BLAS as chosen by KAFILA_BLAS. Returns timings in seconds."""
    import kafilad.executor as ex
    import mlx.core as mx
    from kafilad.executor.stage import build_random_stage

    out = {"blas": ex.BLAS_LIBRARY}
    w = mx.random.normal((3072, 1024))
    x1, x4, x256 = mx.random.normal((1, 1024)), mx.random.normal((4, 1024)), mx.random.normal((256, 1024))
    mx.eval(w, x1, x4, x256)
    out["gemv_s"] = median_s(lambda: mx.eval(x1 @ w.T))
    out["gemm4_s"] = median_s(lambda: mx.eval(x4 @ w.T))
    out["gemm256_s"] = median_s(lambda: mx.eval(x256 @ w.T), 3)
    stage = build_random_stage(QWEN06, 4)
    cache = stage.make_cache()
    mx.eval(stage.run_blocks(mx.zeros((1, 32, 1024)), cache))
    h = mx.full((1, 1, 1024), 0.1)

    def step():
        mx.eval(stage.run_blocks(h, cache))
        for c in cache:
            c.offset -= 1

    out["decode4_s"] = median_s(step)
    hp = mx.random.normal((1, 128, 1024))
    out["prefill128_4_s"] = median_s(lambda: mx.eval(stage.run_blocks(hp, stage.make_cache())), 2)
    out["stage_bytes"] = stage.nbytes()
    return out


def bench_blas() -> None:
    res = {}
    for mode in ("reference", "openblas"):
        env = {**os.environ, "KAFILA_BLAS": mode}
        p = subprocess.run([sys.executable, __file__, "--child-blas"], env=env, capture_output=True, text=True, check=True)
        res[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    r, o = res["reference"], res["openblas"]
    print(f"BLAS: reference vs {o['blas']}")
    for k, label in (("gemv_s", "f32 GEMV 1x1024 @ 1024x3072"), ("gemm4_s", "f32 GEMM 4x1024 @ 1024x3072"),
                     ("gemm256_s", "f32 GEMM 256x1024 @ 1024x3072"),
                     ("decode4_s", "decode step, 4 Qwen3-0.6B blocks"), ("prefill128_4_s", "128-token prefill, 4 blocks")):
        print(f"  {label:36s} ref {r[k] * 1e3:8.2f} ms  openblas {o[k] * 1e3:8.2f} ms  speed-up x{r[k] / o[k]:.2f}")
    print(f"  decode effective bandwidth: ref {r['stage_bytes'] / r['decode4_s'] / 1e9:.1f} GB/s, "
          f"openblas {o['stage_bytes'] / o['decode4_s'] / 1e9:.1f} GB/s")


def bench_probes() -> None:
    import mlx.core as mx
    from kafilad.executor.probe import measure_bandwidth_Bps, measure_stage_Bps
    from kafilad.executor.stage import build_random_stage

    t = time.perf_counter(); gemv = measure_bandwidth_Bps(); t_gemv = time.perf_counter() - t
    t = time.perf_counter(); blk, ovh = measure_stage_Bps(QWEN06); t_blk = time.perf_counter() - t
    stage = build_random_stage(QWEN06, 6)
    cache = stage.make_cache()
    mx.eval(stage.run_blocks(mx.zeros((1, 16, 1024)), cache))
    h = mx.full((1, 1, 1024), 0.1)

    def step():
        mx.eval(stage.run_blocks(h, cache))
        for c in cache:
            c.offset -= 1

    measured = median_s(step)
    b = stage.nbytes()
    print(f"Probes (Qwen3-0.6B shape, f32): gemv {gemv / 1e9:.1f} GB/s in {t_gemv:.2f} s; "
          f"block timing {blk / 1e9:.1f} GB/s + {ovh * 1e6:.0f} us/step in {t_blk:.2f} s")
    print(f"  6-block step measured {measured * 1e3:.2f} ms; predicted by gemv {b / gemv * 1e3:.2f} ms "
          f"(ratio {b / gemv / measured:.2f}), by block timing {(ovh + b / blk) * 1e3:.2f} ms "
          f"(ratio {(ovh + b / blk) / measured:.2f})")


def bench_ring_tokens(model_dir: str, n: int = 64) -> None:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    from kafilad.executor.runner import StageRunner, generate_local
    from kafilad.executor.stage import load_stage_from_dir
    from kafilad.modelinfo import read_model_info

    L = read_model_info(model_dir).num_hidden_layers
    cuts = [0, max(1, L // 3), max(2, 2 * L // 3), L]
    runners = [StageRunner(load_stage_from_dir(model_dir, a, b, head=(i == 0))) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    model, tok = mlx_lm.load(model_dir)
    prompt = tok.encode("Once upon a time")

    def single():
        for _, _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n)):
            pass

    def ring():
        generate_local(runners, prompt, n)

    t_single, t_ring = median_s(single, 4), median_s(ring, 4)
    print(f"Ring ({model_dir}, blocks {cuts}): single-process {n / t_single:.0f} tok/s, 3-stage in-process ring "
          f"{n / t_ring:.0f} tok/s, ratio ring/single {t_single / t_ring:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir for the ring benchmark (default: the synthetic demo model)")
    ap.add_argument("--skip-blas", action="store_true")
    ap.add_argument("--child-blas", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_blas:
        print(json.dumps(child_blas()))
        return
    if not args.skip_blas:
        bench_blas()
    import kafilad.executor  # noqa: F401  (OpenBLAS before mlx)
    from kafilad.executor.synth import default_synth_model_dir

    bench_probes()
    bench_ring_tokens(args.model or str(default_synth_model_dir()))


if __name__ == "__main__":
    main()
