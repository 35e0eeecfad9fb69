#!/usr/bin/env python3
"""The load objective on the example fleets (issue 12 item 2; docs/planner.md "Throughput and
the load objective"): predicted tokens/s of the paper's division (strategy kafila) and of
strategy load, for 1 user and for K users, with the members load leaves on standby.

    python scripts/bench_load_objective.py [--users 1,4,16] [--context 4096] [--markdown]

Header-only Qwen3 models are generated in a temporary directory (scripts/make_model_headers.py);
weights as stored (bf16). Predictions from nominal specifications, not measurements.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kafilad.errors import PlanError  # noqa: E402
from kafilad.modelinfo import read_model_info  # noqa: E402
from kafilad.planner import load_fleet, plan  # noqa: E402

MODELS = ("qwen3-8b", "qwen3-14b", "qwen3-32b")


def _cell(p) -> str:
    return "no fit" if isinstance(p, PlanError) else f"{p.throughput[-1].tokens_per_s:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", default="1,4,16")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    users = [int(x) for x in args.users.split(",")]
    make = runpy.run_path(str(REPO / "scripts" / "make_model_headers.py"))["make_model"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            make(Path(tmp), name, "single")
        for fleet_path in sorted((REPO / "fleets").glob("*.json")):
            fleet = load_fleet(fleet_path)
            for name in MODELS:
                prof = read_model_info(Path(tmp) / name).profile()
                for k in users:
                    out = {}
                    t0 = time.perf_counter()
                    for s in ("kafila", "load"):
                        try:
                            out[s] = plan(fleet.devices, prof, context=args.context, concurrency=k, strategy=s)
                        except PlanError as e:
                            out[s] = e
                    dt = time.perf_counter() - t0
                    kp, lp = out["kafila"], out["load"]
                    gain = (f"{lp.throughput[-1].tokens_per_s / kp.throughput[-1].tokens_per_s:.2f}x"
                            if not isinstance(kp, PlanError) and not isinstance(lp, PlanError) else "-")
                    standby = ", ".join(lp.standby) if not isinstance(lp, PlanError) else "-"
                    rows.append((fleet_path.stem, name, k, _cell(kp), _cell(lp), gain, standby or "none", f"{dt:.2f}"))
    head = ("fleet", "model", "users", "kafila tok/s", "load tok/s", "load ÷ kafila", "load standby", "plan s")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|---|---|---:|---:|---:|---:|---|---:|")
        for r in rows:
            print("| " + " | ".join(str(x) for x in r) + " |")
    else:
        for r in rows:
            print("  ".join(str(x) for x in r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
