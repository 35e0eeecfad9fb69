#!/usr/bin/env python3
"""Benchmark: one decode step of a model's blocks in one process, whole and split into the ring's
stages (no network, no daemons), to tell the compute a split costs from what the ring adds.

Each step runs the head's `head_sample_and_run` (sample + embed + its blocks) and then every later
stage's `run` on the activations taken through the wire format (`array_to_wire` /
`array_from_wire`), as kafilad/node/serving/ring.py does; it prints the median of `--steps` steps per
stage and in all, whole then split, twice (the second pair is the figure; the first warms up).

    python scripts/bench_stage_split.py MODEL_DIR [--split 0:3,3:6,6:8] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import kafilad.executor  # noqa: F401 - loads the optimised BLAS before mlx (DESIGN §6)
from kafilad.executor.runner import StageRunner, array_from_wire, array_to_wire
from kafilad.executor.stage import load_stage_from_dir


def step_ms(model_dir: str, parts: list[tuple[int, int]], steps: int) -> tuple[float, list[float]]:
    """(median ms of a whole step, median ms of each stage) over `steps` decode steps."""
    runners = [StageRunner(load_stage_from_dir(model_dir, s, e, i == 0)) for i, (s, e) in enumerate(parts)]
    h = runners[0].head_embed_and_run("r", list(range(1, 20)))
    for r in runners[1:]:
        h = r.run("r", h)
    per: list[list[float]] = [[] for _ in runners]
    total: list[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _, h = runners[0].head_sample_and_run("r", h)
        per[0].append(time.perf_counter() - t0)
        for i, r in enumerate(runners[1:], 1):
            t = time.perf_counter()
            h = r.run("r", array_from_wire(array_to_wire(h)))
            per[i].append(time.perf_counter() - t)
        total.append(time.perf_counter() - t0)
    for r in runners:
        r.drop("r")
    return 1e3 * statistics.median(total), [1e3 * statistics.median(p) for p in per]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--split", default=None, help="stages as START:END,... (default: 3 blocks each)")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args(argv)
    n = int(json.loads((Path(args.model_dir) / "config.json").read_text())["num_hidden_layers"])
    parts = ([tuple(int(x) for x in p.split(":")) for p in args.split.split(",")] if args.split
             else [(s, min(s + 3, n)) for s in range(0, n, 3)])
    for _ in range(2):
        whole, _ = step_ms(args.model_dir, [(0, n)], args.steps)
        split, per = step_ms(args.model_dir, parts, args.steps)
    print(f"{args.model_dir}: one decode step, whole {whole:.2f} ms; split {parts} {split:.2f} ms "
          f"(stages {', '.join(f'{x:.2f}' for x in per)} ms); split ÷ whole {split / whole:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
