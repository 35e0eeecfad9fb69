#!/usr/bin/env python3
"""Planner benchmark on the example fleets (issue 4 item 5; DESIGN §5.5, §1 reference results).

For every fleet in fleets/*.json and every Qwen3 shape (8B, 14B, 32B, bf16 as stored), prints
Kafila's bottleneck, utilisation and imbalance, and for the uniform and memory-proportional
baselines the ratio of their bottleneck to Kafila's and their utilisation and imbalance.
A baseline that cannot place the model shows "no fit" (naming the short device).

The model directories are header-only (scripts/make_model_headers.py); they are generated in a
temporary directory unless --models-dir names existing ones. Numbers are predictions from
nominal specifications (a what-if), not measurements.

Usage:
    python scripts/bench_planner.py [--models-dir DIR] [--markdown] [--plot FILE.png]
        [--context 4096] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import runpy
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kafilad.errors import PlanError  # noqa: E402
from kafilad.modelinfo import read_model_info  # noqa: E402
from kafilad.planner import Plan, load_fleet, plan  # noqa: E402

MODELS = ("qwen3-8b", "qwen3-14b", "qwen3-32b")


def bench(models_dir: Path, context: int, concurrency: int) -> list[dict]:
    """One row per fleet x model: {fleet, model, kafila, uniform, memory} (Plan or PlanError)."""
    rows = []
    for fpath in sorted((REPO / "fleets").glob("*.json")):
        fleet = load_fleet(fpath)
        for m in MODELS:
            prof = read_model_info(models_dir / m).profile()
            row = {"fleet": fpath.stem, "model": m}
            for s in ("kafila", "uniform", "memory"):
                try:
                    row[s] = plan(fleet.devices, prof, context=context, concurrency=concurrency, strategy=s)
                except PlanError as e:
                    row[s] = e
            rows.append(row)
    return rows


def _cells(row: dict) -> list[str]:
    k = row["kafila"]
    if not isinstance(k, Plan):
        short = getattr(k, "device", "?")
        return [f"no fit ({short})"] + ["-"] * 8
    out = [f"{k.bottleneck_s * 1e3:.1f}", f"{k.utilization:.0%}", f"{k.imbalance:.2f}"]
    for s in ("uniform", "memory"):
        p = row[s]
        if isinstance(p, Plan):
            out += [f"{p.bottleneck_s / k.bottleneck_s:.2f}x", f"{p.utilization:.0%}", f"{p.imbalance:.2f}"]
        else:
            out += [f"no fit ({getattr(p, 'device', '?')})", "-", "-"]
    return out


HEAD = ["fleet", "model", "kafila ms", "util", "imbal", "uniform ÷ kafila", "util", "imbal",
        "memory ÷ kafila", "util", "imbal"]


def print_table(rows: list[dict], markdown: bool) -> None:
    table = [HEAD] + [[r["fleet"], r["model"], *_cells(r)] for r in rows]
    if markdown:
        print("| " + " | ".join(HEAD) + " |")
        print("|" + "|".join(["---"] * 2 + ["---:"] * (len(HEAD) - 2)) + "|")
        for t in table[1:]:
            print("| " + " | ".join(t) + " |")
        return
    w = [max(len(t[i]) for t in table) for i in range(len(HEAD))]
    for t in table:
        print("  ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(t)))


def check_done(rows: list[dict]) -> list[str]:
    """Fleet x model rows meeting issue 4's bar: uniform > 3x, memory > 2x, Kafila util > 75%."""
    ok = []
    for r in rows:
        k, u, m = r["kafila"], r["uniform"], r["memory"]
        if all(isinstance(p, Plan) for p in (k, u, m)) and k.utilization > 0.75 \
                and u.bottleneck_s / k.bottleneck_s > 3 and m.bottleneck_s / k.bottleneck_s > 2:
            ok.append(f"{r['fleet']}/{r['model']}")
    return ok


def plot_ratios(rows: list[dict], path: Path) -> None:
    """Grouped bars: baseline bottleneck ÷ Kafila's per fleet x model (log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if isinstance(r["kafila"], Plan)]
    labels = [f"{r['fleet']}\n{r['model'].replace('qwen3-', '')}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.8 * len(rows) + 2), 4.2))
    for k, s in enumerate(("uniform", "memory")):
        xs = [i + (k - 0.5) * 0.38 for i in range(len(rows))]
        ys = [r[s].bottleneck_s / r["kafila"].bottleneck_s if isinstance(r[s], Plan) else 0 for r in rows]
        ax.bar(xs, ys, 0.38, label=f"{s} ÷ kafila")
        for x, y, r in zip(xs, ys, rows):
            ax.annotate("no fit" if y == 0 else f"{y:.1f}", (x, max(y, 1.0)), ha="center", va="bottom",
                        fontsize=6, rotation=90)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("bottleneck ratio (higher = Kafila better)")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_title("Slowest stage of the baselines relative to Kafila (predicted, nominal specs)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Planner benchmark on fleets/*.json")
    ap.add_argument("--models-dir", type=Path, default=None)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--plot", type=Path, default=None)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        models_dir = a.models_dir
        if models_dir is None:
            make = runpy.run_path(str(REPO / "scripts" / "make_model_headers.py"))["make_model"]
            models_dir = Path(tmp)
            for m in MODELS:
                make(models_dir, m, "single")
        rows = bench(models_dir, a.context, a.concurrency)
    print_table(rows, a.markdown)
    done = check_done(rows)
    print(f"\nuniform > 3x, memory > 2x and Kafila utilisation > 75% on: {', '.join(done) or 'none'}")
    if a.plot:
        plot_ratios(rows, a.plot)
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
