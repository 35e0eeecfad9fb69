"""`kafilad rendezvous` as a user starts it: one line says where it listens (a new user's report,
2026-12-01: the line came twice, once printed, once logged). A real process."""

from __future__ import annotations

import signal
import subprocess
import sys
import time


def test_the_rendezvous_says_once_where_it_listens(tmp_path):
    out = tmp_path / "output"
    with open(out, "w") as f:  # stdout and stderr together, as a terminal shows them
        p = subprocess.Popen([sys.executable, "-m", "kafilad.main", "rendezvous", "--listen", "127.0.0.1:0"],
                             stdout=f, stderr=f)
    try:
        deadline = time.monotonic() + 30
        while "listening" not in out.read_text() and time.monotonic() < deadline:
            assert p.poll() is None, out.read_text()
            time.sleep(0.05)
        time.sleep(0.5)  # a second line would follow at once
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=20) == 0, out.read_text()
    finally:
        if p.poll() is None:
            p.kill()
    lines = [ln for ln in out.read_text().splitlines() if "listening" in ln]
    assert len(lines) == 1, out.read_text()
    assert lines[0].startswith("rendezvous listening on ws://127.0.0.1:"), lines  # what LoopbackCluster parses
