#!/usr/bin/env python3
"""Benchmark: a 3-daemon relayed ring vs single-process mlx-lm, in one run (DESIGN §8).

Prints the time to form the session, decode tokens/s of the ring and of single-process mlx-lm on
the same model (median of 4 generations after one discarded cold one), their ratio, and the bytes
the rendezvous relayed per generated token.

    python scripts/bench_ring.py [--model DIR] [--members 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import kafilad.executor  # noqa: F401 - loads the optimised BLAS before mlx (DESIGN §6)
from kafila_ctl.demo import LoopbackCluster
from kafilad.proto.rendezvous import parse_relay_record


def single_process_tps(model_dir: str, prompt: str, tokens: int) -> float:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    model, tok = load(model_dir)
    ids = mx.array(tok.encode(prompt))
    rates = []
    for run in range(5):
        t_first = None
        n = 0
        for (t, _), _ in zip(generate_step(ids, model, max_tokens=tokens), range(tokens)):
            mx.eval(t)
            n += 1
            if t_first is None:
                t_first = time.perf_counter()
        rate = (n - 1) / (time.perf_counter() - t_first)
        if run:
            rates.append(rate)
    return statistics.median(rates)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K"
    ap.add_argument("--model", default=str(default) if default.exists() else None)
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", default="Once upon a time")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from kafilad.executor.synth import default_synth_model_dir
        model = str(default_synth_model_dir())
    print(f"model {model}, {args.members} daemons on loopback, {args.tokens} tokens per generation")
    results = {}
    for mode in ("relayed", "direct"):
        env = {"KAFILA_DIRECT": "0" if mode == "relayed" else "1"}
        with LoopbackCluster(args.members, record_relay=True, env=env) as c:
            formed = c.form(model)
            edges = [e["path"] for e in formed["status"].get("edges", [])]
            print(f"[{mode}] time to form the session: {formed['form_s']:.2f} s "
                  f"(blocks {formed['status']['plan']['blocks']}, head {formed['status']['plan']['head']}, edges {edges})")
            rates, tokens_total = [], 0
            relayed_before = sum(len(p) for _, p in parse_relay_record(c.record_path.read_bytes()))
            for run in range(5):
                r = c.generate(args.prompt, args.tokens)
                tokens_total += len(r["token_ids"])
                if run and r.get("decode_tokens_per_s"):
                    rates.append(r["decode_tokens_per_s"])
            relayed = sum(len(p) for _, p in parse_relay_record(c.record_path.read_bytes())) - relayed_before
            results[mode] = statistics.median(rates)
            print(f"[{mode}] relayed through the rendezvous during generation: {relayed} bytes for {tokens_total} "
                  f"tokens = {relayed / tokens_total:.0f} bytes per generated token (prefill included)")
    single_tps = single_process_tps(model, args.prompt, args.tokens)
    print(f"single-process mlx-lm: {single_tps:.1f} tokens/s")
    for mode, tps in results.items():
        print(f"ring ({mode} edges): {tps:.1f} tokens/s; ratio ring/single = {tps / single_tps:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
