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


DEFAULT_PORT = 8400


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_daemons_started_together_without_http_all_run_and_one_serves_the_default_port(tmp_path):
    """Issue 25 item 6: three daemons started at the same moment without `--http` (a demo script, a
    boot) each found 127.0.0.1:8400 free, closed their probe, then bound it: two of the three exited
    with "The HTTP API cannot listen on 127.0.0.1:8400: Address already in use". The README promises
    a warning and a daemon without the API."""
    import time
    import pytest
    import trio
    from kafila_ctl.client import ControlClient, DaemonNotRunning
    from kafilad.errors import KafilaError
    if not _port_free(DEFAULT_PORT):
        pytest.skip(f"127.0.0.1:{DEFAULT_PORT}, the HTTP API's default port, is in use on this machine")
    states = [tmp_path / f"d{i}" for i in range(3)]
    procs = [subprocess.Popen(DAEMON + ["--state-dir", str(s)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for s in states]
    try:
        snaps = []
        deadline = time.monotonic() + 60
        for p, state in zip(procs, states):
            while True:
                if p.poll() is not None:
                    pytest.fail(f"a daemon exited ({p.returncode}): {p.stderr.read().decode()[-400:]}")
                assert time.monotonic() < deadline, "a daemon did not start"
                try:
                    snaps.append(trio.run(lambda: ControlClient(state / "kafilad.sock").call("status")))
                    break
                except (DaemonNotRunning, KafilaError):  # not up yet, or shutting down (then it exits)
                    time.sleep(0.05)
        time.sleep(1)  # the API starts just after the control socket
        snaps = [trio.run(lambda s=s: ControlClient(s / "kafilad.sock").call("status")) for s in states]
        assert all(p.poll() is None for p in procs)
        serving = [s["http"] for s in snaps if s["http"]]
        assert serving == [f"http://127.0.0.1:{DEFAULT_PORT}/v1"], [s["http"] for s in snaps]
        for state, snap in zip(states, snaps):
            if not snap["http"]:
                log = (state / "kafilad.log").read_text()
                assert f"The HTTP API's default address 127.0.0.1:{DEFAULT_PORT} is taken" in log
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(15)


def test_an_api_reachable_from_other_machines_needs_a_key(tmp_path):
    """Issue 22 §3: `--http 0.0.0.0:PORT` served everyone with no key and no warning. Now it refuses
    to start without one (unless --http-insecure); with one, a request without it is 401."""
    import json
    import os
    import time
    import urllib.error
    import urllib.request
    r = subprocess.run(DAEMON + ["--state-dir", str(tmp_path / "a"), "--http", "0.0.0.0:0"],
                       capture_output=True, text=True, timeout=30, env={**os.environ, "KAFILA_API_KEYS": ""})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "kafilad: The HTTP API would listen on 0.0.0.0, which other machines can reach, with no API key" in r.stderr
    assert "--http-insecure" in r.stderr and not (tmp_path / "a" / "kafilad.sock").exists()
    r = subprocess.run(DAEMON + ["--state-dir", str(tmp_path / "b"), "--http", "0.0.0.0:0", "--api-key", "short"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "at least 16 characters" in r.stderr

    key = "test-key-0123456789abcdef"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    state = tmp_path / "c"
    p = subprocess.Popen(DAEMON + ["--state-dir", str(state), "--http", f"0.0.0.0:{port}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "KAFILA_API_KEYS": key})

    def get(path: str, headers: dict) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers),
                                        timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert p.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        status, body = get("/v1/models", {})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, body = get("/api/tags", {"authorization": "Bearer not-the-key-0123456789"})
        assert status == 401 and set(body) == {"error"}
        status, body = get("/api/tags", {"authorization": f"Bearer {key}"})
        assert status == 200 and body == {"models": []}
        assert get("/health", {}) == (503, {"status": "unavailable"})
    finally:
        p.terminate()
        p.wait(15)
