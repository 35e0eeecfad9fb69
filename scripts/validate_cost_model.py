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

Printed: a table (model, stage, quota, measured ms, each prediction and its error, CPU share
obtained), the median absolute relative error per prediction (overall, per model, and over the
windows that got >= 95% of their quota), and CPU time per step at each quota relative to the
first (the emulation's own assumption). `--json FILE` also writes every row. Needs root and
cgroup v1 (/sys/fs/cgroup/cpu). Runtime about 3.5 minutes with the defaults. Results and their
caveats: docs/cost-model.md.

Three predictions are compared with each measurement: (1) the daemon's probe as it is, run once
unthrottled and scaled by the quota (the method of issue 4 item 6); (2) the previous daemon
probe, medians of 7 single steps instead of window means (`median7_stage_Bps`), once
unthrottled and scaled; (3) the daemon's block-timing probe run by the emulated device itself
inside its quota, as a real member measures itself (no scaling).

Children run at nice -15 by default (`--nice`), so other jobs on a shared machine do not steal
the unthrottled runs' CPU; the "CPU share" column shows what each window actually obtained.

Mixture-of-experts models (issue 21 item 4; `--moe`, or `--models` naming them): random models of
mlx-lm's own qwen3_moe and glm4_moe classes (MOE_MODELS), predicted from the bytes a token reads
(attention, router, shared expert and k of E routed experts; kafilad.planner.moe) and measured with
a different token each step, so that the router spreads the steps over the experts. The median of
measured / predicted per model is printed.

Usage: sudo python scripts/validate_cost_model.py [--quotas 100,50,25,10] [--window-s 5]
           [--models synth-llama,stories,...] [--moe] [--stories DIR] [--no-stories] [--nice N] [--json FILE]
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
#: synthesised mixture-of-experts models (issue 21 item 4): mlx-lm's own classes and ModelArgs, random
#: weights (kafilad.executor.synth.synthesize_mlx_model), at the attention and expert widths of
#: Qwen3-30B-A3B (hidden 2048, 32 heads of 128, 4 KV heads, experts 768 wide) and of a GLM-4.5-style
#: block (shared expert, first block dense), with fewer experts so that a block fits this machine's
#: memory (E and k scaled together for Qwen3: 2 of 32 is Qwen3-30B-A3B's 8 of 128). About 0.65 GB of
#: f32 per MoE block, of which a token reads 13% (Qwen3) and 19% (GLM).
MOE_MODELS = {
    "synth-qwen3moe-2048": dict(
        model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=4, intermediate_size=6144,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=32, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=768, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=258, tie_word_embeddings=False,
        max_position_embeddings=4096),
    "synth-glm4moe-2048": dict(
        model_type="glm4_moe", hidden_size=2048, num_hidden_layers=4, intermediate_size=3072,
        num_attention_heads=16, num_key_value_heads=2, head_dim=128, n_routed_experts=32, num_experts_per_tok=4,
        n_shared_experts=1, first_k_dense_replace=1, moe_intermediate_size=768, norm_topk_prob=True, n_group=1,
        topk_group=1, routed_scaling_factor=1.0, rms_norm_eps=1e-5, rope_theta=1e6, rope_scaling=None,
        use_qk_norm=False, attention_bias=True, partial_rotary_factor=0.5, vocab_size=258,
        tie_word_embeddings=False, max_position_embeddings=4096),
}
#: the models `--models` may name: the dense ones of issue 4 item 6 and the MoE ones above
MODEL_CHOICES = ("synth-llama", "stories", *MOE_MODELS)


def stages_for(n_blocks: int) -> list[tuple[int, int, bool]]:
    """The stages measured on an n-block model: a 3-way split (head first) and the whole model."""
    a, b = max(1, n_blocks * 3 // 8), max(2, n_blocks * 3 // 4)
    return [(0, a, True), (a, b, False), (b, n_blocks, False), (0, n_blocks, True)]


# ---------------------------------------------------------------- children (run under quotas) --
def median7_stage_Bps(config: dict, *, context_tokens: int = 16, dtype: str = "float32") -> tuple[float, float]:
    """The daemon's block-timing probe as it was before window means (probe.py at 9c66259), kept
    for comparison: median of 7 single steps through one block and through two, fitted as
    t(k) = overhead + k * block_bytes / Bps. Returns (bytes/s, overhead s)."""
    import mlx.core as mx
    from kafilad.executor.stage import build_random_stage

    n = min(2, int(config["num_hidden_layers"]))
    stage = build_random_stage(config, n, dtype=dtype)
    per_block_bytes = stage.nbytes() / n
    D = int(config["hidden_size"])
    cache = stage.make_cache()
    mx.eval(stage.run_blocks(mx.zeros((1, context_tokens, D), dtype=getattr(mx, dtype)), cache))
    h = mx.full((1, 1, D), 0.1, dtype=getattr(mx, dtype))
    layers = stage.layers

    def timed(k: int) -> float:
        stage.layers = layers[:k]

        def one():
            mx.eval(stage.run_blocks(h, cache[:k]))
            for c in cache[:k]:
                c.offset -= 1

        one()
        ts = []
        for _ in range(7):
            t = time.perf_counter()
            one()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    t1 = timed(1)
    t2 = timed(2) if n == 2 else None
    stage.layers = layers
    if t2 is None or t2 <= t1:
        return per_block_bytes / t1, 0.0
    return per_block_bytes / (t2 - t1), max(0.0, 2 * t1 - t2)


def child_probe(model_dir: str, quotas: list[int]) -> dict:
    """Unthrottled: the daemon's own probe (measure_capability) and the previous median-of-7
    probe; then the daemon's block-timing probe again inside each quota's CPU group (a device
    measuring itself, building its random blocks at its own speed too)."""
    import kafilad.executor as ex
    from kafilad.executor.probe import measure_capability, measure_stage_Bps
    from kafilad.modelinfo import read_model_info

    free = CPU_CGROUP / "fleet_vqfree" / "cgroup.procs"
    if free.exists():  # --shares: the unthrottled probe in an unlimited group of the same shares
        free.write_text(str(os.getpid()))
    t, c = time.perf_counter(), time.process_time()
    cap = measure_capability(model_dir)
    cap["probe_s"] = time.perf_counter() - t
    cap["probe_cpu_share"] = (time.process_time() - c) / cap["probe_s"]
    cap["blas"] = ex.blas_status()
    info = read_model_info(model_dir)
    config = info.config
    t = time.perf_counter()
    # the median-of-7 probe predates MoE timing (constant input, dense first blocks): not run on MoE models
    cap["legacy"] = median7_stage_Bps(config) if info.moe is None else None
    cap["legacy_probe_s"] = time.perf_counter() - t
    cap["self"] = {}
    for q in quotas:
        (CPU_CGROUP / f"fleet_vq{q}" / "cgroup.procs").write_text(str(os.getpid()))
        cap["self"][str(q)] = measure_stage_Bps(config)
        (CPU_CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    return cap


def child_measure(model_dir: str, start: int, end: int, head: bool, quotas: list[int], window_s: float) -> dict:
    import kafilad.executor  # noqa: F401  (OpenBLAS before mlx)
    import mlx.core as mx
    from kafilad.executor.stage import load_stage_from_dir

    from kafilad.executor.probe import token_inputs

    stage = load_stage_from_dir(model_dir, start, end, head)
    D = int(stage.config["hidden_size"])
    V = int(stage.config["vocab_size"])
    cache = stage.make_cache()
    if head:
        mx.eval(stage.run_tokens([1] * CONTEXT_TOKENS, cache))
    else:
        mx.eval(stage.run_blocks(mx.full((1, CONTEXT_TOKENS, D), 0.1), cache))
    # a different token every step (as in decoding): a MoE router sends each to its own experts
    pool = token_inputs(D, mx.float32, seed=17)
    turn = [0]

    def step() -> None:
        i = turn[0] = turn[0] + 1
        if head:
            out = mx.argmax(stage.logits(stage.run_tokens([(7 * i) % V], cache)), axis=-1)
        else:
            out = stage.run_blocks(pool[i % len(pool)], cache)
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


def child_paired(model_dir: str, start: int, end: int, head: bool, quotas: list[int], window_s: float) -> dict:
    """The stage and the daemon's probe blocks in one process, timed in alternating chunks under each
    quota (`--paired`): probe one block, probe two blocks, the stage, in turn (probe.py's
    `_interleaved_chunks_s`, 10 rounds), so that a neighbour's burst on this shared machine slows the
    probe and the stage alike. The probe's chunks are fitted as the daemon fits them
    (`fit_block_overhead_s`: bytes read per block / seconds per block, and the step overhead)."""
    import kafilad.executor  # noqa: F401  (OpenBLAS before mlx)
    import mlx.core as mx
    from kafilad.executor.probe import ProbeBlocks, _interleaved_chunks_s, fit_block_overhead_s, token_inputs
    from kafilad.executor.stage import load_stage_from_dir

    stage = load_stage_from_dir(model_dir, start, end, head)
    blocks = ProbeBlocks(stage.config)
    D, V = int(stage.config["hidden_size"]), int(stage.config["vocab_size"])
    cache = stage.make_cache()
    if head:
        mx.eval(stage.run_tokens([1] * CONTEXT_TOKENS, cache))
    else:
        mx.eval(stage.run_blocks(mx.full((1, CONTEXT_TOKENS, D), 0.1), cache))
    pool = token_inputs(D, mx.float32, seed=17)
    turn = [0]

    def step() -> None:
        i = turn[0] = turn[0] + 1
        if head:
            out = mx.argmax(stage.logits(stage.run_tokens([(7 * i) % V], cache)), axis=-1)
        else:
            out = stage.run_blocks(pool[i % len(pool)], cache)
        mx.eval(out)
        for c in cache:
            c.offset -= 1

    fns = [blocks.step(k) for k in range(1, blocks.n + 1)] + [step]
    rows = []
    for q in quotas:
        group = CPU_CGROUP / f"fleet_vq{q}"
        (group / "cgroup.procs").write_text(str(os.getpid()))
        t0, c0 = time.perf_counter(), time.process_time()
        for fn in fns:  # settle into the quota's rhythm
            fn()
        chunks = _interleaved_chunks_s(fns, 3, [window_s / 2] * blocks.n + [window_s], rounds=10)
        el, cpu = time.perf_counter() - t0, time.process_time() - c0
        per_block_s, overhead_s = fit_block_overhead_s(chunks[0], chunks[1] if blocks.n == 2 else None)
        st = chunks[-1]
        rows.append({"quota_pct": q, "steps": sum(n for _, n in st), "window_s": sum(x for x, _ in st),
                     "measured_s": sum(x for x, _ in st) / sum(n for _, n in st), "cpu_share": cpu / el,
                     "paired_bandwidth_Bps": blocks.per_block_bytes / per_block_s,
                     "paired_step_overhead_s": overhead_s, "throttled_periods": 0})
    (CPU_CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    return {"nbytes": stage.nbytes(), "rows": rows}


def _cpu_stat(group: Path) -> dict:
    out = {}
    for line in (group / "cpu.stat").read_text().splitlines():
        k, v = line.split()
        out[k] = int(v)
    return out


# ------------------------------------------------------------------------------ the parent --
def run_child(args: list[str], nice: int = 0) -> dict:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # the priority is set before the child starts any thread, so MLX's worker thread inherits it
    p = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True,
                       preexec_fn=(lambda: os.setpriority(os.PRIO_PROCESS, 0, nice)) if nice else None)
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
    nbytes = sum(profile.read_bytes[start:end]) + (profile.head_read_bytes if head else 0)
    return cost.stage_s(j, start, end), nbytes


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quotas", default="100,50,25,10", help="CPU quotas in percent of one core")
    ap.add_argument("--window-s", type=float, default=5.0, help="seconds per measured window (>= 5, DESIGN §9)")
    ap.add_argument("--stories", default=str(DEFAULT_STORIES), help="stories260K model dir")
    ap.add_argument("--no-stories", action="store_true")
    ap.add_argument("--models", default="synth-llama,stories",
                    help="comma-separated, of: " + ", ".join(MODEL_CHOICES) + " (default: the dense two)")
    ap.add_argument("--moe", action="store_true", help="the synthesised MoE models only (--models " +
                    ",".join(MOE_MODELS) + ")")
    ap.add_argument("--synth-dir", default=None, help="cache dir for the synthetic model")
    ap.add_argument("--json", default=None, help="write all rows to this JSON file")
    ap.add_argument("--nice", type=int, default=-15,
                    help="scheduling priority of the measuring children (default -15: shields them from other "
                         "jobs on a shared machine; a quota still caps them; 0 to measure as an ordinary process)")
    ap.add_argument("--child-probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shares", type=int, default=1024,
                    help="cpu.shares of the quota groups (default 1024, the kernel's; more shields the measured windows "
                         "from other jobs' groups on a busy shared machine, while the quota still caps them at 1 core)")
    ap.add_argument("--paired", action="store_true",
                    help="also time the daemon's probe blocks in the stage's own process, interleaved with it under "
                         "each quota, and predict from that (robust to a busy shared machine; default with --moe)")
    ap.add_argument("--child-measure", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-paired", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    quotas = [int(x) for x in a.quotas.split(",")]
    if a.child_probe:
        print(json.dumps(child_probe(a.child_probe, quotas)))
        return 0
    if a.child_measure:
        spec = json.loads(a.child_measure)
        print(json.dumps(child_measure(spec["model"], spec["start"], spec["end"], spec["head"], quotas, a.window_s)))
        return 0
    if a.child_paired:
        spec = json.loads(a.child_paired)
        print(json.dumps(child_paired(spec["model"], spec["start"], spec["end"], spec["head"], quotas, a.window_s)))
        return 0
    paired = a.paired or a.moe
    if not (CPU_CGROUP / "cgroup.procs").exists() or os.geteuid() != 0:
        print("needs root and cgroup v1 at /sys/fs/cgroup/cpu (DESIGN §9 item 4)", file=sys.stderr)
        return 1

    from kafilad.executor.synth import default_synth_model_dir
    from kafilad.modelinfo import read_model_info

    t_start = time.perf_counter()
    wanted = list(MOE_MODELS) if a.moe else [m for m in a.models.split(",") if m]
    unknown = [m for m in wanted if m not in MODEL_CHOICES]
    if unknown:
        print(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODEL_CHOICES)}", file=sys.stderr)
        return 2
    models = []
    for m in wanted:
        if m == "synth-llama":
            models.append(("synth-llama-1024x8", str(default_synth_model_dir(a.synth_dir, **SYNTH_PARAMS))))
        elif m == "stories":
            if not a.no_stories and (Path(a.stories) / "config.json").exists():
                models.append(("stories260K", str(Path(a.stories).resolve())))
        else:
            models.append((m, str(moe_model_dir(a.synth_dir, m))))
    for q in quotas:
        subprocess.run(["bash", str(CG), "mk", f"vq{q}", str(q), "0", str(PERIOD_US)], check=True,
                       capture_output=True)
        (CPU_CGROUP / f"fleet_vq{q}" / "cpu.shares").write_text(str(a.shares))
    if a.shares != 1024:  # the unthrottled probe gets the same shield (child_probe)
        subprocess.run(["bash", str(CG), "mk", "vqfree", "0", "0", str(PERIOD_US)], check=True, capture_output=True)
        (CPU_CGROUP / "fleet_vqfree" / "cpu.shares").write_text(str(a.shares))
    print(f"cost-model validation · quotas {quotas}% of one core · {a.window_s:g} s windows · "
          f"context {CONTEXT_TOKENS} · nice {a.nice} · cpu.shares {a.shares} · load average {loadavg()}")
    rows = []
    try:
        for label, d in models:
            probe = run_child(["--child-probe", d, "--quotas", a.quotas], a.nice)
            bw, ov = probe["bandwidth_Bps"], probe["step_overhead_s"]
            wbw, wov = probe["legacy"] or (None, None)
            print(f"{label}: daemon probe ({probe['bandwidth_source']}, {probe['probe_s']:.2f} s, CPU share "
                  f"{probe['probe_cpu_share']:.2f}, {probe['blas']}): "
                  f"{bw / 1e9:.3f} GB/s + {ov * 1e6:.0f} us/step; previous median-of-7 probe " +
                  (f"({probe['legacy_probe_s']:.2f} s): {wbw / 1e9:.3f} GB/s + {wov * 1e6:.0f} us/step"
                   if wbw else "not run (MoE)"))
            print("  daemon probe run under each quota: " + ", ".join(
                f"{q}%: {v[0] / 1e9:.3f} GB/s + {v[1] * 1e6:.0f} us" for q, v in probe["self"].items()))
            n = read_model_info(d).num_hidden_layers
            for start, end, head in stages_for(n):
                spec = json.dumps({"model": d, "start": start, "end": end, "head": head})
                res = run_child(["--child-paired" if paired else "--child-measure", spec, "--quotas", a.quotas,
                                 "--window-s", str(a.window_s)], a.nice)
                for r in res["rows"]:
                    q = r["quota_pct"] / 100
                    pred, nbytes = predict_s(d, start, end, head, bw, ov, q)
                    pred_w = predict_s(d, start, end, head, wbw, wov, q)[0] if wbw else None
                    sbw, sov = probe["self"][str(r["quota_pct"])]
                    pred_self, _ = predict_s(d, start, end, head, sbw, sov, 1.0)
                    pred_pair = (predict_s(d, start, end, head, r["paired_bandwidth_Bps"], r["paired_step_overhead_s"],
                                           1.0)[0] if paired else None)
                    rows.append({"model": label, "start": start, "end": end, "head": head, "bytes": nbytes,
                                 "held_bytes": res["nbytes"], "bandwidth_Bps": bw, "step_overhead_s": ov,
                                 "predicted_s": pred, "predicted_legacy_s": pred_w, "predicted_self_s": pred_self,
                                 "predicted_paired_s": pred_pair, **r})
                    m = r["measured_s"]
                    legacy = (f"median-of-7 probe {pred_w * 1e3:8.3f} ({pred_w / m - 1:+.0%})  " if pred_w else "")
                    print(f"  [{start},{end}){'H' if head else ' '} q={r['quota_pct']:3d}%  measured {m * 1e3:8.3f} ms"
                          f"  predicted: daemon probe {pred * 1e3:8.3f} ({pred / m - 1:+.0%}; measured/predicted "
                          f"{m / pred:.3f})  {legacy}self-probe {pred_self * 1e3:8.3f} "
                          f"({pred_self / m - 1:+.0%})  " +
                          (f"paired probe {pred_pair * 1e3:8.3f} (measured/predicted {m / pred_pair:.3f})  "
                           if pred_pair else "") + f"cpu {r['cpu_share']:.2f}  steps {r['steps']}", flush=True)
    finally:
        for q in quotas:
            subprocess.run(["bash", str(CG), "rm", f"vq{q}"], capture_output=True)
        subprocess.run(["bash", str(CG), "rm", "vqfree"], capture_output=True)
    report(rows, models)
    print(f"load average after: {loadavg()} · total {time.perf_counter() - t_start:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"quotas": quotas, "window_s": a.window_s, "context": CONTEXT_TOKENS,
                                            "rows": rows}, indent=1))
    return 0


PREDICTORS = (("predicted_s", "daemon probe (window means), once unthrottled, scaled by quota"),
              ("predicted_legacy_s", "previous daemon probe (median of 7), once unthrottled, scaled by quota"),
              ("predicted_self_s", "daemon probe run by the device under its own quota"),
              ("predicted_paired_s", "daemon probe blocks interleaved with the stage in its process (--paired)"))


def rel_err(r: dict, key: str) -> float:
    return (r[key] - r["measured_s"]) / r["measured_s"]


def median_abs_err(rows: list[dict], key: str) -> float:
    rows = [r for r in rows if r.get(key) is not None]
    return statistics.median(abs(rel_err(r, key)) for r in rows) if rows else float("nan")


def _cells(r: dict, key: str) -> tuple[str, str]:
    if r.get(key) is None:
        return "-", "-"
    return f"{r[key] * 1e3:.3f}", f"{rel_err(r, key):+.0%}"


def ratio_summary(rows: list[dict], key: str = "predicted_s") -> dict[str, float]:
    """model -> median of measured / predicted (by prediction `key`) over its rows that have one."""
    out = {}
    for lab in dict.fromkeys(r["model"] for r in rows):
        rs = [r["measured_s"] / r[key] for r in rows if r["model"] == lab and r.get(key)]
        if rs:
            out[lab] = statistics.median(rs)
    return out


def full_share(rows: list[dict]) -> list[dict]:
    """The rows whose window obtained >= 95% of its quota (a neighbour did not take the CPU)."""
    return [r for r in rows if r["cpu_share"] >= 0.95 * r["quota_pct"] / 100]


def report(rows: list[dict], models: list[tuple[str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="predicted vs measured per-stage time per token (window means); error = predicted/measured - 1")
    for c in ("model", "stage", "MB read", "MB held", "quota", "measured ms", "daemon probe ms", "err",
              "meas./pred.", "median-of-7 ms", "err", "self-probe ms", "err", "paired ms", "meas./pred.",
              "CPU share"):
        t.add_column(c, justify="left" if c in ("model", "stage") else "right")
    for r in rows:
        cells = {key: _cells(r, key) for key, _ in PREDICTORS}
        t.add_row(r["model"], f"[{r['start']},{r['end']}){' head' if r['head'] else ''}", f"{r['bytes'] / 1e6:.2f}",
                  f"{r['held_bytes'] / 1e6:.2f}", f"{r['quota_pct']}%", f"{r['measured_s'] * 1e3:.3f}",
                  *cells["predicted_s"], f"{r['measured_s'] / r['predicted_s']:.3f}",
                  *cells["predicted_legacy_s"], *cells["predicted_self_s"], cells["predicted_paired_s"][0],
                  f"{r['measured_s'] / r['predicted_paired_s']:.3f}" if r.get("predicted_paired_s") else "-",
                  f"{r['cpu_share']:.2f}")
    Console(width=180).print(t)
    print("median absolute relative error (published figure: 18%):")
    full = full_share(rows)
    for key, label in PREDICTORS:
        if not any(r.get(key) is not None for r in rows):
            continue
        per_model = "; ".join(f"{lab} {median_abs_err([r for r in rows if r['model'] == lab], key):.1%}"
                              for lab, _ in models if any(r["model"] == lab for r in rows))
        print(f"  {label}: {median_abs_err(rows, key):.1%} over {len(rows)} points ({per_model})"
              + (f"; {median_abs_err(full, key):.1%} over the {len(full)} windows that got >= 95% of their quota"
                 if full and len(full) < len(rows) else ""))
    for key, label in PREDICTORS:
        for what, rs in (("all windows", rows), (">= 95% of quota", full_share(rows))):
            summary = ratio_summary(rs, key)
            if summary:
                print(f"median measured / predicted, {label}, {what}: " + "; ".join(
                    f"{lab} {v:.3f} ({sum(1 for r in rs if r['model'] == lab)} points)" for lab, v in summary.items()))
    # the emulation's own assumption (DESIGN §9): CPU time per step does not depend on the quota
    print("CPU time per step relative to the same stage at the first quota (1.00 = step time exactly base/quota):")
    for lab, _ in models:
        for stage in sorted({(r["start"], r["end"], r["head"]) for r in rows if r["model"] == lab}):
            rs = [r for r in rows if r["model"] == lab and (r["start"], r["end"], r["head"]) == stage]
            base = rs[0]["measured_s"] * rs[0]["cpu_share"]
            print(f"  {lab} [{stage[0]},{stage[1]}){' head' if stage[2] else ''}: " + ", ".join(
                f"{r['quota_pct']}% {r['measured_s'] * r['cpu_share'] / base:.2f}" for r in rs))


def moe_model_dir(cache_dir, label: str) -> Path:
    """The synthesised MoE model `label` of MOE_MODELS, written once (kafilad.executor.synth) under
    `cache_dir` (default: the user cache dir, as the dense synthetic model) and reused."""
    import hashlib

    import platformdirs

    cfg = MOE_MODELS[label]
    key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    base = Path(cache_dir) if cache_dir else Path(platformdirs.user_cache_dir("kafila")) / "models"
    target = base / f"{label}-{key}"
    if not (target / "config.json").exists():
        from kafilad.executor.synth import synthesize_mlx_model

        synthesize_mlx_model(target.with_name(target.name + ".tmp"), cfg, seed=1)
        os.replace(target.with_name(target.name + ".tmp"), target)
    return target


if __name__ == "__main__":
    sys.exit(main())
