#!/usr/bin/env python3
"""Benchmark: each division strategy served live on an emulated heterogeneous fleet, plus mlx-lm peers (issue 12 item 7).

Part 1, the fleet. Real `kafilad` daemons on loopback (kafila_ctl.demo.LoopbackCluster), each in
its own cgroup v1 CPU-quota group (10 ms period) and memory group (DESIGN §9 item 4;
../shared/fleet-emulation.md; scripts/cg.sh; scripts/fleet_harness.py). OPENBLAS_NUM_THREADS=1
everywhere. Capability (`--calibration`): by default ("probe") each daemon starts inside both of
its groups and reports what its own probe (kafilad/executor/probe.py `measure_capability`) reads
under its quota and memory limit, as a real slow device would; "scaled", the earlier method, starts
each daemon in its memory group only, moves it into its CPU group once the session is ready, and
has it report the one unthrottled probe scaled by its quota (KAFILA_TEST_CAPABILITY: bandwidth
q x base, step overhead base / q). For each strategy (`host --strategy`) a fresh cluster forms a
session at --concurrency K and measures

* saturated tokens/s: K requests at once through the control socket's `generate`, all generated
  tokens / wall time from the first start to the last end (prefill included);
* each member's CPU share over those rounds (its daemon's CPU seconds from /proc / wall time), to
  set against its quota: quota-bound, or idle part of the time, or starved by the machine;
* 1-user tokens/s: one request at a time, the same way;
* measured / predicted stage time per member: the 1-user requests' stage step times from their
  `end` frames (StageStats rows: window mean = compute_s_total / steps, and the median step) vs the
  plan's `stage_s`, and measured / predicted tokens/s vs the plan's throughput rows.

Each figure is the median of --runs timed rounds after one discarded warm-up round. Then the
sub-fleets: the planner's own prediction (kafilad.planner.plan on the live session's fleet) of the
1-user tokens/s of every proper subset that fits, and the top --sub-fleets of them measured the
same way (strategy kafila), so "1 user is never slower than the fastest sub-fleet" is checked.

Part 2, the peers (scripts/fleet_peers.py; no cgroups, the same model): mlx-lm's own pipeline
(`mlx.launch --backend ring -n 3` on localhost, mlx_lm.utils.sharded_load with a pipeline group,
stream_generate on every rank) and a 3-daemon Kafila ring (strategy kafila) serving one request through its OpenAI API
(`/v1/completions`, streamed; decode tokens/s as the client sees it = (completion tokens - 1) /
(last chunk - first chunk)), against single-process mlx-lm (scripts/bench_ring.py
`single_process_tps`: generate_step in-process, the first token excluded).

The model is a synthesised random-weight **qwen2** (Llama-shaped blocks with q/k/v biases): the
installed mlx-lm pipelines only architectures whose model class has `pipeline()`
(mlx_lm/models/pipeline.py PipelineMixin: qwen2, qwen3_moe, deepseek_v3, ...); its llama.py and
qwen3.py, the two architectures kafilad.executor.synth writes, have none, so sharded_load would
raise "The model does not support pipelining". Ratios are printed at the end; --json writes them.

    sudo python scripts/bench_fleet.py [--fleet mission|mission-narrow|no-uniform|issue12|NAME:PCT:MB,...] [--concurrency 6]
        [--tokens 32] [--runs 3] [--strategies kafila,uniform,memory,load] [--sub-fleets 2]
        [--hidden 512] [--layers 16] [--calibration probe|scaled] [--plot docs/fleet-bench.png] [--json FILE]
        [--no-cgroups] [--quick]

Needs root and cgroup v1 (/sys/fs/cgroup/cpu, memory) unless --no-cgroups (then no quota: a smoke
run of the harness only, its ratios mean nothing). Every daemon and mlx.launch rank is stopped and
every cgroup removed on any exit (finally blocks; SIGTERM/SIGHUP/SIGINT end the run through them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from kafilad.errors import KafilaError  # the daemons' refusals (kafila_ctl.client.DaemonRefused) are KafilaErrors
from kafilad.planner import DEFAULT_STRATEGY

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the fleet_* modules beside this script

from fleet_harness import (CALIBRATIONS, CPU_CGROUP, REPO, Cgroups, Member, _cluster_class,  # noqa: E402
                           base_capability, cpu_shares, form, model_dir_for, parse_fleet, reported_capabilities,
                           rounds, synthesize_qwen2, total_quota_cores)
from fleet_peers import mlx_pipeline_rank, mlx_pipeline_tps, mlx_single_tps, ring_api_tps  # noqa: E402
from fleet_report import (TARGETS, fmt, plot, predict_strategies, predict_sub_fleets, saturated_stage_rows,  # noqa: E402
                          stage_rows, summarize, summary_ratios, throughput_at, verdicts)

STRATEGIES = ("kafila", "uniform", "memory", "load")
#: named fleets (`--fleet NAME`; NAME:QUOTA_PCT:MEM_MB,... host first). Memory as each member's
#: probe reports it (its group's limit less what the daemon holds when it probes, less the 256 MB
#: runtime reserve, kafilad/executor/probe.py) on the default model: about 167, 187 and 142 MB for
#: "mission" (a member under a 10% quota reads ~35 MB less of its limit than the others), where the
#: model's stages need about 22 MB a block plus 16 MB for the head's embedding and output (16
#: blocks, ~370 MB at K = 6 and context 512; uniform's 5 blocks on the last member need 128 MB).
FLEETS = {
    # the model no member holds alone and no two hold it at K = 6, so every division uses all three;
    # memory ranks mid > fast > slow, not like speed; speeds 8:4:1, so the planner predicts the
    # default division about 2x uniform's and memory-proportional's saturated tokens/s (issue 24
    # item 3: a mission fleet predicted >= 1.6x; the search over memory limits that found it:
    # docs/performance.md)
    "mission": "fast:80:500,mid:40:520,slow:10:510",
    # the first mission fleet (2026-12-05): speeds 4:2:1, any two members hold the model at one
    # request; the planner predicts 1.2-1.6x uniform's, so the issue's >= 1.6x cannot show on it
    "mission-narrow": "fast:80:480,mid:40:510,slow:20:490",
    # as "mission", but the fast member holds about 3 blocks: uniform's 5-6 do not fit it, so
    # uniform cannot place the model (the paper's Qwen3-32B case) and its refusal names the device
    "no-uniform": "fast:80:400,mid:40:560,slow:20:480",
    # issue 12's fleet: the fast member holds the whole model, so the default division puts it all there
    "issue12": "fast:80:900,mid:40:1300,slow:20:700",
}
DEFAULT_FLEET = "mission"
#: what `--quick` changes (a smoke run of every code path)
QUICK = {"tokens": 8, "runs": 1, "hidden": 128, "layers": 6, "concurrency": 2, "sub_fleets": 0, "peer_tokens": 8}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command line (module docstring); --quick replaces the sizes by QUICK where not given."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fleet", default=DEFAULT_FLEET, help=f"one of {', '.join(FLEETS)}, or NAME:QUOTA_PCT:MEM_MB,... "
                    f"host first (default {DEFAULT_FLEET}: {FLEETS[DEFAULT_FLEET]})")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--concurrency", type=int, default=None, help="K, saturated requests (default 6)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per request (default 32)")
    ap.add_argument("--runs", type=int, default=None, help="timed rounds per figure after one warm-up (default 3)")
    ap.add_argument("--sub-fleets", type=int, default=None, help="proper sub-fleets to measure, best predicted first (default 2)")
    ap.add_argument("--hidden", type=int, default=None, help="model hidden size (default 512)")
    ap.add_argument("--layers", type=int, default=None, help="model blocks (default 16)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--peer-tokens", type=int, default=None, help="tokens per request of part 2 (default 64)")
    ap.add_argument("--ranks", type=int, default=3, help="mlx-lm pipeline ranks and Kafila ring members of part 2")
    ap.add_argument("--skip-fleet", action="store_true", help="part 2 only")
    ap.add_argument("--skip-peers", action="store_true", help="part 1 only")
    ap.add_argument("--no-cgroups", action="store_true", help="no quotas or memory limits (smoke runs, tests)")
    ap.add_argument("--calibration", choices=CALIBRATIONS, default="probe",
                    help="probe: each daemon probes itself inside its groups (default); scaled: one unthrottled "
                         "probe x each member's quota (the earlier method)")
    ap.add_argument("--quick", action="store_true", help="a short smoke run: " + json.dumps(QUICK))
    ap.add_argument("--plot", type=Path, default=None, help="PNG of tokens/s by strategy (needs matplotlib: the plot extra)")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    ap.add_argument("--root", default=None, help="keep the clusters' state dirs and logs here")
    ap.add_argument("--hop-delay-ms", type=float, default=None,
                    help="one-way delay of every direct ring hop (a WAN forwarder per daemon, kafila_ctl/wan_hops.py)")
    ap.add_argument("--hop-mbps", type=float, default=None, help="rate cap of every direct ring hop, Mbit/s")
    ap.add_argument("--summarize", nargs="+", type=Path, metavar="JSON",
                    help="print the median of every ratio over the --json files of several runs, and exit")
    ap.add_argument("--mlx-pipeline-rank", nargs=3, metavar=("MODEL", "TOKENS", "RUNS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    defaults = {"tokens": 32, "runs": 3, "hidden": 512, "layers": 16, "concurrency": 6, "sub_fleets": 2,
                "peer_tokens": 64}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else value)
    args.fleet = FLEETS.get(args.fleet, args.fleet)
    args.fleet_members = parse_fleet(args.fleet)
    args.strategy_list = [s for s in args.strategies.split(",") if s]
    bad = [s for s in args.strategy_list if s not in STRATEGIES]
    if bad:
        ap.error(f"unknown strategies {bad}; choose from {', '.join(STRATEGIES)}")
    if args.runs < 1 or args.concurrency < 1 or args.tokens < 2 or args.ranks < 2:
        ap.error("--runs and --concurrency must be >= 1, --tokens >= 2, --ranks >= 2")
    return args


def measure_session(args, members: Sequence[Member], cgroups: Cgroups, base_cap: Optional[dict], model_dir: Path, *,
                    strategy: str, concurrency: int, saturated: bool, log) -> dict:
    """Form a session of `members` with `strategy`, throttle it (the "scaled" calibration: `base_cap`
    given), measure; the result record."""
    FleetCluster = _cluster_class()
    # fresh groups: throttling counters and memory peak per session
    cgroups = Cgroups(members, cgroups.enabled, cgroups.calibration)
    try:
        cgroups.make()
        return _measure(args, members, cgroups, base_cap, model_dir, strategy=strategy, concurrency=concurrency,
                        saturated=saturated, log=log, FleetCluster=FleetCluster)
    finally:
        cgroups.close()


def _measure(args, members, cgroups, base_cap, model_dir, *, strategy, concurrency, saturated, log, FleetCluster):
    # one state dir per session under --root: a daemon started on a dir that remembers a session rejoins it
    where = f"{strategy}-K{concurrency}-{'+'.join(m.name for m in members)}"
    with FleetCluster(members, cgroups, base_cap, args.root and str(Path(args.root) / where),
                      getattr(args, "hop_delay_ms", None), getattr(args, "hop_mbps", None)) as c:
        t0 = time.perf_counter()
        snap = form(c, model_dir, strategy=strategy, concurrency=concurrency, context=args.context)
        form_s = time.perf_counter() - t0
        c.throttle_all()
        plan = snap["plan"]
        log(f"[{strategy} K={concurrency} {'+'.join(m.name for m in members)}] formed in {form_s:.1f} s: blocks {plan['blocks']}, "
            f"standby {plan.get('standby')}, predicted stage ms "
            f"{ {n: round(s * 1e3, 1) for n, s in plan['stage_s'].items()} }")
        rec = {"members": [m.name for m in members], "strategy": strategy, "concurrency": concurrency,
               "plan": {k: plan.get(k) for k in ("order", "head", "blocks", "stage_s", "bottleneck_s", "circuit_s",
                                                 "standby", "throughput")},
               "fleet": snap.get("fleet"), "form_s": form_s,
               "edges": [{k: e.get(k) for k in ("from", "to", "path", "rtt_ms", "path_rtt_ms", "rtt_samples")}
                         for e in snap.get("edges") or []],
               "capability": reported_capabilities(snap.get("fleet"))}
        log(f"[{strategy}] reported capability: " + "; ".join(
            f"{n} {(c_['bandwidth_Bps'] or 0) / 1e9:.2f} GB/s + {(c_['step_overhead_s'] or 0) * 1e6:.0f} us/step, "
            f"rho {c_['batch_row_cost']}" for n, c_ in rec["capability"].items()))
        if saturated:
            cpu0, t0 = c.cpu_s(), time.perf_counter()
            rec["saturated_tps"], rec["saturated_samples"] = rounds(
                lambda: c.aggregate_tps(concurrency, args.tokens), args.runs)
            rec["saturated_cpu_share"] = dict(zip([m.name for m in members],
                                                  cpu_shares(cpu0, c.cpu_s(), time.perf_counter() - t0)))
            rec["saturated_predicted_tps"] = throughput_at(plan, concurrency)
            log(f"[{strategy}] {concurrency} concurrent: {rec['saturated_tps']:.2f} tokens/s "
                f"(rounds {[round(s, 2) for s in rec['saturated_samples']]}; predicted {rec['saturated_predicted_tps']})")
            sat_status = c.call(0, "status")
            rec["saturated_stages"] = saturated_stage_rows(sat_status)
            rec["schedule"] = sat_status.get("schedule")
            log(f"[{strategy}] under load, stages: " + "; ".join(
                f"{r['name']} B={r['rows']} rho={r['rho']} predicted {(r['predicted_s'] or 0) * 1e3:.1f} ms, "
                f"median {(r['median_s'] or 0) * 1e3:.1f} ({r['median_ratio'] or 0:.2f}x), CPU "
                f"{(rec['saturated_cpu_share'].get(r['name']) or 0):.2f} core" for r in rec["saturated_stages"])
                + f"; schedule M={(rec['schedule'] or {}).get('micro_batches')} trials {(rec['schedule'] or {}).get('trials')}")
        rec["one_user_tps"], rec["one_user_samples"] = rounds(lambda: c.aggregate_tps(1, args.tokens), args.runs)
        rec["one_user_predicted_tps"] = throughput_at(plan, 1)
        status = c.call(0, "status")
        rec["stages"] = stage_rows(status)
        rec["decode_tokens_per_s"] = (status.get("last_generation") or {}).get("decode_tokens_per_s")
        rec["cgroup_stat"] = [cgroups.stat(m) for m in members]
        log(f"[{strategy}] 1 user: {rec['one_user_tps']:.2f} tokens/s (rounds "
            f"{[round(s, 2) for s in rec['one_user_samples']]}; predicted {rec['one_user_predicted_tps']}); stages "
            + "; ".join(f"{r['name']} {r['blocks']} predicted {r['predicted_s'] * 1e3:.1f} ms, mean "
                        f"{(r['mean_s'] or 0) * 1e3:.1f} ({r['mean_ratio'] or 0:.2f}x), median "
                        f"{(r['median_s'] or 0) * 1e3:.1f}" for r in rec["stages"]))
        return rec


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or "?"
    except OSError:
        return "?"


def dirty_files() -> list[str]:
    """Uncommitted changes under kafilad/ and kafila_ctl/ (the measured code may not be the commit alone)."""
    out = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "kafilad", "kafila_ctl"],
                         capture_output=True, text=True).stdout
    return [line[3:] for line in out.splitlines()]


def _terminate(signum, frame):  # noqa: ARG001 - signal handler signature
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.mlx_pipeline_rank:
        model, tokens, runs = args.mlx_pipeline_rank
        return mlx_pipeline_rank(model, int(tokens), int(runs))
    if args.summarize:
        return summarize(args.summarize)
    use_cg = not args.no_cgroups
    if use_cg and (os.geteuid() != 0 or not (CPU_CGROUP / "cpu.cfs_quota_us").exists()):
        print("needs root and cgroup v1 at /sys/fs/cgroup/cpu (DESIGN §9 item 4); or pass --no-cgroups",
              file=sys.stderr)
        return 2
    fleet = args.fleet_members
    if use_cg and total_quota_cores(fleet) > 1.6:
        print(f"warning: the quotas add up to {total_quota_cores(fleet):.2f} cores; keep them under ~1.6 "
              "(DESIGN §9 item 4)", file=sys.stderr)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)

    def log(msg: str) -> None:
        print(msg, flush=True)
    model_dir = synthesize_qwen2(model_dir_for(args.hidden, args.layers), hidden=args.hidden, layers=args.layers)
    res: dict = {"commit": commit(), "dirty": dirty_files(), "loadavg_start": os.getloadavg(), "fleet": args.fleet, "concurrency": args.concurrency, "tokens": args.tokens,
                 "runs": args.runs, "ranks": args.ranks, "cgroups": use_cg,
                 "calibration": args.calibration,
                 "model": f"synthesised qwen2 f32, hidden {args.hidden}, {args.layers} blocks", "model_dir": str(model_dir),
                 "strategies": {}}
    log(f"model: {res['model']} ({model_dir}); commit {res['commit']}"
        f"{' + uncommitted ' + ', '.join(res['dirty']) if res['dirty'] else ''}; load average "
        f"{res['loadavg_start'][0]:.1f}; fleet {args.fleet} "
        f"({'cgroups' if use_cg else 'NO cgroups'}); K={args.concurrency}, {args.tokens} tokens per request, "
        f"median of {args.runs} rounds after a warm-up")
    cgroups = Cgroups(fleet, use_cg, args.calibration)
    procs: list = []
    try:
        if not args.skip_fleet:
            base = None
            if args.calibration == "scaled":
                base = res["base_capability"] = base_capability(model_dir)
                log(f"probe (unthrottled): {base['bandwidth_Bps'] / 1e9:.2f} GB/s + "
                    f"{base['step_overhead_s'] * 1e6:.0f} us/step, scaled by each member's quota")
            else:
                log("calibration: each daemon probes itself inside its CPU and memory groups")
            for s in args.strategy_list:
                try:
                    res["strategies"][s] = measure_session(args, fleet, cgroups, base, model_dir, strategy=s,
                                                           concurrency=args.concurrency, saturated=True, log=log)
                except KafilaError as e:  # a division that cannot place the model on this fleet
                    res["strategies"][s] = {"strategy": s, "refused": str(e)}
                    log(f"[{s}] refused: {e}")
            if "load" in args.strategy_list:
                res["load_at_1"] = measure_session(args, fleet, cgroups, base, model_dir, strategy="load",
                                                   concurrency=1, saturated=False, log=log)
            default_fleet = (res["strategies"].get(DEFAULT_STRATEGY) or {}).get("fleet")
            if default_fleet:  # every division predicted on the devices as the default session measured them
                res["predicted_on_default_fleet"] = predict_strategies(default_fleet, str(model_dir), context=args.context,
                                                                       concurrency=args.concurrency)
                log("predicted saturated tokens/s on the default session's fleet: " + ", ".join(
                    f"{k} {v:.1f}" if v else f"{k} cannot place it" for k, v in res["predicted_on_default_fleet"].items()))
            live = next((r.get("fleet") for r in res["strategies"].values() if r.get("fleet")), None)
            if live:
                res["sub_fleets_predicted"] = predict_sub_fleets(live, str(model_dir), context=args.context)
                log("predicted 1-user tokens/s of proper sub-fleets: " + "; ".join(
                    f"{'+'.join(r['names'])} {r['tokens_per_s']:.2f}" for r in res["sub_fleets_predicted"]))
                res["sub_fleets_measured"] = []
                by_name = {m.name: m for m in fleet}
                for sub in res["sub_fleets_predicted"][:args.sub_fleets]:
                    rec = measure_session(args, [by_name[n] for n in sub["names"]], cgroups, base, model_dir,
                                          strategy="kafila", concurrency=1, saturated=False, log=log)
                    res["sub_fleets_measured"].append(rec)
        if not args.skip_peers:
            peers = res["peers"] = {}
            peers["mlx_lm_single_tps"] = mlx_single_tps(model_dir, args.peer_tokens)
            log(f"[mlx-lm single process] {peers['mlx_lm_single_tps']:.2f} tokens/s")
            pipe = mlx_pipeline_tps(model_dir, args.ranks, args.peer_tokens, args.runs, procs)
            peers["mlx_lm_pipeline_tps"], peers["mlx_lm_pipeline"] = pipe["tps"], pipe
            log(f"[mlx-lm pipeline, {args.ranks} ranks, ring backend] {pipe['tps']:.2f} tokens/s "
                f"(rounds {[round(s, 2) for s in pipe['samples']]}, {pipe['tokens']} tokens)")
            ring = ring_api_tps(args, model_dir, log)
            peers["ring_api_decode_tps"], peers["ring_api"] = ring["tps"], ring
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        cgroups.close()
    res["loadavg_end"] = os.getloadavg()
    res["ratios"] = summary_ratios(res)
    res["verdicts"] = verdicts(res["ratios"])
    log(f"\nratios measured in this run (commit {res['commit']}; load average {res['loadavg_start'][0]:.1f} at the "
        f"start, {res['loadavg_end'][0]:.1f} at the end):")
    for key, v in res["ratios"].items():
        target = TARGETS.get(key)
        log(f"  {key}: {fmt(v)}" + (f"  (target {target[0]} {target[1]}: {res['verdicts'][key]})" if target else ""))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    if args.plot and res["strategies"]:
        plot(res, args.plot)
        log(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
