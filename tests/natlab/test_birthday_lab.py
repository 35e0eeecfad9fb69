"""C×S and S×S direct by birthday probing, in the real NAT lab (issue 11 "Done when"; proto_spec 07 §7b).

- Path level, C,S: two real PathManagers (tests/natlab/birthday_peer.py, one per member
  namespace) meet through the real rendezvous in kf-rdv and make 10 attempts on one edge, each a
  birthday search (the S end's 256 extra sockets, the C end's port sweep), then ICE, QUIC and
  Noise over the pair found, with one frame each way. At least 9 of 10 must be direct, each
  within 10 s of the attempt's start (the real edge starts it as soon as its relay is up). Between
  tries both NATs forget the previous try's flows (unreplied-UDP timeout 5 s, a 6 s pause), so
  each try starts from cold NATs.
- Path level, S,S: tried (3 attempts) and reported; the paper predicts relay.
- Session level, C,S: real daemons; both ring edges form relayed (predicted), then upgrade to
  direct by birthday probing within 10 s of their relay being up (make before break), status
  says so, and the ring serves the reference tokens.

Measured numbers: docs/nat-birthday.md (``pytest -s`` prints every attempt).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from kafila_testing import reference_tokens

from .conftest import require_lab
from .lab import RDV_IPS, STUN_GRID, Lab, _background
from .test_paths_lab import LabCluster

PEER = Path(__file__).resolve().parent / "birthday_peer.py"
RDV_PORT = 7400
#: Unreplied-UDP conntrack timeout in the lab NATs during the path-level tries, and the pause
#: that lets a try's flows expire before the next (the peer script pauses 1 s itself).
COLD_TIMEOUT_S = 5
PAUSE_S = 6.0
PROMPT = "Once upon a time"


def _cold_nats(lab: Lab, timeout_s: int) -> None:
    for nat in ("nat1", "nat2"):
        r = lab.run(nat, "sysctl", "-qw", f"net.netfilter.nf_conntrack_udp_timeout={timeout_s}")
        assert r.returncode == 0, r.stderr


def _attempts(lab: Lab, rounds: int, *, pause_s: float, timeout_s: float) -> tuple[list[dict], list[dict], str]:
    """Run the two peers for ``rounds`` attempts; (host rows, join rows, logs)."""
    root = Path(tempfile.mkdtemp(prefix="kl-bd-"))
    stun = [a for ip, port in STUN_GRID for a in ("--stun", f"{ip}:{port}")]
    rdv = lab.python("rdv", "-m", "kafilad.main", "rendezvous", "--listen", f"{RDV_IPS[0]}:{RDV_PORT}", *stun)
    url, code = f"ws://{RDV_IPS[0]}:{RDV_PORT}", root / "code"
    with _background(lab, rdv, root / "rdv.log", STUN_GRID):
        procs = {}
        for kind, member in (("host", "m1"), ("join", "m2")):
            argv = lab.python(member, str(PEER), kind, url, str(code), str(rounds), str(pause_s))
            procs[kind] = subprocess.Popen(argv, stdout=open(root / f"{kind}.out", "w"),
                                           stderr=open(root / f"{kind}.err", "w"))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
            time.sleep(0.2)
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    rows = {k: [json.loads(line) for line in (root / f"{k}.out").read_text().splitlines() if line.startswith("{")]
            for k in procs}
    logs = "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-4000:]}" for f in sorted(root.glob("*.err")))
    return rows["host"], rows["join"], logs


def _report(label: str, host: list[dict], join: list[dict]) -> None:
    for h in host:
        j = next((r for r in join if r["try"] == h["try"]), {})
        hb, jb = h.get("birthday") or {}, j.get("birthday") or {}
        print(f"{label} try {h['try']}: ok={h['ok']} took_s={h['took_s']} {hb.get('role')} probes={hb.get('probes')} "
              f"/ {jb.get('role')} probes={jb.get('probes')} sockets={jb.get('sockets')} remote={h.get('remote')} "
              f"reason={h['reason']!r}")


@pytest.mark.parametrize("natlab", [("C", "S")], indirect=True)
def test_c_and_s_go_direct_by_birthday_probing_in_nine_of_ten_tries(natlab):
    require_lab()
    _cold_nats(natlab, COLD_TIMEOUT_S)
    try:
        host, join, logs = _attempts(natlab, 10, pause_s=PAUSE_S, timeout_s=400)
    finally:
        _cold_nats(natlab, 30)
    _report("C,S", host, join)
    assert len(host) == 10, logs
    assert {r["nat_class"] for r in host} == {"C"} and {r["nat_class"] for r in join} == {"S"}, logs
    good = [r for r in host if r["ok"] and r["echo"] and r["took_s"] < 10.0]
    assert len(good) >= 9, (host, logs)
    for h in good:
        (j,) = [r for r in join if r["try"] == h["try"]]
        assert j["ok"] and j["echo"], (j, logs)
        assert h["birthday"]["role"] == "sweep" and h["birthday"]["tries"] == h["try"]
        assert j["birthday"]["role"] == "pool" and j["birthday"]["sockets"] == 256
        assert h["birthday"]["probes"] <= 2048 + 32 and j["birthday"]["probes"] <= 3 * 256 + 32
        # the path: the C end's daemon socket <-> one of the S end's extra sockets
        assert h["local_port"] == h["daemon_port"] and j["local_port"] != j["daemon_port"]
        assert h["remote"].startswith("172.16.0.22:") and j["remote"] == f"172.16.0.21:{h['local_port']}"
    print("C,S: %d/10 direct; median took_s %.2f; median sweep probes %d" % (
        len(good), statistics.median(r["took_s"] for r in good),
        statistics.median(r["birthday"]["probes"] for r in good)))


@pytest.mark.parametrize("natlab", [("S", "S")], indirect=True)
def test_s_and_s_birthday_probing_is_tried_and_reported(natlab):
    require_lab()
    _cold_nats(natlab, COLD_TIMEOUT_S)
    try:
        host, join, logs = _attempts(natlab, 3, pause_s=PAUSE_S, timeout_s=200)
    finally:
        _cold_nats(natlab, 30)
    _report("S,S", host, join)
    assert len(host) == 3, logs
    for h in host:
        b = h["birthday"]
        assert b is not None and b["tries"] == h["try"] and b["role"] == "both" and b["sockets"] == 256, h
        assert b["probes"] <= 2048 + 32, h
        if not h["ok"]:  # the search ran to its bound and said why
            assert h["reason"].startswith("no birthday probe answered within 8 s"), h  # its own bound, said
    print("S,S: %d/3 direct (the paper predicts relay)" % sum(r["ok"] for r in host))


@pytest.mark.parametrize("natlab", [("C", "S")], indirect=True)
def test_a_c_s_session_relays_then_goes_direct_by_birthday_probing(natlab):
    require_lab()
    from kafilad.executor.synth import default_synth_model_dir
    model = default_synth_model_dir()
    expected = reference_tokens(model, PROMPT, 24)
    cluster = LabCluster(natlab)
    cluster.__enter__()
    try:
        snap = cluster.form_in_order(str(model))
        assert [m["nat_class"] for m in snap["members"]] == [natlab.class_of(m["name"]) for m in snap["members"]]
        assert all(e["predicted_path"] == "relayed" for e in snap["edges"]), snap["edges"]
        formed_at = time.monotonic()
        while True:
            edges = cluster.call(0, "status")["edges"]
            if all(e["path"] == "direct" for e in edges):
                break
            assert time.monotonic() - formed_at < 30.0, (edges, cluster.logs())
            time.sleep(0.2)
        for e in edges:
            assert e["upgraded_from"] == "relayed" and e["tries"] == 1, e
            assert e["birthday"]["probes"] > 0 and e["birthday"]["sockets"] in (1, 256), e
            assert e["direct_after_s"] > 0, e  # from its relay being up to the switch (how long: load)
            assert e["remote"].startswith("172.16.0.2"), e
        assert cluster.generate(PROMPT, 24)["token_ids"] == expected
        trace = cluster.call(0, "trace")
        gen = [ev for ev in trace if ev["event"] == "generation"][-1]
        assert set(gen["path"].values()) == {"direct"}
        # the host's own path events: its search (probes, time) and the upgrade it made
        searches = [ev for ev in trace if ev["event"] == "path" and ev["path_event"] == "birthday"]
        assert searches and all(ev["probes"] > 0 and ev["search_s"] > 0 for ev in searches), searches
        assert any(ev["ok"] for ev in searches), searches
        upgrades = [ev for ev in trace if ev["event"] == "path" and ev["path_event"] == "edge_upgraded"]
        assert upgrades and all(ev["via"] == "birthday" and ev["direct_after_s"] > 0 for ev in upgrades), upgrades
        print("C,S session: " + "; ".join(f"{e['from']}->{e['to']} direct_after_s={e['direct_after_s']} "
                                          f"birthday={e['birthday']}" for e in edges))
    finally:
        cluster.__exit__(None, None, None)
