"""Rendering of daemon snapshots: pure functions of a snapshot dict into rich renderables.

Testable with `Console(file=io.StringIO(), width=100)` (STYLE.md "Daemon and CLI").
"""

from __future__ import annotations

import time

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kafilad.planner.plan import DEFAULT_STRATEGY


def _ms(x) -> str:
    return "—" if x is None else f"{x * 1000:.2f}"


def _gbps(x) -> str:
    return "—" if not x else f"{x / 1e9:.3g}"


def _checked(m: dict) -> str:
    """A member's report against its measured stage (kafilad/planner/trust.py): measured/predicted and verdict."""
    c = m.get("check")
    if not c or c.get("ratio") is None:
        return "—"
    return f"x{c['ratio']:.2f} {c.get('outcome', '')}".strip()


def members_table(snap: dict) -> Table:
    t = Table(title="members (ring order, head first)", expand=False)
    for col in ("name", "peer id", "blocks", "head", "pred. ms", "meas. ms", "reported GB/s", "planned GB/s",
                "meas./pred.", "nat", "state"):
        t.add_column(col)
    for m in snap.get("members") or []:
        b = m.get("blocks")
        state = ("left" if m.get("left") else "lost") if m.get("lost") else ("ready" if m.get("ready") else
                                              ("standby" if m.get("standby") else (m.get("progress") or "")))
        t.add_row(m["name"], m["peer_id"], f"[{b[0]}, {b[1]})" if b else "—", "●" if m.get("head") else "",
                  _ms(m.get("predicted_stage_s")), _ms(m.get("measured_stage_s")),
                  _gbps((m.get("reported") or {}).get("bandwidth_Bps")),
                  _gbps((m.get("planned_with") or {}).get("bandwidth_Bps")), _checked(m),
                  m.get("nat_class") or "—", state)
    return t


def edges_table(snap: dict) -> Table | None:
    edges = snap.get("edges") or []
    if not edges:
        return None
    t = Table(title="ring edges")
    for col in ("from", "to", "path", "predicted", "rtt ms", "sent MB", "upgraded"):
        t.add_column(col)
    for e in edges:
        rtt, sent = e.get("rtt_ms"), e.get("bytes_sent")
        up = e.get("upgraded_at")
        t.add_row(e.get("from", "?"), e.get("to", "?"), e.get("path", "?"), e.get("predicted_path") or "—",
                  "—" if rtt is None else f"{rtt:.2f}", "—" if sent is None else f"{sent / 1e6:.2f}",
                  "—" if not up else time.strftime("%H:%M:%S", time.localtime(up)))
    return t


def status_renderable(snap: dict):
    """The `kafila-ctl status` view of one snapshot."""
    head = Text()
    head.append(f"{snap.get('name')} ", style="bold")
    head.append(f"peer {snap.get('peer_id')}  fingerprint {snap.get('fingerprint')}\n")
    api = snap.get("http")
    if api:  # the daemon's HTTP API (.../v1) and, at its root, the web page (README "Web page")
        head.append(f"API {api}  web page {api.removesuffix('/v1')}/\n")
    if not snap.get("session"):
        head.append("not in a session", style="dim")
        return Panel(head, title="kafilad")
    head.append(f"session {snap.get('session')} ({snap.get('role')}) state ", style="")
    style = {"ready": "green", "failed": "red"}.get(snap.get("state"), "yellow")
    head.append(f"{snap.get('state')}", style=f"bold {style}")
    if snap.get("error"):
        head.append(f"\n{snap['error']}", style="red")
    waits = snap.get("plan_waits")
    if waits:
        left_s = max(0.0, float(waits.get("until", 0)) - time.time())
        head.append(f"\nswitching to a new plan (a member joined or returned) once {waits.get('requests')} running "
                    f"request(s) finish, at most {left_s:.0f} s more; new requests wait", style="yellow")
    rdv = snap.get("rendezvous")
    if isinstance(rdv, str) and rdv != "connected" and snap.get("role") in ("host", "member"):
        why = (snap.get("reconnecting") or snap.get("restoring") or {}).get("reason")
        head.append(f"\nrendezvous: {rdv}{f' — {why}' if why else ''}", style="yellow")
    load = snap.get("load") or {}
    if load.get("progress") and snap.get("state") == "loading":
        head.append(f"\n{load['progress']}: {load.get('done_bytes', 0) / 1e6:.1f} of "
                    f"{load.get('total_bytes', 0) / 1e6:.1f} MB")
    if snap.get("code"):
        head.append(f"\ncode {snap['code']}")
    plan = snap.get("plan") or {}
    if plan:
        head.append(f"\nplan: bottleneck {_ms(plan.get('bottleneck_s'))} ms, circuit {_ms(plan.get('circuit_s'))} ms, "
                    f"utilisation {plan.get('utilization', 0):.0%}, tier {plan.get('tier')}")
        rates = [t for t in plan.get("throughput") or [] if t.get("tokens_per_s")]
        if rates and plan.get("tier") != "memory":
            head.append("\npredicted: " + ", ".join(
                f"{t['tokens_per_s']:.1f} tokens/s for {t['users']} user{'s' if t['users'] > 1 else ''}" for t in rates)
                + f" ({plan.get('strategy') or DEFAULT_STRATEGY})")
        standby = standing_by(snap)
        if standby:
            head.append(f"\nstandby (no blocks, ready for healing): {', '.join(standby)}" + standby_why(plan))
    lg = snap.get("last_generation") or {}
    if lg.get("decode_tokens_per_s"):
        head.append(f"\nlast generation: {lg['decode_tokens_per_s']:.1f} tokens/s decode, "
                    f"ttft {_ms(lg.get('ttft_s'))} ms")
    sched = snap.get("schedule") or {}
    if sched.get("decode_steps"):
        head.append(f"\ndecode: {sched.get('micro_batches', 1)} micro-batch"
                    f"{'es' if sched.get('micro_batches', 1) > 1 else ''} in flight"
                    f"{' (pinned)' if sched.get('pinned') else ''}, {sched['decode_steps']} steps, "
                    f"up to {sched.get('max_batch_rows', 0)} rows")
    spec = snap.get("speculation") or {}
    if spec.get("passes") or (spec and not spec.get("on")):
        gain = f", gain {spec['gain']:.2f}x" if isinstance(spec.get("gain"), (int, float)) else ""
        head.append(f"\nspeculation: {spec.get('accepted', 0)} of {spec.get('drafted', 0)} drafts accepted "
                    f"({100 * spec.get('acceptance', 0):.0f}%), {spec.get('tokens_per_pass', 1):.2f} tokens per pass"
                    f"{gain}" if spec.get("on") else f"\nspeculation: off ({spec.get('why', '')})")
    for stall in (sched.get("stalls") or [])[-3:]:
        head.append(f"\nring stalled {time.strftime('%H:%M:%S', time.localtime(stall.get('at', 0)))}: "
                    f"{stall.get('kind')} of {', '.join(stall.get('reqs') or [])} not back after "
                    f"{stall.get('waited_s', 0):.1f} s (deadline {stall.get('bound_s', 0):.1f} s)", style="red")
    members = snap.get("members") or []
    if snap.get("role") == "host" and members and not any(m.get("nat_class") for m in members) \
            and all(m.get("capability") for m in members):
        head.append("\nNAT classes unknown: the rendezvous serves no STUN (start it with --stun ADDR:PORT)",
                    style="dim")
    parts = [head, members_table(snap)]
    if snap.get("pending"):
        pt = Table(title="pending admission")
        pt.add_column("name")
        pt.add_column("peer id")
        for p in snap["pending"]:
            pt.add_row(p["name"], p["peer_id"])
        parts.append(pt)
    et = edges_table(snap)
    if et is not None:
        parts.append(et)
    return Panel(Group(*parts), title="kafilad")


def standing_by(snap: dict) -> list:
    """Names the plan left on standby that are still in the session: one that left or was lost since
    is not standing by (a trial's status kept naming a member after its `leave`, issue 25 item 6)."""
    gone = {m.get("name") for m in snap.get("members") or [] if m.get("lost")}
    return [n for n in (snap.get("plan") or {}).get("standby") or [] if n not in gone]


def standby_why(plan: dict) -> str:
    """Why the plan (a plan's JSON, strategy "load") leaves members on standby: its predicted rate
    for the declared users against every member holding blocks, and how to use them all."""
    rates = [t for t in plan.get("throughput") or [] if t.get("tokens_per_s")]
    if not rates:
        return ""
    users, rate = rates[-1]["users"], rates[-1]["tokens_per_s"]
    full = plan.get("full_fleet_tokens_per_s")
    vs = (f"{full:.1f} tokens/s with every member holding blocks" if full
          else "every member holding blocks does not fit")
    return (f" — this ring is predicted faster for {users} user{'s' if users > 1 else ''} ({rate:.1f} tokens/s "
            f"against {vs}); `kafila-ctl host --strategy kafila` (or a higher --concurrency) gives every member blocks")


def status_json(snap: dict) -> dict:
    """The `status --json` document: members, fleet, plan (+ the rest of the snapshot)."""
    return snap


# ---- `kafila-ctl join`: the member's way to ready ----------------------------------------------
#: what a member waits for in each state before its stage loads (kafilad/proto/session_events.py MemberState)
JOIN_PHASES = {
    "joining": "joining the session",
    "pending": "waiting for the host to admit this key",
    "admitted": "admitted; measuring this machine",
    "measured": "waiting for the host's plan (it comes once every member has joined)",
    "loading": "loading the stage",
}

#: states that end `kafila-ctl join`'s wait (standby: admitted, and the plan leaves it without blocks)
JOIN_DONE_STATES = ("ready", "standby", "failed", "closed")

#: what a join that ends on standby says (strategy load, proto_spec 05 §2 `standby`)
STANDBY_SENTENCE = ("standing by in session {session}: the plan is faster without this device's blocks, so it "
                    "holds none; it stays in the session and takes blocks when the host plans again (a member "
                    "leaves or returns); `kafila-ctl status` on the host says why")


class RateMeter:
    """Bytes per second of a growing byte count over a sliding window (sans-IO: the caller gives the time).

    Args:
        window_s: samples older than this (relative to the newest) are dropped.
    """

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self._samples: list[tuple[float, int]] = []

    def update(self, now_s: float, done_bytes) -> float | None:
        """Record `done_bytes` at `now_s`; return the rate over the window, or None (no count, too few samples,
        or the count went back, i.e. a new fetch started: the window restarts)."""
        if not isinstance(done_bytes, (int, float)):
            self._samples.clear()
            return None
        if self._samples and done_bytes < self._samples[-1][1]:
            self._samples.clear()
        self._samples.append((now_s, int(done_bytes)))
        while len(self._samples) > 2 and now_s - self._samples[1][0] >= self.window_s:
            self._samples.pop(0)
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        if t1 - t0 <= 0:
            return None
        return (b1 - b0) / (t1 - t0)


def _join_fraction(load: dict) -> float | None:
    total = load.get("total_bytes")
    if not isinstance(total, (int, float)) or total <= 0:
        return None
    return min(1.0, max(0.0, load.get("done_bytes", 0) / total))


def join_phase(snap: dict) -> str:
    """The words for where the member is: its state's phase, or the loading step (fetching, building, ring)."""
    if not snap.get("session"):
        return "not in a session"
    state = snap.get("state")
    load = snap.get("load") or {}
    if state == "loading" and load.get("progress"):
        return "fetching the weights" if load["progress"] == "fetching" else str(load["progress"])
    if state == "ready":
        return "ready"
    if state in ("failed", "closed"):
        return state
    if state == "reconnecting":  # the daemon rejoins its session (kafilad/daemon.py `_reconnecting_snapshot`)
        about = snap.get("reconnecting") or {}
        return (f"reconnecting (attempt {about.get('attempt', '?')}, next try in {about.get('next_in_s', 0):.0f} s)"
                f"{': ' + about['reason'] if about.get('reason') else ''}")
    return JOIN_PHASES.get(str(state), str(state))


def join_outcome(snap: dict) -> str | None:
    """"ready", "failed" or "closed" once the join is over (no session counts as closed), else None."""
    if not snap.get("session"):
        return "closed"
    return snap.get("state") if snap.get("state") in JOIN_DONE_STATES else None


def join_ready_sentence(snap: dict) -> str:
    """The last line of a join that reached ready: blocks, head, and what the load took."""
    b = snap.get("blocks")
    where = f"blocks [{b[0]}, {b[1]})" if b else "no blocks (standby)"
    load = snap.get("load") or {}
    parts = [f"ready in session {snap.get('session')}: {where}{' with the head' if snap.get('head') else ''}"]
    if "fetched_bytes" in load and not load["fetched_bytes"] and load.get("cached_bytes"):
        n = load.get("tensors")
        parts.append(f"all {f'{n} tensors' if n else 'its weights'} already cached "
                     f"({load['cached_bytes'] / 1e6:.1f} MB), loaded in {load.get('load_s', 0):.1f} s")
    elif "fetched_bytes" in load:
        parts.append(f"fetched {load['fetched_bytes'] / 1e6:.1f} MB, {load.get('cached_bytes', 0) / 1e6:.1f} MB "
                     f"from the cache, loaded in {load.get('load_s', 0):.1f} s")
    return "; ".join(parts)


def join_progress_key(snap: dict) -> tuple:
    """What a plain-lines join prints a new line for: a new state, a new loading step, or fetch progress
    crossing a tenth (so a pipe gets at most ~10 fetch lines, not one per tensor)."""
    fraction = _join_fraction(snap.get("load") or {}) if snap.get("state") == "loading" else None
    return (snap.get("session"), snap.get("state"), join_phase(snap),
            None if fraction is None else int(fraction * 10))


def join_progress_line(snap: dict, rate_bytes_per_s: float | None = None) -> str:
    """One plain line of join progress (stdout is not a terminal)."""
    if join_outcome(snap) == "ready":
        return join_ready_sentence(snap)
    if join_outcome(snap) == "standby":
        return STANDBY_SENTENCE.format(session=snap.get("session"))
    phase = join_phase(snap)
    if snap.get("state") == "failed":
        return f"failed: {snap.get('error') or 'no reason given'}"
    load = snap.get("load") or {}
    fraction = _join_fraction(load) if snap.get("state") == "loading" else None
    if fraction is None:
        return phase
    line = (f"{phase}: {fraction:.0%} ({load.get('done_bytes', 0) / 1e6:.1f} of "
            f"{load['total_bytes'] / 1e6:.1f} MB")
    if rate_bytes_per_s is not None and load.get("progress") == "fetching":
        line += f", {rate_bytes_per_s / 1e6:.1f} MB/s"
    return line + ")"


def join_progress_renderable(snap: dict, rate_bytes_per_s: float | None = None):
    """The terminal view of join progress: the phase, a bar (bytes fetched of the stage's bytes; a pulse
    before the plan names them), MB done of total and the fetch rate."""
    from rich.progress_bar import ProgressBar
    outcome = join_outcome(snap)
    if outcome == "ready":
        return Text(join_ready_sentence(snap), style="green")
    if outcome == "standby":
        return Text(STANDBY_SENTENCE.format(session=snap.get("session")), style="green")
    if outcome == "failed":
        return Text(f"failed: {snap.get('error') or 'no reason given'}", style="red")
    if outcome == "closed":
        return Text(join_phase(snap), style="yellow")
    load = snap.get("load") or {}
    fraction = _join_fraction(load) if snap.get("state") == "loading" else None
    grid = Table.grid(padding=(0, 1))
    for _ in range(4):
        grid.add_column()
    if fraction is None:
        grid.add_row(Text(join_phase(snap), style="yellow"), ProgressBar(total=None, width=30, animation_time=0.0),
                     "", "")
    else:
        rate = "" if rate_bytes_per_s is None or load.get("progress") != "fetching" \
            else f"{rate_bytes_per_s / 1e6:.1f} MB/s"
        grid.add_row(Text(join_phase(snap), style="yellow"),
                     ProgressBar(total=float(load["total_bytes"]), completed=float(load.get("done_bytes", 0)),
                                 width=30),
                     f"{load.get('done_bytes', 0) / 1e6:.1f}/{load['total_bytes'] / 1e6:.1f} MB {fraction:.0%}", rate)
    return grid
