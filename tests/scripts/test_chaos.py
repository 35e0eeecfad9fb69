"""scripts/chaos.py, short: members and the rendezvous killed and restarted under a request stream;
every request completes token-identical or fails with a sentence, no daemon exits, and the
session is fully back within 30 s of each fault (issue 8)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chaos.py"


def test_a_short_chaos_run_heals_every_fault(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "40", "--interval", "4", "--seed", "3",
                           "--faults", "kill,rendezvous,freeze", "--root", str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=400)
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert proc.returncode == 0, (report["violations"], proc.stderr[-2000:])
    assert report["faults"] and all(f["recovery_s"] is not None and f["recovery_s"] <= 30 for f in report["faults"])
    assert report["requests_ok"] > 0 and report["violations"] == []
