"""Ctrl-C (SIGINT) stops a rendezvous cleanly: exit 0, no traceback (a new user's report, 2026-12-01)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time


def test_ctrl_c_stops_the_rendezvous_without_a_traceback(tmp_path):
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "kafilad.main", "rendezvous", "--listen", "127.0.0.1:0"],
                             stdout=f, stderr=f)  # its "listening" line is on stdout
    try:
        deadline = time.monotonic() + 30
        while "listening" not in err.read_text() and time.monotonic() < deadline:
            assert p.poll() is None, err.read_text()
            time.sleep(0.05)
        assert "listening" in err.read_text(), err.read_text()
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=20) == 0, err.read_text()
    finally:
        if p.poll() is None:
            p.kill()
    assert "Traceback" not in err.read_text(), err.read_text()
