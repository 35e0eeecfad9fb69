"""scripts/bench_fleet.py's reading of the results: stage rows, sub-fleets, ratios against issue 12's
targets, the summary over several runs, and the plot."""

from __future__ import annotations

import itertools
import json
import re
import statistics
from pathlib import Path
from typing import Optional, Sequence

from kafilad.planner import DEFAULT_STRATEGY


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def throughput_at(plan: dict, users: int) -> Optional[float]:
    """The plan's predicted tokens/s at `users` concurrent requests (its `throughput` rows), or None."""
    for row in plan.get("throughput") or []:
        if int(row.get("users", 0)) == users:
            return float(row["tokens_per_s"])
    return None


def stage_rows(status: dict) -> list[dict]:
    """Per ring member: predicted stage s, measured window mean and median from the last generation.

    `status` is the host's status snapshot; its `last_generation.stats` rows are the `end` frame's
    [peer_id, steps, compute_s_total, decode_stage_s_median, bytes_sent] (kafilad/proto/scheduler.py
    StageStats.take_row). The window mean is compute_s_total / steps (prefill pass included).
    Returns rows in ring order: {name, blocks, predicted_s, mean_s, median_s, steps, mean_ratio, median_ratio}.
    """
    plan = status.get("plan") or {}
    by_peer = {m["peer_id"]: m for m in status.get("members", [])}
    stats = {row[0]: row for row in (status.get("last_generation") or {}).get("stats", [])}
    out = []
    for name in plan.get("order", []):
        member = next((m for m in by_peer.values() if m["name"] == name), None)
        row = stats.get(member["peer_id"]) if member else None
        predicted = (plan.get("stage_s") or {}).get(name)
        mean_s = (row[2] / row[1]) if row and row[1] else None
        median_s = row[3] if row else None
        out.append({"name": name, "blocks": (plan.get("blocks") or {}).get(name), "predicted_s": predicted,
                    "mean_s": mean_s, "median_s": median_s, "steps": row[1] if row else 0,
                    "mean_ratio": ratio(mean_s, predicted), "median_ratio": ratio(median_s, predicted)})
    return out


def saturated_stage_rows(status: dict) -> list[dict]:
    """Per ring member, under load: the last saturated request's median decode stage time against the
    plan's stage time scaled to the rows its steps carried, t · (1 + ρ·(B − 1)) (kafilad/planner/
    throughput.py; ρ the member's measured `batch_row_cost`, 1.0 when unknown, as the planner takes
    it; B the median rows of that request's steps, `last_generation.batch_rows_median`).

    Returns rows in ring order: {name, rows, rho, predicted_s, median_s, median_ratio}.
    """
    plan = status.get("plan") or {}
    gen = status.get("last_generation") or {}
    rows = gen.get("batch_rows_median") or 1
    rho = {d.get("name"): d.get("batch_row_cost") for d in ((status.get("fleet") or {}).get("devices") or [])}
    by_name = {m["name"]: m for m in status.get("members", [])}
    stats = {row[0]: row for row in gen.get("stats", [])}
    out = []
    for name in plan.get("order", []):
        member = by_name.get(name)
        row = stats.get(member["peer_id"]) if member else None
        r = rho.get(name)
        t = (plan.get("stage_s") or {}).get(name)
        predicted = t * (1 + (1.0 if r is None else r) * (rows - 1)) if t is not None else None
        median_s = row[3] if row else None
        out.append({"name": name, "rows": rows, "rho": r, "predicted_s": predicted, "median_s": median_s,
                    "median_ratio": ratio(median_s, predicted)})
    return out


def sub_fleets(fleet_json: dict, *, min_size: int = 1) -> list[dict]:
    """Every proper subset of the fleet's devices (the anchor kept first), as fleet objects."""
    devices = fleet_json["devices"]
    out = []
    for size in range(min_size, len(devices)):
        for combo in itertools.combinations(devices, size):
            names = {d["name"] for d in combo}  # the measured edges between the subset's devices only
            edges = [e for e in fleet_json.get("edges") or [] if {e.get("from"), e.get("to")} <= names]
            out.append({**fleet_json, "devices": list(combo), **({"edges": edges} if "edges" in fleet_json else {})})
    return out


def predict_sub_fleets(fleet_json: dict, model_dir: str, *, context: int) -> list[dict]:
    """The planner's predicted 1-user tokens/s (strategy kafila, concurrency 1) of every proper
    sub-fleet that fits, best first: [{names, tokens_per_s, blocks}]."""
    from kafilad.errors import KafilaError
    from kafilad.modelinfo import read_model_info
    from kafilad.planner import load_fleet, plan
    profile = read_model_info(model_dir).profile(float_dtype_bytes=4)  # CPU members hold f32 (DESIGN §6)
    out = []
    for sub in sub_fleets(fleet_json):
        try:
            f = load_fleet(sub)  # with the ring edges' measured round trips where the fleet carries them
            p = plan(f.devices, profile, context=context, concurrency=1, strategy="kafila",
                     measured_rtt_ms=f.rtt_ms).to_json()
        except KafilaError:
            continue  # does not fit, or fewer blocks than devices
        out.append({"names": [d["name"] for d in sub["devices"]], "tokens_per_s": throughput_at(p, 1),
                    "blocks": p["blocks"]})
    return sorted(out, key=lambda r: -(r["tokens_per_s"] or 0))


def predict_strategies(fleet_json: dict, model_dir: str, *, context: int, concurrency: int) -> dict:
    """The planner's saturated tokens/s at `concurrency` of every division on ONE fleet: {strategy:
    tokens/s, or None where it cannot place the model}. Given the default session's fleet (the
    devices as its members measured themselves), a predicted gain then compares divisions of the
    same devices; each strategy's own session re-probes its members, and those probes differ by up
    to 1.5x from session to session on a slow quota, which the cross-session ratio mixes in."""
    from kafilad.errors import KafilaError
    from kafilad.modelinfo import read_model_info
    from kafilad.planner import load_fleet, plan
    profile = read_model_info(model_dir).profile(float_dtype_bytes=4)  # CPU members hold f32 (DESIGN §6)
    fleet = load_fleet(fleet_json)  # its `edges`: the round trips the session measured (issue 24)
    out: dict = {}
    for strategy in ("load", "kafila", "uniform", "memory"):
        try:
            out[strategy] = throughput_at(plan(fleet.devices, profile, context=context, concurrency=concurrency,
                                               strategy=strategy, measured_rtt_ms=fleet.rtt_ms).to_json(), concurrency)
        except KafilaError:
            out[strategy] = None
    return out


def _stage_dev(measured: dict) -> Optional[float]:
    """Worst |measured/predicted − 1| over one strategy's stages: under load when measured (quotas
    model saturated throughput well, a lone request badly: an idle member bursts above its quota,
    DESIGN §9), else the 1-user window means. None when nothing was measured."""
    ratios = ([r["median_ratio"] for r in measured.get("saturated_stages", []) if r["median_ratio"]]
              or [r["mean_ratio"] for r in measured.get("stages", []) if r["mean_ratio"]])
    return max(abs(r - 1) for r in ratios) if ratios else None


def memory_use(res: dict) -> tuple[Optional[float], Optional[int]]:
    """(the largest peak / limit of any member's memory group over every session, the times any group
    hit its limit in all), from each session's `cgroup_stat` lines (scripts/cg.sh stat:
    "NAME: ... mem_peak_MB=N failcnt=K") and the fleet's MEM_MB; (None, None) without cgroups."""
    limits = {}
    for part in str(res.get("fleet") or "").split(","):
        bits = part.split(":")
        if len(bits) == 3:
            limits[bits[0]] = float(bits[2])
    peaks, hits = [], 0
    for rec in list((res.get("strategies") or {}).values()) + [res.get("load_at_1") or {}]:
        for line in rec.get("cgroup_stat") or []:
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            group = line.split(":", 1)[0]
            limit = next((v for k, v in limits.items() if group == k or group.endswith(("_" + k, "-" + k))), None)
            if "mem_peak_MB" in fields and limit:
                peaks.append(float(fields["mem_peak_MB"]) / limit)
            hits += int(fields.get("failcnt", 0) or 0)
    return (max(peaks) if peaks else None), (hits if peaks else None)


def summary_ratios(res: dict) -> dict:
    """The ratios the issue's targets name, from the collected results (None where not measured).

    "Kafila" in the targets is the product: the host's default strategy (DEFAULT_STRATEGY,
    "load"); the paper's division ("kafila") is reported beside it."""
    strat = res.get("strategies", {})

    def sat(s):
        return (strat.get(s) or {}).get("saturated_tps")

    def one(s):
        return (strat.get(s) or {}).get("one_user_tps")
    best_sub = max([s["one_user_tps"] for s in res.get("sub_fleets_measured", []) if s.get("one_user_tps")],
                   default=None)
    load1 = (res.get("load_at_1") or {}).get("one_user_tps")
    peers = res.get("peers", {})
    def sat_predicted(s):
        return (strat.get(s) or {}).get("saturated_predicted_tps")
    one_fleet = res.get("predicted_on_default_fleet") or {}  # `predict_strategies`: divisions of the same devices
    gain = ratio(sat(DEFAULT_STRATEGY), sat("uniform"))
    gain_by_session = ratio(sat_predicted(DEFAULT_STRATEGY), sat_predicted("uniform"))
    gain_predicted = ratio(one_fleet.get(DEFAULT_STRATEGY), one_fleet.get("uniform")) if one_fleet else gain_by_session
    memory_peak, memory_hits = memory_use(res)
    return {
        "default_over_uniform_saturated": gain,
        "default_over_uniform_saturated_predicted": gain_predicted,
        "default_over_uniform_saturated_predicted_by_session": gain_by_session,
        "default_over_memory_saturated_predicted": ratio(one_fleet.get(DEFAULT_STRATEGY), one_fleet.get("memory")),
        "default_over_uniform_measured_over_predicted_gain": ratio(gain, gain_predicted),
        "default_over_memory_saturated": ratio(sat(DEFAULT_STRATEGY), sat("memory")),
        "default_stage_measured_over_predicted_max_dev": _stage_dev(strat.get(DEFAULT_STRATEGY) or {}),
        "memory_peak_over_limit_max": memory_peak,
        "memory_limit_hits": memory_hits,
        "kafila_over_uniform_saturated": ratio(sat("kafila"), sat("uniform")),
        "kafila_over_memory_saturated": ratio(sat("kafila"), sat("memory")),
        "kafila_stage_measured_over_predicted_max_dev": _stage_dev(strat.get("kafila") or {}),
        "one_user_load_at_1_over_best_sub_fleet": ratio(load1, best_sub),
        "one_user_kafila_full_fleet_over_best_sub_fleet": ratio(one("kafila"), best_sub),
        "ring_api_over_mlx_lm_single": ratio(peers.get("ring_api_decode_tps"), peers.get("mlx_lm_single_tps")),
        "ring_api_over_mlx_lm_pipeline": ratio(peers.get("ring_api_decode_tps"), peers.get("mlx_lm_pipeline_tps")),
    }


TARGETS = {  # ratio key -> (comparison, bound) from issue 12's targets ("Kafila": the default strategy)
    "default_over_uniform_saturated": (">=", 1.6),
    "default_over_memory_saturated": (">=", 1.3),
    "default_over_uniform_measured_over_predicted_gain": (">=", 0.9),  # issue 24 item 3
    "memory_limit_hits": ("<=", 0),  # no member reaches its memory limit (issue 24 item 3)
    "default_stage_measured_over_predicted_max_dev": ("<=", 0.10),
    "one_user_load_at_1_over_best_sub_fleet": (">=", 1.0),
    "ring_api_over_mlx_lm_single": (">=", 0.95),
    "ring_api_over_mlx_lm_pipeline": (">=", 1.5),
}


def verdicts(ratios: dict) -> dict:
    """key -> "met" / "not met" / "not measured" against TARGETS."""
    out = {}
    for key, (op, bound) in TARGETS.items():
        v = ratios.get(key)
        out[key] = "not measured" if v is None else ("met" if (v >= bound if op == ">=" else v <= bound) else "not met")
    return out


def plot(res: dict, path: Path) -> None:
    """Bars of saturated and 1-user tokens/s per strategy (measured and predicted), and the peers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    strat = res["strategies"]
    names = list(strat)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    x = range(len(names))
    w = 0.2
    for off, key, label in ((-1.5, "saturated_tps", "saturated, measured"),
                            (-0.5, "saturated_predicted_tps", "saturated, predicted"),
                            (0.5, "one_user_tps", "1 user, measured"), (1.5, "one_user_predicted_tps", "1 user, predicted")):
        ax1.bar([i + off * w for i in x], [strat[n].get(key) or 0 for n in names], w, label=label,
                hatch="//" if "predicted" in key else None, alpha=0.6 if "predicted" in key else 1.0)
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("tokens/s")
    ax1.set_title(f"emulated fleet {res['fleet']} (K={res['concurrency']})", fontsize=9)
    ax1.set_ylim(0, 1.3 * max([v for n in names for v in (strat[n].get("saturated_tps"), strat[n].get(
        "saturated_predicted_tps"), strat[n].get("one_user_tps")) if v] or [1]))
    ax1.legend(fontsize=7, ncol=2, loc="upper center")
    peers = res.get("peers") or {}
    labels = [("Kafila ring (API)", peers.get("ring_api_decode_tps")), ("mlx-lm single", peers.get("mlx_lm_single_tps")),
              ("mlx-lm pipeline", peers.get("mlx_lm_pipeline_tps"))]
    ax2.bar([l for l, _ in labels], [v or 0 for _, v in labels], color=["C0", "C2", "C3"])
    ax2.set_title(f"1 request, no quotas, {res.get('ranks', 3)} ranks", fontsize=9)
    ax2.set_ylabel("decode tokens/s")
    fig.suptitle(f"{res['model']} at {res.get('commit', '?')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def median_ratios(results: Sequence[dict]) -> dict:
    """key -> median over runs of each run's ratio (runs without it left out; None if none has it).
    Each run's ratios are computed again from its measurements (summary_ratios), so runs written
    before a ratio was added count too."""
    runs = [summary_ratios(r) for r in results]
    keys = dict.fromkeys(k for r in runs for k in r)
    out = {}
    for key in keys:
        vals = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(vals) if vals else None
    return out


def _model_dir_of(res: dict) -> Optional[str]:
    """The model directory of a run's JSON: its `model_dir`, or for older runs the synthesised
    model its `model` line names, where it is still cached (None otherwise)."""
    if res.get("model_dir"):
        return res["model_dir"]
    found = re.findall(r"hidden (\d+), (\d+) blocks", str(res.get("model")))
    if not found:
        return None
    from fleet_harness import model_dir_for
    path = model_dir_for(int(found[0][0]), int(found[0][1]))
    return str(path) if path.is_dir() else None


def summarize(paths: Sequence[Path]) -> int:
    """`--summarize`: the median of every ratio over several runs' JSON files, with the targets' verdicts."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    for r in results:  # runs written before `predicted_on_default_fleet` existed: predicted from their JSON
        fleet = ((r.get("strategies") or {}).get(DEFAULT_STRATEGY) or {}).get("fleet")
        model_dir = _model_dir_of(r)
        if "predicted_on_default_fleet" not in r and fleet and model_dir is not None:
            r["predicted_on_default_fleet"] = predict_strategies(
                fleet, model_dir, context=fleet.get("context") or 512,
                concurrency=int(r.get("concurrency") or fleet.get("concurrency") or 1))
    med = median_ratios(results)
    ver = verdicts(med)
    print(f"medians over {len(results)} runs (commits {sorted({r.get('commit') for r in results})}):")
    runs = [summary_ratios(r) for r in results]
    for key, v in med.items():
        each = ", ".join(fmt(r.get(key)) for r in runs)
        target = TARGETS.get(key)
        print(f"  {key}: {fmt(v)} (runs: {each})" + (f"  target {target[0]} {target[1]}: {ver[key]}" if target else ""))
    return 0
