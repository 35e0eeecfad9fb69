"""`kafilad --http` as a user meets it (issue 9): addresses are checked before the daemon runs."""

from __future__ import annotations

import socket
import subprocess
import sys

DAEMON = [sys.executable, "-m", "kafilad.main"]


def test_http_addresses_are_refused_with_sentences(tmp_path):
    """Issue 9: an out-of-range port never wraps to another; a port in use refuses the start."""
    r = subprocess.run(DAEMON + ["--state-dir", str(tmp_path / "a"), "--http", "127.0.0.1:849115028"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "'127.0.0.1:849115028' is not HOST:PORT with a port between 0 and 65535" in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run(DAEMON + ["--state-dir", str(tmp_path / "b"), "--http", str(port)],  # a bare port
                           capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"kafilad: The HTTP API cannot listen on 127.0.0.1:{port}: Address already in use" in r.stderr
    assert not (tmp_path / "b" / "kafilad.sock").exists()


def test_a_bare_port_means_localhost(tmp_path):
    import time
    from kafila_ctl.client import ControlClient
    import trio
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    state = tmp_path / "s"
    p = subprocess.Popen(DAEMON + ["--state-dir", str(state), "--http", str(port)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not (state / "kafilad.sock").exists():
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        while (snap := trio.run(lambda: ControlClient(state / "kafilad.sock").call("status")))["http"] is None:
            assert time.monotonic() < deadline  # the API starts just after the control socket
            time.sleep(0.05)
        assert snap["http"] == f"http://127.0.0.1:{port}/v1"
    finally:
        p.terminate()
        p.wait(15)
