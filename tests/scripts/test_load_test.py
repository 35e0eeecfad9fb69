"""scripts/load_test.py, short: 20 clients (normal, slow, hostile) for 4 s against a real 3-member
ring on loopback. The full run (200 clients, 60 s) and its numbers are in docs/load-test.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_a_short_load_run_keeps_every_daemon_up_and_serves_or_refuses_every_normal_request(tmp_path):
    out = tmp_path / "load.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "load_test.py"), "--clients", "20", "--duration", "4",
                        "--concurrency", "1", "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["daemon_exits"] == {} and report["alive_after"] == ["m0", "m1", "m2"]
    normal = report["outcomes"]["normal"]
    assert normal.get("served", 0) >= 1 and set(normal) <= {"served", "refused_429"}
    assert report["max_running"] <= 1 and report["max_queued"] <= 4  # --concurrency 1: a queue of 4
    assert report["token_identical_after"] and all(v > 0 for v in report["peak_rss_mib"].values())
