#!/usr/bin/env python3
"""Validate the planner's cost model against real stages under cgroup CPU quotas (issue 4 item 6).

DESIGN §5.1 predicts a stage's per-token time as

    stage_s = step_overhead_s + (Σ block_bytes + [head] * head_read_bytes) / bandwidth_Bps

with `bandwidth_Bps` and `step_overhead_s` measured by the member's own probe
(kafilad.executor.probe.measure_capability, exactly what a daemon reports to the host). Here the
probe runs ONCE per model, unthrottled, and a slower device is emulated by a cgroup v1 CPU quota
q (DESIGN §9 item 4; ../shared/fleet-emulation.md; scripts/cg.sh): a device at quota q is
predicted to have bandwidth q × base and overhead base / q, i.e. stage_s(q) = stage_s(1) / q.
Block and head bytes come from the safetensors headers as the planner reads them
(kafilad.modelinfo ... .profile(float_dtype_bytes=4): the daemon holds f32), and the prediction
is computed by the planner's own kafilad.planner.ChainCost.

Each stage is loaded by kafilad.executor.stage.load_stage_from_dir in its own child process
(unthrottled), which then moves itself into each quota's CPU group in turn and runs decode steps
back to back for a window of >= 5 s (DESIGN §9: window means, not per-step medians; a busy
process; OPENBLAS_NUM_THREADS=1; 10 ms CFS period). A step is one token through the stage at a
fixed context: embedding + blocks + final norm + lm_head + argmax on the head, blocks elsewhere.

Printed: a table (model, stage, quota, predicted ms, measured ms, ratio, CPU share obtained) and
the median absolute relative error, overall and per model. `--json FILE` also writes every row.
Needs root and cgroup v1 (/sys/fs/cgroup/cpu). Runtime about 3-4 minutes with the defaults.

Usage: sudo python scripts/validate_cost_model.py [--quotas 100,50,25,10] [--window-s 5]
           [--stories DIR] [--no-stories] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CG = REPO / "scripts" / "cg.sh"
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000  # DESIGN §9: the default 100 ms period makes steps bimodal
#: tokens of context every measured step attends over (kept fixed: the cost model has no KV term).
CONTEXT_TOKENS = 32
#: a synthetic Llama whose blocks take milliseconds (about 48 MiB of f32 weights per block).
SYNTH_PARAMS = {"arch": "llama", "seed": 1, "num_hidden_layers": 8, "hidden_size": 1024,
                "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8}
DEFAULT_STORIES = REPO.parent / "shared" / "models" / "stories260K"


def stages_for(n_blocks: int) -> list[tuple[int, int, bool]]:
    """The stages measured on an n-block model: a 3-way split (head first) and the whole model."""
    a, b = max(1, n_blocks * 3 // 8), max(2, n_blocks * 3 // 4)
    return [(0, a, True), (a, b, False), (b, n_blocks, False), (0, n_blocks, True)]


# ---------------------------------------------------------------- children (run under quotas) --
def child_probe(model_dir: str) -> dict:
    import kafilad.executor as ex
    from kafilad.executor.probe import measure_capability

    t = time.perf_counter()
    cap = measure_capability(model_dir)
    cap["probe_s"] = time.perf_counter() - t
    cap["blas"] = ex.blas_status()
    return cap


def child_measure(model_dir: str, start: int, end: int, head: bool, quotas: list[int], window_s: float) -> dict:
    import kafilad.executor  # noqa: F401  (OpenBLAS before mlx)
    import mlx.core as mx
    from kafilad.executor.stage import load_stage_from_dir

    stage = load_stage_from_dir(model_dir, start, end, head)
    D = int(stage.config["hidden_size"])
    cache = stage.make_cache()
    if head:
        mx.eval(stage.run_blocks(stage.embed([1] * CONTEXT_TOKENS), cache))
    else:
        mx.eval(stage.run_blocks(mx.full((1, CONTEXT_TOKENS, D), 0.1), cache))
    h_in = mx.full((1, 1, D), 0.1)
    mx.eval(h_in)

    def step() -> None:
        if head:
            out = mx.argmax(stage.logits(stage.run_blocks(stage.embed([3]), cache)), axis=-1)
        else:
            out = stage.run_blocks(h_in, cache)
        mx.eval(out)
        for c in cache:  # keep the context fixed: the same step every time
            c.offset -= 1

    def window(seconds: float) -> tuple[int, float, float]:
        n, c0, t0 = 0, time.process_time(), time.perf_counter()
        while True:
            step()
            n += 1
            el = time.perf_counter() - t0
            if el >= seconds:
                return n, el, time.process_time() - c0

    rows = []
    for q in quotas:
        group = CPU_CGROUP / f"fleet_vq{q}"
        (group / "cgroup.procs").write_text(str(os.getpid()))
        thr0 = _cpu_stat(group)
        window(0.5)  # settle into the quota's rhythm
        n, el, cpu = window(window_s)
        thr1 = _cpu_stat(group)
        rows.append({"quota_pct": q, "steps": n, "window_s": el, "measured_s": el / n, "cpu_share": cpu / el,
                     "throttled_periods": thr1.get("nr_throttled", 0) - thr0.get("nr_throttled", 0)})
    (CPU_CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    return {"nbytes": stage.nbytes(), "rows": rows}


def _cpu_stat(group: Path) -> dict:
    out = {}
    for line in (group / "cpu.stat").read_text().splitlines():
        k, v = line.split()
        out[k] = int(v)
    return out


# ------------------------------------------------------------------------------ the parent --
def run_child(args: list[str]) -> dict:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"child {args[:2]} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def predict_s(model_dir: str, start: int, end: int, head: bool, bandwidth_Bps: float, overhead_s: float,
              quota: float) -> tuple[float, int]:
    """(planner's stage_s for a device at `quota` of the probed speed, bytes read per step)."""
    from kafilad.modelinfo import read_model_info
    from kafilad.planner import ChainCost, Device

    profile = read_model_info(model_dir).profile(float_dtype_bytes=4)
    dev = Device(name="d", memory_bytes=1 << 40, bandwidth_Bps=bandwidth_Bps * quota,
                 step_overhead_s=overhead_s / quota)
    other = Device(name="h", memory_bytes=1 << 40, bandwidth_Bps=bandwidth_Bps)
    chain = [dev] if head else [other, dev]
    cost = ChainCost(chain, profile, context=CONTEXT_TOKENS, concurrency=1, tier="cost-model")
    j = 0 if head else 1
    nbytes = sum(profile.block_bytes[start:end]) + (profile.head_read_bytes if head else 0)
    return cost.stage_s(j, start, end), nbytes


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quotas", default="100,50,25,10", help="CPU quotas in percent of one core")
    ap.add_argument("--window-s", type=float, default=5.0, help="seconds per measured window (>= 5, DESIGN §9)")
    ap.add_argument("--stories", default=str(DEFAULT_STORIES), help="stories260K model dir")
    ap.add_argument("--no-stories", action="store_true")
    ap.add_argument("--synth-dir", default=None, help="cache dir for the synthetic model")
    ap.add_argument("--json", default=None, help="write all rows to this JSON file")
    ap.add_argument("--child-probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-measure", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    quotas = [int(x) for x in a.quotas.split(",")]
    if a.child_probe:
        print(json.dumps(child_probe(a.child_probe)))
        return 0
    if a.child_measure:
        spec = json.loads(a.child_measure)
        print(json.dumps(child_measure(spec["model"], spec["start"], spec["end"], spec["head"], quotas, a.window_s)))
        return 0
    if not (CPU_CGROUP / "cgroup.procs").exists() or os.geteuid() != 0:
        print("needs root and cgroup v1 at /sys/fs/cgroup/cpu (DESIGN §9 item 4)", file=sys.stderr)
        return 1

    from kafilad.executor.synth import default_synth_model_dir
    from kafilad.modelinfo import read_model_info

    t_start = time.perf_counter()
    models = [("synth-llama-1024x8", str(default_synth_model_dir(a.synth_dir, **SYNTH_PARAMS)))]
    if not a.no_stories and (Path(a.stories) / "config.json").exists():
        models.append(("stories260K", str(Path(a.stories).resolve())))
    for q in quotas:
        subprocess.run(["bash", str(CG), "mk", f"vq{q}", str(q), "0", str(PERIOD_US)], check=True,
                       capture_output=True)
    print(f"cost-model validation · quotas {quotas}% of one core · {a.window_s:g} s windows · "
          f"context {CONTEXT_TOKENS} · load average {loadavg()}")
    rows = []
    try:
        for label, d in models:
            probe = run_child(["--child-probe", d])
            bw, ov = probe["bandwidth_Bps"], probe["step_overhead_s"]
            print(f"{label}: probe ({probe['bandwidth_source']}, {probe['probe_s']:.2f} s, {probe['blas']}): "
                  f"{bw / 1e9:.2f} GB/s + {ov * 1e6:.0f} us/step")
            n = read_model_info(d).num_hidden_layers
            for start, end, head in stages_for(n):
                spec = json.dumps({"model": d, "start": start, "end": end, "head": head})
                res = run_child(["--child-measure", spec, "--quotas", a.quotas, "--window-s", str(a.window_s)])
                for r in res["rows"]:
                    q = r["quota_pct"] / 100
                    pred, nbytes = predict_s(d, start, end, head, bw, ov, q)
                    rows.append({"model": label, "start": start, "end": end, "head": head, "bytes": nbytes,
                                 "held_bytes": res["nbytes"], "bandwidth_Bps": bw, "step_overhead_s": ov,
                                 "predicted_s": pred, **r})
                    print(f"  [{start},{end}){'H' if head else ' '} q={r['quota_pct']:3d}%  predicted "
                          f"{pred * 1e3:8.3f} ms  measured {r['measured_s'] * 1e3:8.3f} ms  "
                          f"ratio {pred / r['measured_s']:5.2f}  cpu {r['cpu_share']:.2f}  steps {r['steps']}",
                          flush=True)
    finally:
        for q in quotas:
            subprocess.run(["bash", str(CG), "rm", f"vq{q}"], capture_output=True)
    report(rows, models)
    print(f"load average after: {loadavg()} · total {time.perf_counter() - t_start:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"quotas": quotas, "window_s": a.window_s, "context": CONTEXT_TOKENS,
                                            "rows": rows}, indent=1))
    return 0


def report(rows: list[dict], models: list[tuple[str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="predicted vs measured per-stage time (window means)")
    for c in ("model", "stage", "MB read", "quota", "predicted ms", "measured ms", "error", "CPU share"):
        t.add_column(c, justify="left" if c in ("model", "stage") else "right")
    for r in rows:
        err = (r["predicted_s"] - r["measured_s"]) / r["measured_s"]
        t.add_row(r["model"], f"[{r['start']},{r['end']}){' head' if r['head'] else ''}", f"{r['bytes'] / 1e6:.2f}",
                  f"{r['quota_pct']}%", f"{r['predicted_s'] * 1e3:.3f}", f"{r['measured_s'] * 1e3:.3f}",
                  f"{err:+.1%}", f"{r['cpu_share']:.2f}")
    Console(width=120).print(t)

    def mare(rs):
        return statistics.median(abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rs)

    print(f"median absolute relative error: {mare(rows):.1%} over {len(rows)} stage x quota points "
          f"(published figure: 18%)")
    for label, _ in models:
        rs = [r for r in rows if r["model"] == label]
        if rs:
            print(f"  {label}: {mare(rs):.1%} (max {max(abs(r['predicted_s'] - r['measured_s']) / r['measured_s'] for r in rs):.1%})")


if __name__ == "__main__":
    sys.exit(main())
