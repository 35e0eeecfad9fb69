"""`kafila-ctl service install` files (kafila_ctl/service.py): pure renderers and the writer."""

from __future__ import annotations

import plistlib
import shlex
import sys

import pytest

from kafila_ctl import service
from kafila_ctl.cli import status_line
from kafilad.errors import KafilaError

ODD_ARGV = ["/opt/my venv/bin/python", "-m", "kafilad.main", "--state-dir", "/srv/100%/$HOME/a\"b",
            "--rendezvous", "ws://rdv.example.org:7400"]


def exec_start(unit: str) -> list[str]:
    """The ExecStart words as systemd reads them (quotes and backslashes as in a shell's double
    quotes; %% and $$ are literal % and $)."""
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    return [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(line.removeprefix("ExecStart="))]


def test_daemon_argv_is_this_interpreter():
    assert service.daemon_argv() == [sys.executable, "-m", "kafilad.main"]
    assert service.daemon_argv(state_dir="/s", name="n", rendezvous="ws://r:1", http="off") == [
        sys.executable, "-m", "kafilad.main", "--state-dir", "/s", "--name", "n", "--rendezvous", "ws://r:1",
        "--http", "off"]


def test_systemd_unit_quotes_every_word():
    unit = service.systemd_unit(ODD_ARGV)
    assert exec_start(unit) == ODD_ARGV
    assert 'ExecStart="/opt/my venv/bin/python" -m kafilad.main' in unit
    assert '"/srv/100%%/$$HOME/a\\"b"' in unit
    for line in ("Restart=on-failure", "KillSignal=SIGTERM", "WantedBy=default.target", "[Service]"):
        assert line in unit.splitlines()
    assert "/usr/bin/env" not in unit


def test_launchd_plist_runs_the_argv():
    doc = plistlib.loads(service.render("launchd", ODD_ARGV, home=service.Path("/Users/me")).encode())
    assert doc["Label"] == "org.kafila.kafilad" and doc["ProgramArguments"] == ODD_ARGV
    assert doc["RunAtLoad"] is True and doc["KeepAlive"] == {"SuccessfulExit": False}
    assert doc["StandardErrorPath"] == "/Users/me/Library/Logs/kafilad.log"


def test_default_paths(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    assert service.default_path("systemd", tmp_path) == tmp_path / ".config/systemd/user/kafilad.service"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    assert service.default_path("systemd", tmp_path) == tmp_path / "cfg/systemd/user/kafilad.service"
    assert service.default_path("launchd", tmp_path) == tmp_path / "Library/LaunchAgents/org.kafila.kafilad.plist"
    assert service.default_kind("darwin") == "launchd" and service.default_kind("linux") == "systemd"


def test_install_writes_and_refuses_to_clobber(tmp_path):
    path = tmp_path / "units" / "kafilad.service"
    argv = service.daemon_argv(rendezvous="ws://a:1")
    assert service.install("systemd", argv, path=path) == path
    assert exec_start(path.read_text()) == argv
    assert service.install("systemd", argv, path=path) == path  # the same file again: fine
    other = service.daemon_argv(rendezvous="ws://b:2")
    with pytest.raises(KafilaError, match="already exists with other contents; pass --force"):
        service.install("systemd", other, path=path)
    service.install("systemd", other, path=path, force=True)
    assert exec_start(path.read_text()) == other
    with pytest.raises(KafilaError, match="Unknown service manager 'upstart'"):
        service.render("upstart", argv)


def test_status_line_for_watch_into_a_pipe():
    assert status_line({"name": "alpha"}) == "alpha: not in a session"
    snap = {"name": "m0", "session": "abc", "role": "host", "state": "ready",
            "members": [{"name": "m0", "head": True, "blocks": [0, 2], "ready": True},
                        {"name": "m1", "blocks": [2, 5], "progress": "fetching"},
                        {"name": "m2", "lost": True}],
            "plan": {"bottleneck_s": 0.00123}, "last_generation": {"decode_tokens_per_s": 98.76},
            "pending": [{"name": "laptop", "peer_id": "x"}]}
    assert status_line(snap) == ("m0: session abc (host) ready; members m0* [0,2) ready, m1 [2,5) fetching, "
                                 "m2 lost; bottleneck 1.23 ms; last 98.8 tokens/s; pending laptop")
    loading = {"name": "m1", "session": "abc", "role": "member", "state": "loading", "error": None,
               "load": {"progress": "fetching", "done_bytes": 1.5e6, "total_bytes": 3e6}}
    assert status_line(loading) == "m1: session abc (member) loading; fetching 1.5/3.0 MB"
