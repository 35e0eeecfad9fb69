"""The daemon and kafila-ctl as a user meets them: real processes, real Unix sockets."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

CTL = [sys.executable, "-m", "kafila_ctl.cli"]
DAEMON = [sys.executable, "-m", "kafilad.main"]


def ctl(state_dir, *args, timeout=60):
    return subprocess.run(CTL + ["--state-dir", str(state_dir), *args], capture_output=True, text=True, timeout=timeout)


def test_ctl_says_plainly_when_no_daemon_answers(tmp_path):
    r = ctl(tmp_path / "nobody", "status")
    assert r.returncode == 1
    assert f"kafilad is not running at {tmp_path / 'nobody' / 'kafilad.sock'}" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture
def daemon(tmp_path):
    state = tmp_path / "state"
    log = open(tmp_path / "daemon.log", "wb")
    p = subprocess.Popen(DAEMON + ["--state-dir", str(state), "--name", "alpha", "--http", "127.0.0.1:0"],
                         stdout=log, stderr=log)
    sock = state / "kafilad.sock"
    deadline = time.monotonic() + 20
    while not sock.exists():
        assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
        time.sleep(0.05)
    yield p, state
    if p.poll() is None:
        p.kill()
        p.wait()


def test_keys_files_modes_and_clean_sigterm(daemon):
    p, state = daemon
    r = ctl(state, "keys", "--json")
    assert r.returncode == 0, r.stderr
    import json
    keys = json.loads(r.stdout)
    assert keys["name"] == "alpha" and len(keys["peer_id"]) == 8 and len(keys["fingerprint"]) == 16
    assert stat.S_IMODE(os.stat(state / "static_key").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(state / "kafilad.sock").st_mode) == 0o600
    # the identity is stable across restarts
    p.send_signal(signal.SIGTERM)
    assert p.wait(15) == 0
    assert not (state / "kafilad.sock").exists()
    p2 = subprocess.Popen(DAEMON + ["--state-dir", str(state), "--name", "alpha", "--http", "127.0.0.1:0"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not (state / "kafilad.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        again = json.loads(ctl(state, "keys", "--json").stdout)
        assert again["peer_id"] == keys["peer_id"]
        # a second daemon on the same state dir refuses to start
        r = subprocess.run(DAEMON + ["--state-dir", str(state)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and "Another kafilad already answers" in r.stderr
        assert ctl(state, "stop").returncode == 0
        assert p2.wait(15) == 0
    finally:
        if p2.poll() is None:
            p2.kill()


def test_ctl_errors_are_sentences(daemon, tmp_path):
    _, state = daemon
    r = ctl(state, "generate", "hello")
    assert r.returncode == 1 and "This daemon is not hosting a session." in r.stderr
    r = ctl(state, "host", "--model", str(tmp_path), "--members", "2", "--rendezvous", "ws://127.0.0.1:9")
    assert r.returncode == 1 and "has no config.json" in r.stderr
    r = ctl(state, "join", "not a code", "--rendezvous", "ws://127.0.0.1:9")
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.strip()
    r = ctl(state, "admit", "nobody")
    assert r.returncode == 1 and "not hosting a session" in r.stderr


@pytest.mark.slow
def test_readme_demo_command(tmp_path):
    """The README's first command (after install): `kafila-ctl demo` on the synthesised default."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = subprocess.run(CTL + ["demo", "--max-tokens", "12"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "formed in" in r.stdout and "plan: bottleneck" in r.stdout and "12 tokens" in r.stdout
