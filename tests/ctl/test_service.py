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
    # a member's own view (no "ready" per row) named every member "joining" in a ready session (a trial)
    member = {"name": "m2", "session": "abc", "role": "member", "state": "ready",
              "members": [{"name": "m2", "head": True, "blocks": [0, 4]}, {"name": "h", "blocks": [4, 5]}]}
    assert status_line(member) == "m2: session abc (member) ready; members m2* [0,4), h [4,5)"
    host_view = {**snap, "members": [{"name": "m1", "blocks": None, "ready": False},
                                     {"name": "m3", "blocks": None, "ready": False, "standby": True}]}
    assert "members m1 joining, m3 standby;" in status_line(host_view)


def install_cli(monkeypatch, tmp_path, *argv, env=None):
    """`kafila-ctl service install ARGV` in this process, HOME and XDG_CONFIG_HOME under tmp_path."""
    from kafila_ctl.cli import main
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    for name in ("KAFILA_STATE_DIR", "KAFILA_RENDEZVOUS", "KAFILA_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    try:
        return main(["service", "install", "--manager", "systemd", *argv])
    except SystemExit as e:  # argparse's usage errors
        return e.code


@pytest.mark.parametrize("argv, words", [
    (["--http", "99999"], "argument --http: 99999 is not a port: a port is a number from 0 to 65535"),
    (["--http", "127.0.0.1:70000"], "argument --http: '127.0.0.1:70000' is not HOST:PORT with a port between 0 and 65535"),
    (["--rendezvous", "notaurl"], "argument --rendezvous: The rendezvous URL 'notaurl' is not a WebSocket URL: it has "
                                  "no scheme; it must look like ws://HOST:PORT or wss://HOST:PORT"),
    (["--rendezvous", "http://rdv.example:7400"], "'http://' is not ws:// or wss://"),
])
def test_install_refuses_what_the_daemon_would_refuse(monkeypatch, tmp_path, capsys, argv, words):
    """A new user's trial: --http 99999 and --rendezvous notaurl were written into a unit whose daemon
    exits 2 at once (Restart=on-failure: a loop for ever). They are checked by the daemon's own
    parsers (kafilad/main.py http_address, rendezvous_url); nothing is written."""
    assert install_cli(monkeypatch, tmp_path, *argv) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "cfg").exists()


def test_install_carries_kafila_rendezvous_like_the_state_dir(monkeypatch, tmp_path, capsys):
    """KAFILA_STATE_DIR was baked into ExecStart, KAFILA_RENDEZVOUS silently dropped: both are carried
    (a service manager's environment has neither), and a bad KAFILA_RENDEZVOUS is refused by name."""
    unit = tmp_path / "cfg" / "systemd" / "user" / "kafilad.service"
    env = {"KAFILA_STATE_DIR": str(tmp_path / "st"), "KAFILA_RENDEZVOUS": "ws://rdv.example:7400"}
    assert install_cli(monkeypatch, tmp_path, env=env) == 0
    assert exec_start(unit.read_text()) == [sys.executable, "-m", "kafilad.main", "--state-dir", str(tmp_path / "st"),
                                            "--rendezvous", "ws://rdv.example:7400"]
    capsys.readouterr()
    assert install_cli(monkeypatch, tmp_path, "--force", "--rendezvous", "ws://other:1", env=env) == 0
    assert exec_start(unit.read_text())[-2:] == ["--rendezvous", "ws://other:1"]  # the option wins
    capsys.readouterr()
    assert install_cli(monkeypatch, tmp_path, "--force", env={"KAFILA_RENDEZVOUS": "notaurl"}) == 2
    assert capsys.readouterr().err == (
        "kafila-ctl: KAFILA_RENDEZVOUS (carried into the service as --rendezvous): The rendezvous URL 'notaurl' is "
        "not a WebSocket URL: it has no scheme; it must look like ws://HOST:PORT or wss://HOST:PORT, e.g. "
        "ws://rdv.example.org:7400. Pass --rendezvous URL, or unset it.\n")


def test_install_at_a_custom_path_says_how_to_link_it(monkeypatch, tmp_path, capsys):
    """With --path elsewhere the old instructions (`systemctl --user enable --now kafilad`) found no unit:
    the unit is linked in first; a name systemd would not load (not NAME.service) is refused."""
    path = tmp_path / "u" / "kafilad.service"
    assert install_cli(monkeypatch, tmp_path, "--path", str(path)) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[3:7] == [f"  systemctl --user link {path}", "  systemctl --user daemon-reload",
                                     "  systemctl --user enable --now kafilad", "  journalctl --user -u kafilad -f"]
    assert f"keep the file there, or copy it into {tmp_path / 'cfg' / 'systemd' / 'user'}/ instead" in out
    assert f"#   systemctl --user link {path}\n" in path.read_text()
    mine = tmp_path / "cfg" / "systemd" / "user" / "kafila-lab.service"  # in systemd's directory: no link
    assert install_cli(monkeypatch, tmp_path, "--path", str(mine)) == 0
    assert capsys.readouterr().out.splitlines()[3:6] == [
        "  systemctl --user daemon-reload", "  systemctl --user enable --now kafila-lab",
        "  journalctl --user -u kafila-lab -f"]
    assert install_cli(monkeypatch, tmp_path, "--path", str(tmp_path / "u" / "kafilad.txt")) == 2
    assert capsys.readouterr().err == (
        "kafila-ctl: systemd loads a service only from a file named NAME.service, not 'kafilad.txt'; pass --path "
        f"{tmp_path / 'u' / 'kafilad.service'} or another NAME.service.\n")
    assert not (tmp_path / "u" / "kafilad.txt").exists()


def test_install_carries_api_keys_for_an_api_other_machines_reach(monkeypatch, tmp_path, capsys):
    """Issue 22 §3: a daemon on a non-loopback --http without a key refuses to start, so a unit for it
    would restart for ever: install refuses it too, unless KAFILA_API_KEYS is set here (carried into
    the unit's environment, the file 0600) or --http-insecure is given (passed on)."""
    unit = tmp_path / "cfg" / "systemd" / "user" / "kafilad.service"
    assert install_cli(monkeypatch, tmp_path, "--http", "0.0.0.0:8400") == 2
    err = capsys.readouterr().err
    assert "The HTTP API would listen on 0.0.0.0" in err and "export KAFILA_API_KEYS in this shell" in err
    assert not unit.exists()
    key = "svc-key-0123456789abcdef"
    assert install_cli(monkeypatch, tmp_path, "--http", "0.0.0.0:8400", env={"KAFILA_API_KEYS": key}) == 0
    text = unit.read_text()
    assert f"Environment=KAFILA_API_KEYS={key}\n" in text and key not in exec_start(text)
    assert unit.stat().st_mode & 0o777 == 0o600
    capsys.readouterr()
    assert install_cli(monkeypatch, tmp_path, "--force", "--http", "0.0.0.0:8400", "--http-insecure") == 0
    assert exec_start(unit.read_text())[-3:] == ["--http", "0.0.0.0:8400", "--http-insecure"]
    assert "KAFILA_API_KEYS" not in unit.read_text()
    capsys.readouterr()
    assert install_cli(monkeypatch, tmp_path, "--force", env={"KAFILA_API_KEYS": "short"}) == 2
    assert "at least 16 characters" in capsys.readouterr().err
