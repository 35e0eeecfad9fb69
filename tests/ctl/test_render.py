"""kafila-ctl rendering is a pure function of a daemon snapshot (STYLE.md "Daemon and CLI")."""

from __future__ import annotations

import io

from rich.console import Console

from kafila_ctl.render import status_renderable

SNAPSHOT = {
    "name": "m0", "peer_id": "aupd55mb", "fingerprint": "xyen5mkkxkruilz7", "session": "rklt7mxf", "role": "host",
    "state": "ready", "error": None, "code": "rklt7mxf-xyen5mkkxkruilz7",
    "members": [
        {"name": "m0", "peer_id": "aupd55mb", "blocks": [0, 3], "head": True, "predicted_stage_s": 0.000766,
         "measured_stage_s": 0.00081, "ready": True, "lost": None, "nat_class": "C"},
        {"name": "m1", "peer_id": "prqlnsqi", "blocks": [3, 4], "head": False, "predicted_stage_s": 0.000905,
         "measured_stage_s": None, "ready": True, "lost": None, "nat_class": "S"},
    ],
    "pending": [{"peer_id": "zzzzzzzz", "name": "laptop"}],
    "edges": [{"from": "m0", "to": "m1", "path": "direct", "rtt_ms": 0.42},
              {"from": "m1", "to": "m0", "path": "relayed", "rtt_ms": None}],
    "plan": {"bottleneck_s": 0.000905, "circuit_s": 0.00167, "utilization": 0.85, "tier": "cost-model"},
    "last_generation": {"decode_tokens_per_s": 135.3, "ttft_s": 0.0186},
}


def render(snap: dict) -> str:
    buf = io.StringIO()
    Console(file=buf, width=110, color_system=None).print(status_renderable(snap))
    return buf.getvalue()


def test_status_view_shows_ring_plan_edges_and_pending():
    out = render(SNAPSHOT)
    assert "session rklt7mxf (host) state ready" in out
    assert "[0, 3)" in out and "[3, 4)" in out
    assert "0.77" in out and "0.81" in out and "0.91" in out  # predicted / measured ms
    assert "bottleneck 0.91 ms" in out and "utilisation 85%" in out and "tier cost-model" in out
    assert "135.3 tokens/s" in out and "ttft 18.60 ms" in out
    assert "laptop" in out and "zzzzzzzz" in out
    lines = [ln for ln in out.splitlines() if "relayed" in ln or "direct" in ln]
    assert any("m0" in ln and "m1" in ln and "direct" in ln and "0.42" in ln for ln in lines)
    assert any("relayed" in ln for ln in lines)


def test_idle_and_failed_views():
    idle = render({"name": "m9", "peer_id": "p", "fingerprint": "f", "session": None})
    assert "not in a session" in idle
    failed = render({**SNAPSHOT, "state": "failed", "error": "member m1 (prqlnsqi) left the session: killed"})
    assert "state failed" in failed and "member m1 (prqlnsqi) left the session: killed" in failed


def test_hint_when_no_member_has_a_nat_class():
    members = [{**m, "nat_class": None, "capability": {"memory_bytes": 1}} for m in SNAPSHOT["members"]]
    out = render({**SNAPSHOT, "members": members})
    assert "NAT classes unknown: the rendezvous serves no STUN" in out
    assert "NAT classes unknown" not in render(SNAPSHOT)


def test_schedule_and_ring_stalls_are_shown():
    sched = {"micro_batches": 2, "pinned": None, "decode_steps": 120, "max_batch_rows": 3,
             "stalls": [{"reqs": ["r7"], "kind": "decode step", "waited_s": 10.4, "bound_s": 10.0, "at": 0}]}
    out = render({**SNAPSHOT, "schedule": sched})
    assert "decode: 2 micro-batches in flight, 120 steps, up to 3 rows" in out
    assert "decode step of r7 not back after 10.4 s (deadline 10.0 s)" in out
    assert "micro-batch" not in render(SNAPSHOT)


def test_a_member_that_left_reads_left_and_one_lost_reads_lost():
    gone = [{"name": "m2", "peer_id": "q2q2q2q2", "blocks": None, "head": False, "ready": False,
             "lost": "it is leaving: its user ran `kafila-ctl leave`", "left": True},
            {"name": "m3", "peer_id": "q3q3q3q3", "blocks": None, "head": False, "ready": False,
             "lost": "m3 sent nothing for 8 s (frozen, asleep or cut off)", "left": False}]
    cells = {}
    for ln in render({**SNAPSHOT, "members": SNAPSHOT["members"] + gone}).splitlines():
        parts = [c.strip() for c in ln.split("│") if c.strip()]
        if parts and parts[0] in ("m0", "m1", "m2", "m3") and len(parts) > 2:  # a member row: name ... state
            cells.setdefault(parts[0], parts[-1])  # the members table comes before the edges table
    assert cells == {"m0": "ready", "m1": "ready", "m2": "left", "m3": "lost"}


def test_a_member_rejoining_while_the_rendezvous_is_down_reads_reconnecting_with_the_attempt_and_why():
    from kafila_ctl.render import join_phase
    why = "Cannot reach the rendezvous at ws://r:7400: Connection refused. Check the URL and that the rendezvous is running."
    snap = {**SNAPSHOT, "role": "member", "state": "reconnecting", "members": [], "plan": None, "edges": [],
            "pending": [], "last_generation": None, "rendezvous": "reconnecting (attempt 3, next in 4 s)",
            "reconnecting": {"attempt": 3, "next_in_s": 4.2, "reason": why}}
    out = " ".join(render(snap).split())
    assert "state reconnecting" in out and "failed" not in out
    assert "rendezvous: reconnecting (attempt 3, next in 4 s) — Cannot reach the rendezvous at ws://r:7400" in out
    assert join_phase(snap) == f"reconnecting (attempt 3, next try in 4 s): {why}"
    assert "rendezvous:" not in render(SNAPSHOT)  # connected: nothing to say


def test_a_restarted_host_registering_its_session_again_reads_restoring_with_the_attempt_and_why():
    why = "Cannot reach the rendezvous at ws://r:7400: Connection refused. Check the URL and that the rendezvous is running."
    snap = {**SNAPSHOT, "state": "restoring", "members": [], "plan": None, "edges": [], "pending": [],
            "last_generation": None, "rendezvous": "re-registering the session (attempt 2, next in 1 s)",
            "restoring": {"attempt": 2, "next_in_s": 1.1, "reason": why}}
    out = " ".join(render(snap).replace("│", " ").split())  # the panel's lines, joined
    assert "session rklt7mxf (host) state restoring" in out
    assert f"rendezvous: re-registering the session (attempt 2, next in 1 s) — {why}" in out


def test_status_shows_the_api_and_web_page_address():
    """README "Web page": the address `status` shows; absent when the daemon serves no HTTP API."""
    out = render({**SNAPSHOT, "http": "http://127.0.0.1:8400/v1"})
    assert "API http://127.0.0.1:8400/v1  web page http://127.0.0.1:8400/" in out
    idle = render({"name": "m9", "peer_id": "p", "fingerprint": "f", "session": None, "http": "http://127.0.0.1:8401/v1"})
    assert "web page http://127.0.0.1:8401/" in idle
    assert "API" not in render(SNAPSHOT)
