"""scripts/bench_fleet.py's fleet: emulated members in cgroup v1 groups, their daemons, the model.

Each member of the fleet is a real `kafilad` daemon on loopback (kafila_ctl.demo.LoopbackCluster)
in its own CPU-quota group (10 ms period) and memory group (scripts/cg.sh; DESIGN §9 item 4;
../shared/fleet-emulation.md). Two ways to tell the planner what each member can do
(`--calibration`):

* ``probe`` (the default): each daemon starts inside both of its groups, so the daemon's own probe
  (kafilad/executor/probe.py `measure_capability`, which it runs when it hosts or is admitted)
  times its blocks under its quota and memory limit: what a real slow device reports about
  itself. Its weights load under the quota too.
* ``scaled`` (the earlier method, for comparison): each daemon starts in its memory group only and
  joins its CPU group once the session is `ready`; the probe runs once, unthrottled, in a child
  process (`base_capability`), and a member at quota q reports bandwidth q x base and step
  overhead base / q through KAFILA_TEST_CAPABILITY (`scaled_capability`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
CG = REPO / "scripts" / "cg.sh"
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000  # DESIGN §9 item 4: the default 100 ms period makes steps bimodal
GROUP_PREFIX = "bf_"  # cg.sh names the groups fleet_<NAME>: fleet_bf_<member>
#: how members learn their capability (module docstring)
CALIBRATIONS = ("probe", "scaled")


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


class Cgroups:
    """The fleet's cgroup v1 groups (scripts/cg.sh); `close` removes them (idempotent).

    With `calibration` "probe" a daemon starts inside both of its member's groups (`wrap`), so its
    own capability probe runs under the quota; with "scaled" it starts in the memory group only
    and `throttle` moves it into the CPU group later (module docstring).
    """

    def __init__(self, fleet: Sequence[Member], enabled: bool, calibration: str = "probe"):
        if calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}, not {calibration!r}")
        self.fleet, self.enabled, self.calibration, self.made = list(fleet), enabled, calibration, []

    def make(self) -> None:
        if not self.enabled:
            return
        for m in self.fleet:
            subprocess.run(["bash", str(CG), "mk", m.group, str(m.quota_pct), str(m.mem_mb), str(PERIOD_US)],
                           check=True, capture_output=True, text=True)
            self.made.append(m)

    def wrap(self, member: Member, argv: list[str]) -> list[str]:
        """`argv` run inside the member's groups: both ("probe"), or the memory group only ("scaled":
        it joins its CPU group later, `throttle`). Unchanged without cgroups."""
        if not self.enabled:
            return argv
        return ["bash", str(CG), "run" if self.calibration == "probe" else "runmem", member.group, *argv]

    def throttle(self, member: Member, pid: int) -> None:
        """Move `pid` (all its threads) into the member's CPU group (a no-op where it started there)."""
        if self.enabled and self.calibration == "scaled":
            (CPU_CGROUP / f"fleet_{member.group}" / "cgroup.procs").write_text(str(pid))

    def stat(self, member: Member) -> str:
        if not self.enabled:
            return ""
        return subprocess.run(["bash", str(CG), "stat", member.group], capture_output=True, text=True).stdout.strip()

    def close(self) -> None:
        for m in self.made:
            subprocess.run(["bash", str(CG), "rm", m.group], capture_output=True)
        self.made = []


def process_cpu_s(pid: int) -> Optional[float]:
    """CPU seconds (user + system, all threads) process `pid` has used, from /proc/PID/stat; None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def cpu_shares(before: Sequence[Optional[float]], after: Sequence[Optional[float]], wall_s: float) -> list:
    """Per process, the fraction of one core it used over `wall_s` (None where unknown): set against
    a member's quota it says whether the member got its quota (a starved member on an oversubscribed
    machine is slower than its quota stands for) or was idle part of the time."""
    return [None if b is None or a is None or wall_s <= 0 else (a - b) / wall_s for b, a in zip(before, after)]


def capability_env(base_cap: Optional[dict], member: Member) -> dict:
    """The environment a member's daemon gets beyond the cluster's: with a base capability (the
    "scaled" calibration) KAFILA_TEST_CAPABILITY = its `scaled_capability`; without (the daemon
    probes itself) nothing."""
    if base_cap is None:
        return {}
    from kafilad.node.serving.stagehost import TEST_CAPABILITY_ENV
    return {TEST_CAPABILITY_ENV: json.dumps(scaled_capability(base_cap, member.quota_pct))}


def reported_capabilities(fleet_json: Optional[dict]) -> dict:
    """{name: {bandwidth_Bps, step_overhead_s, batch_row_cost}} of the devices in a session's
    `fleet` (the host's status snapshot): what each member's capability report said."""
    out = {}
    for d in (fleet_json or {}).get("devices") or []:
        out[d.get("name")] = {k: d.get(k) for k in ("bandwidth_Bps", "step_overhead_s", "batch_row_cost")}
    return out


def _cluster_class():
    from kafila_ctl.demo import LoopbackCluster

    class FleetCluster(LoopbackCluster):
        """LoopbackCluster whose daemons start in their members' groups (`Cgroups.wrap`), with the
        scaled capability when `base_cap` is given."""

        def __init__(self, members: Sequence[Member], cgroups: Cgroups, base_cap: Optional[dict], root: Optional[str],
                     hop_delay_ms: Optional[float] = None, hop_mbps: Optional[float] = None):
            self.members, self.cgroups, self.base_cap = list(members), cgroups, base_cap
            super().__init__(len(members), names=[m.name for m in members], root=root,
                             env={"OPENBLAS_NUM_THREADS": "1"}, hop_delay_ms=hop_delay_ms, hop_mbps=hop_mbps)

        def daemon_argv(self, i: int) -> list[str]:
            return self.cgroups.wrap(self.members[i], super().daemon_argv(i))

        def daemon_env(self, i: int) -> dict:
            return {**super().daemon_env(i), **capability_env(self.base_cap, self.members[i])}  # the hops' too

        def cpu_s(self) -> list:
            """CPU seconds each daemon has used so far (`process_cpu_s`)."""
            return [process_cpu_s(p.pid) for p in self.daemons]

        def throttle_all(self) -> None:
            for m, p in zip(self.members, self.daemons):
                self.cgroups.throttle(m, p.pid)
    return FleetCluster


def form(c, model_dir: Path, *, strategy: str, concurrency: int, context: int, timeout_s: float = 600.0) -> dict:
    """Host on daemon 0 with `strategy`, join with the others, wait until ready; the ready snapshot.

    The host trusts the members' reports (`host --head any`, issue 22 item 5): the benchmark measures
    the planner's division of the fleet as reported, which a check of the reports against measured
    stage times would otherwise replan in the middle of a measurement."""
    import trio
    code = c.call(0, "host", model_dir=str(model_dir), members=c.n, context=context, concurrency=concurrency,
                  open=True, strategy=strategy, head="any")["code"]

    async def join_all():
        async with trio.open_nursery() as nursery:
            for i in range(1, c.n):
                nursery.start_soon(lambda i=i: c.client(i).call("join", code=code))
    trio.run(join_all)
    c.call(0, "wait", states=["ready"], timeout_s=timeout_s)
    return settle(c, timeout_s=timeout_s)


#: how long `settle` waits for relayed ring edges to go direct (their first re-probe comes 10 s after
#: formation, kafilad/node/paths/manager.py REPROBE_INITIAL_S) before it takes them as they are
DIRECT_WAIT_S = 60.0


def settle(c, *, timeout_s: float = 120.0, direct_wait_s: float = DIRECT_WAIT_S) -> dict:
    """Wait until every ring edge is direct and reported its settled round trip (proto_spec 07 §6
    `path_rtt_ms`, a few seconds of PINGs) and the session is ready on the plan those made (the host
    plans again when they move its hops: docs/planner.md "Measured round trips"); the status.

    An edge whose checks failed while a slow member loaded starts relayed and is upgraded by a
    re-probe later; measuring before that would time a ring whose hops (and plan) then change, so
    relayed edges are waited for up to `direct_wait_s`, then taken as they are (said on stderr)."""
    from kafilad.node.paths.edge import RTT_SETTLED_SAMPLES
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while True:
        st = c.call(0, "status")
        edges = st.get("edges") or []
        relayed = [f"{e.get('from')} -> {e.get('to')}" for e in edges if e.get("path") != "direct"]
        settled = all(e.get("path") != "direct" or (e.get("rtt_samples") or 0) >= RTT_SETTLED_SAMPLES for e in edges)
        if relayed and time.monotonic() - t0 < direct_wait_s:
            settled = False
        elif relayed and settled:
            print(f"settle: edges {', '.join(relayed)} still not direct after {direct_wait_s:.0f} s; measuring "
                  "them as they are", file=sys.stderr)
        if st["state"] == "ready" and settled:
            time.sleep(1.0)  # a report handled a moment after it showed: the plan must have stayed
            again = c.call(0, "status")
            if again["state"] == "ready" and again.get("plan") == st.get("plan"):
                return again
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ring's round trips did not settle in {timeout_s:.0f} s: state {st['state']}, "
                               f"edges {st.get('edges')}")
        time.sleep(0.5)


def rounds(fn, runs: int) -> tuple[float, list[float]]:
    """Median of `runs` calls after one discarded warm-up call, and the samples."""
    samples = [fn() for _ in range(runs + 1)][1:]
    return statistics.median(samples), samples
