#!/usr/bin/env python3
"""Benchmark: the decode schedules round a 3-daemon ring, in one run (DESIGN §6, §8, §9.4).

One loopback cluster per mode serves the same synthesised model with a few-ms stage. Each serves
1 and then K concurrent requests (different prompts); aggregate tokens/s = all generated tokens /
wall time from the first request's start to the last one's end (prefill included; prompts are
short). Reports the median of --runs timed rounds after one discarded cold round, and prints the
ratios between modes and K / 1 within each. Each cluster plans from its own capability probes,
so the plans may differ a little; all are printed.

Modes (--modes, the first is compared with the others): `auto` (the default schedule: decode
micro-batches chosen by kafilad/node/step_policy.py), `lockstep` (KAFILA_MICRO_BATCHES=1),
`per-request` (KAFILA_BATCH=0: every request its own passes, pipelined), `micro3`
(KAFILA_MICRO_BATCHES=3). Results: docs/performance.md "Serving schedule".

    python scripts/bench_batching.py [--concurrency 4] [--tokens 48] [--runs 4]
        [--hidden 512] [--layers 8] [--members 3] [--modes auto,lockstep,per-request]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import trio

import kafilad.executor  # noqa: F401 - loads the optimised BLAS before mlx (DESIGN §6)
from kafila_ctl.demo import LoopbackCluster

PROMPTS = ["Once upon a time", "The caravan left at dawn", "Kafila serves a model", "A ring of machines",
           "In the beginning", "Tokens travel round", "Seven camels", "Under the desert sky"]


def aggregate_tps(c: LoopbackCluster, k: int, tokens: int) -> float:
    """Run k requests at once through the host; return generated tokens / wall seconds."""
    counts = []

    async def one(prompt):
        r = await c.client(0).call("generate", prompt=prompt, max_tokens=tokens)
        counts.append(len(r["token_ids"]))

    async def main():
        async with trio.open_nursery() as nursery:
            for i in range(k):
                nursery.start_soon(one, PROMPTS[i % len(PROMPTS)])
    t0 = time.perf_counter()
    trio.run(main)
    return sum(counts) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--members", type=int, default=3)
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
    modes = {"auto": {}, "lockstep": {"KAFILA_MICRO_BATCHES": "1"}, "per-request": {"KAFILA_BATCH": "0"},
             "micro3": {"KAFILA_MICRO_BATCHES": "3"}}
    for mode in args.modes.split(","):
        env = modes[mode]
        with LoopbackCluster(args.members, env=env) as c:
            formed = c.form(str(model), concurrency=k)
            plan = formed["status"]["plan"]
            print(f"[{mode}] formed in {formed['form_s']:.1f} s; blocks {plan['blocks']}, "
                  f"predicted bottleneck {plan['bottleneck_s'] * 1e3:.2f} ms")
            for n in (1, k):
                samples = [aggregate_tps(c, n, args.tokens) for _ in range(args.runs + 1)][1:]
                rates[(mode, n)] = statistics.median(samples)
                print(f"[{mode}] {n} concurrent: {rates[(mode, n)]:.1f} tokens/s aggregate "
                      f"(rounds: {', '.join(f'{s:.1f}' for s in samples)})")
                st = c.call(0, "status")
                gen = st.get("last_generation") or {}
                stages = {s[0]: round(s[3] * 1e3, 2) for s in gen.get("stats", [])}
                print(f"[{mode}] {n} concurrent: the last request's median decode stage ms by peer: {stages}")
            sched = st.get("schedule") or {}
            if sched:
                print(f"[{mode}] schedule: M={sched.get('micro_batches')} (most in flight "
                      f"{sched.get('max_steps_in_flight')}), trials {sched.get('trials')}, "
                      f"steps {sched.get('decode_steps')}, rows {sched.get('decode_rows')}")
    names = args.modes.split(",")
    for n in (1, k):
        for other in names[1:]:
            print(f"{n} concurrent: {names[0]} / {other} = {rates[(names[0], n)] / rates[(other, n)]:.2f}")
    for mode in names:
        print(f"{mode}: {k} concurrent / 1 = {rates[(mode, k)] / rates[(mode, 1)]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
