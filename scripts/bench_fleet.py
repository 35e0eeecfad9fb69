#!/usr/bin/env python3
"""Benchmark: each division strategy served live on an emulated heterogeneous fleet, plus mlx-lm peers (issue 12 item 7).

Part 1, the fleet. Real `kafilad` daemons on loopback (kafila_ctl.demo.LoopbackCluster), each in
its own cgroup v1 memory group from its start and moved into its own CPU-quota group (10 ms
period) once the session is ready, i.e. after it loaded its weights (DESIGN §9 item 4;
../shared/fleet-emulation.md; scripts/cg.sh). OPENBLAS_NUM_THREADS=1 everywhere. Capability: the
daemon's own probe (`measure_capability`) runs once, unthrottled, in a child process, and a member
at quota q reports bandwidth q x base and step overhead base / q through KAFILA_TEST_CAPABILITY
(the method docs/cost-model.md validated: median error 6.1% on tens-of-ms stages); its memory is
what the daemon measures inside its memory group. For each strategy (`host --strategy`) a fresh
cluster forms a session at --concurrency K and measures

* saturated tokens/s: K requests at once through the control socket's `generate`, all generated
  tokens / wall time from the first start to the last end (prefill included);
* 1-user tokens/s: one request at a time, the same way;
* measured / predicted stage time per member: the 1-user requests' stage step times from their
  `end` frames (StageStats rows: window mean = compute_s_total / steps, and the median step) vs the
  plan's `stage_s`, and measured / predicted tokens/s vs the plan's throughput rows.

Each figure is the median of --runs timed rounds after one discarded warm-up round. Then the
sub-fleets: the planner's own prediction (kafilad.planner.plan on the live session's fleet) of the
1-user tokens/s of every proper subset that fits, and the top --sub-fleets of them measured the
same way (strategy kafila), so "1 user is never slower than the fastest sub-fleet" is checked.

Part 2, the peers (no cgroups, the same model): mlx-lm's own pipeline (`mlx.launch --backend ring
-n 3` on localhost, mlx_lm.utils.sharded_load with a pipeline group, stream_generate on every
rank) and a 3-daemon Kafila ring (strategy kafila) serving one request through its OpenAI API
(`/v1/completions`, streamed; decode tokens/s as the client sees it = (completion tokens - 1) /
(last chunk - first chunk)), against single-process mlx-lm (scripts/bench_ring.py
`single_process_tps`: generate_step in-process, the first token excluded).

The model is a synthesised random-weight **qwen2** (Llama-shaped blocks with q/k/v biases): the
installed mlx-lm pipelines only architectures whose model class has `pipeline()`
(mlx_lm/models/pipeline.py PipelineMixin: qwen2, qwen3_moe, deepseek_v3, ...); its llama.py and
qwen3.py, the two architectures kafilad.executor.synth writes, have none, so sharded_load would
raise "The model does not support pipelining". Ratios are printed at the end; --json writes them.

    sudo python scripts/bench_fleet.py [--fleet fast:80:900,mid:40:1300,slow:20:700] [--concurrency 6]
        [--tokens 32] [--runs 3] [--strategies kafila,uniform,memory,load] [--sub-fleets 2]
        [--hidden 512] [--layers 16] [--plot docs/fleet-bench.png] [--json FILE] [--no-cgroups] [--quick]

Needs root and cgroup v1 (/sys/fs/cgroup/cpu, memory) unless --no-cgroups (then no quota: a smoke
run of the harness only, its ratios mean nothing). Every daemon and mlx.launch rank is stopped and
every cgroup removed on any exit (finally blocks; SIGTERM/SIGHUP/SIGINT end the run through them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
CG = REPO / "scripts" / "cg.sh"
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000  # DESIGN §9 item 4: the default 100 ms period makes steps bimodal
GROUP_PREFIX = "bf_"  # cg.sh names the groups fleet_<NAME>: fleet_bf_<member>
STRATEGIES = ("kafila", "uniform", "memory", "load")
DEFAULT_FLEET = "fast:80:900,mid:40:1300,slow:20:700"
PROMPTS = ["Once upon a time"]  # the peers' prompt (the load's are kafila_ctl.demo.LOAD_PROMPTS)
#: what `--quick` changes (a smoke run of every code path)
QUICK = {"tokens": 8, "runs": 1, "hidden": 128, "layers": 6, "concurrency": 2, "sub_fleets": 0, "peer_tokens": 8}


# ---------------------------------------------------------------- pure parts (tests/scripts/test_bench_fleet.py)

@dataclass(frozen=True)
class Member:
    """One emulated device: `quota_pct` of one core (0 = unlimited), memory limit `mem_mb` (0 = none)."""

    name: str
    quota_pct: int
    mem_mb: int

    @property
    def group(self) -> str:
        return GROUP_PREFIX + self.name


def parse_fleet(text: str) -> list[Member]:
    """Parse "NAME:QUOTA_PCT:MEM_MB,..." (the first member hosts).

    Raises:
        ValueError: malformed entry, duplicate name, a quota outside 0-100, or fewer than 2 members.
    """
    members = []
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        fields = part.split(":")
        if len(fields) != 3 or not fields[0].isidentifier():
            raise ValueError(f"Fleet entry {part!r} is not NAME:QUOTA_PCT:MEM_MB.")
        try:
            quota, mem = int(fields[1]), int(fields[2])
        except ValueError:
            raise ValueError(f"Fleet entry {part!r}: quota and memory must be integers.") from None
        if not 0 <= quota <= 100 or mem < 0:
            raise ValueError(f"Fleet entry {part!r}: quota must be 0-100 (% of one core) and memory >= 0 MB.")
        members.append(Member(fields[0], quota, mem))
    if len(members) < 2:
        raise ValueError("A fleet needs at least 2 members.")
    if len({m.name for m in members}) != len(members):
        raise ValueError("Fleet member names must be unique.")
    return members


def total_quota_cores(fleet: Sequence[Member]) -> float:
    """Cores the quotas add up to (an unlimited member counts as 1)."""
    return sum((m.quota_pct or 100) / 100 for m in fleet)


def scaled_capability(base: dict, quota_pct: int) -> dict:
    """The capability override of a member at `quota_pct` (DESIGN §9: step time ≈ base / quota):
    bandwidth × q, step overhead / q. Unlimited (0) keeps the base."""
    q = (quota_pct or 100) / 100
    return {"bandwidth_Bps": float(base["bandwidth_Bps"]) * q,
            "step_overhead_s": float(base.get("step_overhead_s") or 0.0) / q}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command line (module docstring); --quick replaces the sizes by QUICK where not given."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fleet", default=DEFAULT_FLEET, help=f"NAME:QUOTA_PCT:MEM_MB,... host first (default {DEFAULT_FLEET})")
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
    ap.add_argument("--quick", action="store_true", help="a short smoke run: " + json.dumps(QUICK))
    ap.add_argument("--plot", type=Path, default=None, help="PNG of tokens/s by strategy (needs matplotlib: the plot extra)")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    ap.add_argument("--root", default=None, help="keep the clusters' state dirs and logs here")
    ap.add_argument("--summarize", nargs="+", type=Path, metavar="JSON",
                    help="print the median of every ratio over the --json files of several runs, and exit")
    ap.add_argument("--mlx-pipeline-rank", nargs=3, metavar=("MODEL", "TOKENS", "RUNS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    defaults = {"tokens": 32, "runs": 3, "hidden": 512, "layers": 16, "concurrency": 6, "sub_fleets": 2,
                "peer_tokens": 64}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else value)
    args.fleet_members = parse_fleet(args.fleet)
    args.strategy_list = [s for s in args.strategies.split(",") if s]
    bad = [s for s in args.strategy_list if s not in STRATEGIES]
    if bad:
        ap.error(f"unknown strategies {bad}; choose from {', '.join(STRATEGIES)}")
    if args.runs < 1 or args.concurrency < 1 or args.tokens < 2 or args.ranks < 2:
        ap.error("--runs and --concurrency must be >= 1, --tokens >= 2, --ranks >= 2")
    return args


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
    [peer_id, steps, compute_s_total, decode_stage_s_median, bytes_sent] (kafilad/node/scheduler.py
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
            out.append({**fleet_json, "devices": list(combo)})
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
            p = plan(load_fleet(sub).devices, profile, context=context, concurrency=1, strategy="kafila").to_json()
        except KafilaError:
            continue  # does not fit, or fewer blocks than devices
        out.append({"names": [d["name"] for d in sub["devices"]], "tokens_per_s": throughput_at(p, 1),
                    "blocks": p["blocks"]})
    return sorted(out, key=lambda r: -(r["tokens_per_s"] or 0))


def summary_ratios(res: dict) -> dict:
    """The ratios the issue's targets name, from the collected results (None where not measured)."""
    strat = res.get("strategies", {})

    def sat(s):
        return (strat.get(s) or {}).get("saturated_tps")

    def one(s):
        return (strat.get(s) or {}).get("one_user_tps")
    kafila = strat.get("kafila") or {}
    # under load when measured (quotas model saturated throughput well, a lone request badly:
    # an idle member bursts above its quota, DESIGN §9), else the 1-user window means
    stage_ratios = ([r["median_ratio"] for r in kafila.get("saturated_stages", []) if r["median_ratio"]]
                    or [r["mean_ratio"] for r in kafila.get("stages", []) if r["mean_ratio"]])
    best_sub = max([s["one_user_tps"] for s in res.get("sub_fleets_measured", []) if s.get("one_user_tps")],
                   default=None)
    load1 = (res.get("load_at_1") or {}).get("one_user_tps")
    peers = res.get("peers", {})
    return {
        "kafila_over_uniform_saturated": ratio(sat("kafila"), sat("uniform")),
        "kafila_over_memory_saturated": ratio(sat("kafila"), sat("memory")),
        "load_over_uniform_saturated": ratio(sat("load"), sat("uniform")),
        "kafila_stage_measured_over_predicted_max_dev": (max(abs(r - 1) for r in stage_ratios)
                                                        if stage_ratios else None),
        "one_user_load_at_1_over_best_sub_fleet": ratio(load1, best_sub),
        "one_user_kafila_full_fleet_over_best_sub_fleet": ratio(one("kafila"), best_sub),
        "ring_api_over_mlx_lm_single": ratio(peers.get("ring_api_decode_tps"), peers.get("mlx_lm_single_tps")),
        "ring_api_over_mlx_lm_pipeline": ratio(peers.get("ring_api_decode_tps"), peers.get("mlx_lm_pipeline_tps")),
    }


TARGETS = {  # ratio key -> (comparison, bound) from issue 12's targets
    "kafila_over_uniform_saturated": (">=", 1.6),
    "kafila_over_memory_saturated": (">=", 1.3),
    "kafila_stage_measured_over_predicted_max_dev": ("<=", 0.10),
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


# ---------------------------------------------------------------- the model

def synthesize_qwen2(out_dir: Path, *, hidden: int, layers: int, seed: int = 0) -> Path:
    """A random-weight qwen2 checkpoint (f32, untied head, q/k/v biases, model.safetensors.index.json
    for mlx-lm's sharded_load), built from kafilad.executor.synth's llama recipe; cached by shape."""
    import numpy as np
    from kafilad.executor import synth
    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors.index.json").exists():
        return out_dir
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    synth.synthesize_model(tmp, arch="llama", seed=seed, num_hidden_layers=layers, hidden_size=hidden,
                           tie_word_embeddings=False)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    cfg.pop("mlp_bias", None)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in synth.synth_tensor_shapes({**cfg, "model_type": "llama"}).items():
        if name.endswith("norm.weight"):
            w = np.ones(shape, np.float32)
        elif "embed_tokens" in name:
            w = rng.standard_normal(shape, dtype=np.float32) * np.float32(synth.EMBED_STD)
        else:
            w = rng.standard_normal(shape, dtype=np.float32) * np.float32(synth.LINEAR_GAIN / np.sqrt(shape[-1]))
        tensors[name] = ("F32", shape, w.astype("<f4").tobytes())
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            b = rng.standard_normal(shape[0], dtype=np.float32) * np.float32(0.02)
            tensors[name[:-len("weight")] + "bias"] = ("F32", (shape[0],), b.astype("<f4").tobytes())
    synth.write_safetensors(tmp / "model.safetensors", tensors)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in tensors}}, indent=1, sort_keys=True))
    os.replace(tmp, out_dir)
    return out_dir


def model_dir_for(hidden: int, layers: int) -> Path:
    import platformdirs
    return Path(platformdirs.user_cache_dir("kafila")) / "models" / f"bench-fleet-qwen2-h{hidden}-l{layers}"


def base_capability(model_dir: Path) -> dict:
    """The daemon's own probe, run once unthrottled in a child process (what a member would report)."""
    code = ("import json, sys, kafilad.executor\nfrom kafilad.executor.probe import measure_capability\n"
            "print(json.dumps(measure_capability(sys.argv[1])))")
    nice = ["nice", "-n", "-15"] if os.geteuid() == 0 else []  # shield the one unthrottled probe from neighbours
    out = subprocess.run([*nice, sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True, check=True,
                         env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- cgroups and daemons

class Cgroups:
    """The fleet's cgroup v1 groups (scripts/cg.sh); `close` removes them (idempotent)."""

    def __init__(self, fleet: Sequence[Member], enabled: bool):
        self.fleet, self.enabled, self.made = list(fleet), enabled, []

    def make(self) -> None:
        if not self.enabled:
            return
        for m in self.fleet:
            subprocess.run(["bash", str(CG), "mk", m.group, str(m.quota_pct), str(m.mem_mb), str(PERIOD_US)],
                           check=True, capture_output=True, text=True)
            self.made.append(m)

    def wrap(self, member: Member, argv: list[str]) -> list[str]:
        """`argv` run inside the member's memory group (it joins its CPU group later: `throttle`)."""
        return ["bash", str(CG), "runmem", member.group, *argv] if self.enabled else argv

    def throttle(self, member: Member, pid: int) -> None:
        """Move `pid` (all its threads) into the member's CPU group."""
        if self.enabled:
            (CPU_CGROUP / f"fleet_{member.group}" / "cgroup.procs").write_text(str(pid))

    def stat(self, member: Member) -> str:
        if not self.enabled:
            return ""
        return subprocess.run(["bash", str(CG), "stat", member.group], capture_output=True, text=True).stdout.strip()

    def close(self) -> None:
        for m in self.made:
            subprocess.run(["bash", str(CG), "rm", m.group], capture_output=True)
        self.made = []


def _cluster_class():
    from kafila_ctl.demo import LoopbackCluster
    from kafilad.node.stagehost import TEST_CAPABILITY_ENV

    class FleetCluster(LoopbackCluster):
        """LoopbackCluster whose daemons start in their members' memory groups with the scaled capability."""

        def __init__(self, members: Sequence[Member], cgroups: Cgroups, base_cap: dict, root: Optional[str]):
            self.members, self.cgroups, self.base_cap = list(members), cgroups, base_cap
            super().__init__(len(members), names=[m.name for m in members], root=root,
                             env={"OPENBLAS_NUM_THREADS": "1"})

        def daemon_argv(self, i: int) -> list[str]:
            return self.cgroups.wrap(self.members[i], super().daemon_argv(i))

        def daemon_env(self, i: int) -> dict:
            cap = scaled_capability(self.base_cap, self.members[i].quota_pct)
            return {**self.env, TEST_CAPABILITY_ENV: json.dumps(cap)}

        def throttle_all(self) -> None:
            for m, p in zip(self.members, self.daemons):
                self.cgroups.throttle(m, p.pid)
    return FleetCluster


def form(c, model_dir: Path, *, strategy: str, concurrency: int, context: int, timeout_s: float = 600.0) -> dict:
    """Host on daemon 0 with `strategy`, join with the others, wait until ready; the ready snapshot."""
    import trio
    code = c.call(0, "host", model_dir=str(model_dir), members=c.n, context=context, concurrency=concurrency,
                  open=True, strategy=strategy)["code"]

    async def join_all():
        async with trio.open_nursery() as nursery:
            for i in range(1, c.n):
                nursery.start_soon(lambda i=i: c.client(i).call("join", code=code))
    trio.run(join_all)
    return c.call(0, "wait", states=["ready"], timeout_s=timeout_s)


def rounds(fn, runs: int) -> tuple[float, list[float]]:
    """Median of `runs` calls after one discarded warm-up call, and the samples."""
    samples = [fn() for _ in range(runs + 1)][1:]
    return statistics.median(samples), samples


def measure_session(args, members: Sequence[Member], cgroups: Cgroups, base_cap: dict, model_dir: Path, *,
                    strategy: str, concurrency: int, saturated: bool, log) -> dict:
    """Form a session of `members` with `strategy`, throttle it, measure; the result record."""
    FleetCluster = _cluster_class()
    cgroups = Cgroups(members, cgroups.enabled)  # fresh groups: throttling counters and memory peak per session
    try:
        cgroups.make()
        return _measure(args, members, cgroups, base_cap, model_dir, strategy=strategy, concurrency=concurrency,
                        saturated=saturated, log=log, FleetCluster=FleetCluster)
    finally:
        cgroups.close()


def _measure(args, members, cgroups, base_cap, model_dir, *, strategy, concurrency, saturated, log, FleetCluster):
    with FleetCluster(members, cgroups, base_cap, args.root and str(Path(args.root) / f"{strategy}-{len(members)}")) as c:
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
               "fleet": snap.get("fleet"), "form_s": form_s}
        if saturated:
            rec["saturated_tps"], rec["saturated_samples"] = rounds(
                lambda: c.aggregate_tps(concurrency, args.tokens), args.runs)
            rec["saturated_predicted_tps"] = throughput_at(plan, concurrency)
            log(f"[{strategy}] {concurrency} concurrent: {rec['saturated_tps']:.2f} tokens/s "
                f"(rounds {[round(s, 2) for s in rec['saturated_samples']]}; predicted {rec['saturated_predicted_tps']})")
            sat_status = c.call(0, "status")
            rec["saturated_stages"] = saturated_stage_rows(sat_status)
            rec["schedule"] = sat_status.get("schedule")
            log(f"[{strategy}] under load, stages: " + "; ".join(
                f"{r['name']} B={r['rows']} rho={r['rho']} predicted {(r['predicted_s'] or 0) * 1e3:.1f} ms, "
                f"median {(r['median_s'] or 0) * 1e3:.1f} ({r['median_ratio'] or 0:.2f}x)" for r in rec["saturated_stages"])
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


# ---------------------------------------------------------------- part 2: mlx-lm peers

def mlx_pipeline_rank(model_dir: str, tokens: int, runs: int) -> int:
    """One rank of mlx-lm's own pipeline (run by mlx.launch); rank 0 prints `MLXPIPE {json}`."""
    import kafilad.executor  # noqa: F401 - the same BLAS as the daemons, loaded before mlx
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.utils import sharded_load
    group = mx.distributed.init(strict=True, backend="ring")
    model, tok = sharded_load(model_dir, pipeline_group=group)
    rates, n = [], 0
    for run in range(runs + 1):
        last = None
        for last in stream_generate(model, tok, PROMPTS[0], max_tokens=tokens):
            pass
        n = last.generation_tokens
        print(f"rank {group.rank()} run {run}: {n} tokens, {last.generation_tps:.2f} tokens/s", file=sys.stderr,
              flush=True)
        if run:
            rates.append(last.generation_tps)
    # a barrier: a rank that exits while another still runs the last generation's speculative step
    # (generate_step evaluates step n+1 before yielding n) breaks the ring under it
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))
    time.sleep(1.0)
    if group.rank() == 0:
        print("MLXPIPE " + json.dumps({"tps": statistics.median(rates), "samples": rates, "tokens": n,
                                       "layers": [model.model.start_idx, model.model.end_idx]}), flush=True)
    return 0


def mlx_pipeline_tps(model_dir: Path, ranks: int, tokens: int, runs: int, procs: list) -> dict:
    """mlx-lm's pipeline over `ranks` processes (mlx.launch --backend ring on localhost)."""
    launch = Path(sys.executable).with_name("mlx.launch")
    cmd = [str(launch), "--backend", "ring", "-n", str(ranks), "--", sys.executable, str(Path(__file__).resolve()),
           "--mlx-pipeline-rank", str(model_dir), str(tokens), str(runs)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    procs.append(p)
    out, _ = p.communicate(timeout=900)
    for line in out.splitlines():
        if line.startswith("MLXPIPE "):
            return json.loads(line[len("MLXPIPE "):])
    raise RuntimeError(f"mlx-lm pipeline run gave no result (exit {p.returncode}):\n{out[-3000:]}")


def api_decode_tps(http_base: str, prompt: str, tokens: int) -> float:
    """One streamed /v1/completions request; (completion tokens - 1) / (last chunk - first chunk)."""
    import httpx
    body = {"prompt": prompt, "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    usage = None
    with httpx.stream("POST", f"{http_base}/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                now = time.perf_counter()
                first = first or now
                last = now
            if chunk.get("usage"):
                usage = chunk["usage"]
    n = usage["completion_tokens"] if usage else 0
    return (n - 1) / (last - first) if n > 1 and last and last > first else 0.0


def ring_api_tps(args, model_dir: Path, log) -> dict:
    """A Kafila ring of --ranks unthrottled daemons, one request at a time through the OpenAI API."""
    from kafila_ctl.demo import LoopbackCluster
    with LoopbackCluster(args.ranks, env={"OPENBLAS_NUM_THREADS": "1"}) as c:
        snap = form(c, model_dir, strategy="kafila", concurrency=1, context=args.context)
        http = c.call(0, "status").get("http")
        if not http:
            raise RuntimeError("the host daemon reports no HTTP address")
        tps, samples = rounds(lambda: api_decode_tps(http, PROMPTS[0], args.peer_tokens), args.runs)
        log(f"[ring api] blocks {snap['plan']['blocks']}: {tps:.2f} tokens/s as the client sees it "
            f"(rounds {[round(s, 2) for s in samples]})")
        return {"tps": tps, "samples": samples, "blocks": snap["plan"]["blocks"]}


def mlx_single_tps(model_dir: Path, tokens: int) -> float:
    """scripts/bench_ring.py's single_process_tps (in a child process, so this one never imports mlx)."""
    code = ("import sys, runpy\nsys.path.insert(0, sys.argv[1])\nfrom bench_ring import single_process_tps\n"
            "print(single_process_tps(sys.argv[2], 'Once upon a time', int(sys.argv[3])))")
    out = subprocess.run([sys.executable, "-c", code, str(REPO / "scripts"), str(model_dir), str(tokens)],
                         capture_output=True, text=True, check=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    return float(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- report

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


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def median_ratios(results: Sequence[dict]) -> dict:
    """key -> median over runs of each run's ratio (runs without it left out; None if none has it)."""
    keys = dict.fromkeys(k for r in results for k in r.get("ratios", {}))
    out = {}
    for key in keys:
        vals = [r["ratios"][key] for r in results if r.get("ratios", {}).get(key) is not None]
        out[key] = statistics.median(vals) if vals else None
    return out


def summarize(paths: Sequence[Path]) -> int:
    """`--summarize`: the median of every ratio over several runs' JSON files, with the targets' verdicts."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    med = median_ratios(results)
    ver = verdicts(med)
    print(f"medians over {len(results)} runs (commits {sorted({r.get('commit') for r in results})}):")
    for key, v in med.items():
        each = ", ".join(_fmt(r.get("ratios", {}).get(key)) for r in results)
        target = TARGETS.get(key)
        print(f"  {key}: {_fmt(v)} (runs: {each})" + (f"  target {target[0]} {target[1]}: {ver[key]}" if target else ""))
    return 0


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
                 "model": f"synthesised qwen2 f32, hidden {args.hidden}, {args.layers} blocks", "strategies": {}}
    log(f"model: {res['model']} ({model_dir}); commit {res['commit']}"
        f"{' + uncommitted ' + ', '.join(res['dirty']) if res['dirty'] else ''}; load average "
        f"{res['loadavg_start'][0]:.1f}; fleet {args.fleet} "
        f"({'cgroups' if use_cg else 'NO cgroups'}); K={args.concurrency}, {args.tokens} tokens per request, "
        f"median of {args.runs} rounds after a warm-up")
    cgroups = Cgroups(fleet, use_cg)
    procs: list = []
    try:
        if not args.skip_fleet:
            base = base_capability(model_dir)
            res["base_capability"] = base
            log(f"probe (unthrottled): {base['bandwidth_Bps'] / 1e9:.2f} GB/s + {base['step_overhead_s'] * 1e6:.0f} us/step")
            for s in args.strategy_list:
                res["strategies"][s] = measure_session(args, fleet, cgroups, base, model_dir, strategy=s,
                                                       concurrency=args.concurrency, saturated=True, log=log)
            if "load" in args.strategy_list:
                res["load_at_1"] = measure_session(args, fleet, cgroups, base, model_dir, strategy="load",
                                                   concurrency=1, saturated=False, log=log)
            live = next(iter(res["strategies"].values()), {}).get("fleet")
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
        log(f"  {key}: {_fmt(v)}" + (f"  (target {target[0]} {target[1]}: {res['verdicts'][key]})" if target else ""))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    if args.plot and res["strategies"]:
        plot(res, args.plot)
        log(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
