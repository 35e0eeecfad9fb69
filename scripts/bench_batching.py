#!/usr/bin/env python3
"""Benchmark: the decode schedules round a 3-daemon ring, in one run (DESIGN §6, §8, §9.4).

One loopback cluster serves a synthesised model with a few-ms stage, divided uniformly (so the
host is the ring's head, and the daemons are alike),
and the control API's `schedule` op (kafila-ctl schedule) switches its decode schedule between
requests, so every mode runs on the same plan and the same processes. In each round every mode
serves 1 and then K concurrent requests (different prompts); aggregate tokens/s = all generated
tokens / wall time from the first request's start to the last one's end (prefill included;
prompts are short). Rounds interleave the modes (drift on a shared machine hits each alike);
the first --warmup rounds are discarded (auto's policy spends one 1-s trial learning whether
overlapped steps pay on this machine, once per daemon); each figure is the median of --runs
rounds. Prints the ratios between modes
and K / 1 within each.

Modes (--modes, the first is compared with the others): `auto` (the default schedule: decode
micro-batches chosen by kafilad/proto/step_policy.py), `lockstep` (M = 1), `per-request` (every
request its own passes, pipelined, as KAFILA_BATCH=0), `micro2`, `micro3` (M pinned).
Results: docs/performance.md "Serving schedule".

    python scripts/bench_batching.py [--concurrency 4] [--tokens 48] [--runs 4]
        [--hidden 512] [--layers 8] [--members 3] [--modes auto,lockstep,per-request] [--bound]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import kafilad.executor  # noqa: F401 - loads the optimised BLAS before mlx (DESIGN §6)
from kafila_ctl.demo import LoopbackCluster

#: --modes name -> the control API's `schedule` mode (kafila-ctl schedule)
MODES = {"auto": "auto", "lockstep": "lockstep", "per-request": "per-request", "micro2": 2, "micro3": 3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2,
                    help="rounds discarded first (auto's policy may spend one learning that overlapped steps do "
                         "not pay on this machine: a 1-s trial, once per daemon)")
    ap.add_argument("--bound", action="store_true",
                    help="after the cluster, time mlx-lm alone's K-row and 1-row decode steps on the same model in "
                         "this process (scripts/bench_batch_cost.py) and print each mode's K ÷ 1 against that bound, "
                         "K ÷ (step(K) ÷ step(1)) (issue 24: >= 0.95 of it)")
    ap.add_argument("--modes", default="auto,lockstep,per-request",
                    help="comma list of auto (the default schedule), lockstep (KAFILA_MICRO_BATCHES=1), "
                         "per-request (KAFILA_BATCH=0), micro3 (KAFILA_MICRO_BATCHES=3); the first is compared "
                         "with the others")
    args = ap.parse_args()
    from kafilad.executor.synth import default_synth_model_dir
    model = default_synth_model_dir(hidden_size=args.hidden, num_hidden_layers=args.layers)
    k = args.concurrency
    print(f"model: synthesised llama, hidden {args.hidden}, {args.layers} layers ({model}); "
          f"{args.members} daemons on loopback; {args.tokens} tokens per request; median of {args.runs} rounds")
    rates: dict[tuple[str, int], float] = {}
    names = args.modes.split(",")
    with LoopbackCluster(args.members) as c:
        formed = c.form(str(model), concurrency=k, strategy="uniform")  # uniform: the head on the host
        plan = formed["status"]["plan"]
        print(f"formed in {formed['form_s']:.1f} s; blocks {plan['blocks']}, head {plan['head']}, "
              f"predicted bottleneck {plan['bottleneck_s'] * 1e3:.2f} ms")
        for rnd in range(1 - args.warmup, args.runs + 1):  # rounds ≤ 0 warm up; modes interleave (drift hits each alike)
            for mode in names:
                c.call(0, "schedule", mode=MODES[mode])
                for n in (1, k):
                    tps = c.aggregate_tps(n, args.tokens)
                    if rnd > 0:
                        rates.setdefault((mode, n), []).append(tps)
                        st = c.call(0, "status")
                        gen = st.get("last_generation") or {}
                        stages = {s[0]: round(s[3] * 1e3, 2) for s in gen.get("stats", [])}
                        print(f"[{mode}] round {rnd}, {n} concurrent: {tps:.1f} tokens/s; the last request's median "
                              f"decode stage ms by peer {stages}, rows {gen.get('batch_rows_median')}")
                sched = c.call(0, "status").get("schedule") or {}
                if rnd == args.runs and sched:
                    print(f"[{mode}] schedule: M={sched.get('micro_batches')} (most in flight "
                          f"{sched.get('max_steps_in_flight')}), trials {sched.get('trials')}")
    for key, samples in list(rates.items()):
        rates[key] = statistics.median(samples)
        print(f"[{key[0]}] {key[1]} concurrent: median {rates[key]:.1f} tokens/s over {len(samples)} rounds")
    for n in (1, k):
        for other in names[1:]:
            print(f"{n} concurrent: {names[0]} / {other} = {rates[(names[0], n)] / rates[(other, n)]:.2f}")
    for mode in names:
        print(f"{mode}: {k} concurrent / 1 = {rates[(mode, k)] / rates[(mode, 1)]:.2f}")
    if args.bound:  # after the cluster stopped: mlx-lm alone has the machine to itself
        bound = mlx_lm_batch_bound(str(model), k, args.runs)
        for mode in names:
            got = rates[(mode, k)] / rates[(mode, 1)]
            print(f"{mode}: {k} concurrent / 1 = {got:.2f} = {got / bound:.2f} of mlx-lm alone's bound {bound:.2f} "
                  f"(its {k}-row decode step ÷ its 1-row one, same BLAS, this run)")
    return 0


def mlx_lm_batch_bound(model_dir: str, k: int, rounds: int, steps: int = 40) -> float:
    """K ÷ (step(K rows) ÷ step(1 row)) of mlx-lm alone on `model_dir`: the most K concurrent ÷ 1
    any batched server reaches on this machine (scripts/bench_batch_cost.py `step_ms`), the median
    over `rounds`."""
    from pathlib import Path

    import mlx.core as mx
    from mlx_lm.utils import load_model
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_batch_cost import step_ms
    model, _ = load_model(Path(model_dir))
    model.set_dtype(mx.float32)
    bounds = []
    for _ in range(rounds):
        one, many = step_ms(model, 1, steps), step_ms(model, k, steps)
        bounds.append(k / (many / one))
    return statistics.median(bounds)


if __name__ == "__main__":
    sys.exit(main())
