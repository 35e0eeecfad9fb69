"""Rendering of daemon snapshots: pure functions of a snapshot dict into rich renderables.

Testable with `Console(file=io.StringIO(), width=100)` (STYLE.md "Daemon and CLI").
"""

from __future__ import annotations

import time

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


def _ms(x) -> str:
    return "—" if x is None else f"{x * 1000:.2f}"


def members_table(snap: dict) -> Table:
    t = Table(title="members (ring order, head first)", expand=False)
    for col in ("name", "peer id", "blocks", "head", "pred. ms", "meas. ms", "nat", "state"):
        t.add_column(col)
    for m in snap.get("members") or []:
        b = m.get("blocks")
        state = "lost" if m.get("lost") else ("ready" if m.get("ready") else (m.get("progress") or ""))
        t.add_row(m["name"], m["peer_id"], f"[{b[0]}, {b[1]})" if b else "—", "●" if m.get("head") else "",
                  _ms(m.get("predicted_stage_s")), _ms(m.get("measured_stage_s")), m.get("nat_class") or "—", state)
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
    if not snap.get("session"):
        head.append("not in a session", style="dim")
        return Panel(head, title="kafilad")
    head.append(f"session {snap.get('session')} ({snap.get('role')}) state ", style="")
    style = {"ready": "green", "failed": "red"}.get(snap.get("state"), "yellow")
    head.append(f"{snap.get('state')}", style=f"bold {style}")
    if snap.get("error"):
        head.append(f"\n{snap['error']}", style="red")
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
                + (f" ({plan.get('strategy')})" if plan.get("strategy") not in (None, "kafila") else ""))
        if plan.get("standby"):
            head.append(f"\nstandby (no blocks, ready for healing): {', '.join(plan['standby'])}")
    lg = snap.get("last_generation") or {}
    if lg.get("decode_tokens_per_s"):
        head.append(f"\nlast generation: {lg['decode_tokens_per_s']:.1f} tokens/s decode, "
                    f"ttft {_ms(lg.get('ttft_s'))} ms")
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


def status_json(snap: dict) -> dict:
    """The `status --json` document: members, fleet, plan (+ the rest of the snapshot)."""
    return snap
