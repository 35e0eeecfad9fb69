"""The daemon and kafila-ctl as a user meets them: real processes, real Unix sockets."""

from __future__ import annotations

import os
import re
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


def test_a_second_daemon_starts_without_the_default_http_port(tmp_path):
    """A new user's report: a second daemon on one machine died because the first held 127.0.0.1:8400.
    The default port taken is a warning naming it and --http; the daemon runs, kafila-ctl reaches it."""
    import errno
    import json
    import socket
    held = socket.socket()
    try:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 8400))
        held.listen()
    except OSError as e:  # something else holds it already: taken all the same
        if e.errno != errno.EADDRINUSE:
            pytest.skip(f"cannot bind 127.0.0.1:8400 here: {e}")
    state = tmp_path / "state"
    log = open(tmp_path / "daemon.log", "wb")
    p = subprocess.Popen(DAEMON + ["--state-dir", str(state), "--name", "second"], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while not (state / "kafilad.sock").exists():
            assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            time.sleep(0.05)
        r = ctl(state, "status", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["http"] is None and p.poll() is None
        text = (tmp_path / "daemon.log").read_text()
        assert ("The HTTP API's default address 127.0.0.1:8400 is taken (Address already in use), likely by another "
                "kafilad on this machine; this daemon runs without the HTTP API (kafila-ctl works as usual). Start "
                "it with --http PORT (e.g. --http 8401) to serve the API there, or --http off to run without it "
                "and without this warning.") in text
        assert "Traceback" not in text and "taken" in (state / "kafilad.log").read_text()
        assert ctl(state, "stop").returncode == 0 and p.wait(15) == 0
    finally:
        held.close()
        if p.poll() is None:
            p.kill()
            p.wait()


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


def test_a_shipped_model_by_its_bare_name(daemon, tmp_path):
    """New user's report: `--model stories260K` looked for ./stories260K; a bare name of a shipped model
    is that model (host and demo), and a name that matches nothing says every place looked at."""
    _, state = daemon
    run = dict(capture_output=True, text=True, cwd=tmp_path)
    r = subprocess.run(CTL + ["--state-dir", str(state), "host", "--model", "stories260K", "--members", "2",
                              "--rendezvous", "ws://127.0.0.1:9"], timeout=60, **run)
    assert r.returncode == 1 and "Cannot reach the rendezvous at ws://127.0.0.1:9" in r.stderr  # the model was read
    r = subprocess.run(CTL + ["--state-dir", str(state), "host", "--model", "stories26", "--members", "2",
                              "--rendezvous", "ws://127.0.0.1:9"], timeout=60, **run)
    assert r.returncode == 1 and r.stderr.strip() == (
        f"kafila-ctl: There is no model 'stories26': it is not a directory here ({tmp_path / 'stories26'}), not "
        "one of the models shipped with kafila (stories260K), and not a Hugging Face repo id (ORG/NAME). Pass a "
        "model directory, a shipped model's name, or a repo id.")
    r = subprocess.run(CTL + ["demo", "--model", "stories260K", "--members", "1", "--max-tokens", "4"], timeout=120,
                       env={**os.environ, "COLUMNS": "200"}, **run)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Once upon a time, there was a" in r.stdout and "4 tokens" in r.stdout


def test_versions():
    from importlib.metadata import version
    v = version("kafila")
    for argv, name in ((CTL, "kafila-ctl"), (DAEMON, "kafilad")):
        r = subprocess.run(argv + ["--version"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout == f"{name} {v}\n", r.stderr


def test_state_dir_from_the_environment_and_options_after_the_subcommand(tmp_path):
    """KAFILA_STATE_DIR names the state dir of both tools; --state-dir also goes after the subcommand."""
    state = tmp_path / "from-env"
    env = {**os.environ, "KAFILA_STATE_DIR": str(state)}
    log = open(tmp_path / "daemon.log", "wb")
    p = subprocess.Popen(DAEMON + ["--name", "envy", "--http", "off"], stdout=log, stderr=log, env=env)
    try:
        deadline = time.monotonic() + 20
        while not (state / "kafilad.sock").exists():
            assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            time.sleep(0.05)
        assert (state / "static_key").exists()
        r = subprocess.run(CTL + ["keys", "--json"], capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0 and '"name": "envy"' in r.stdout, r.stderr
        r = subprocess.run(CTL + ["keys", "--json", "--state-dir", str(state)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and '"name": "envy"' in r.stdout, r.stderr
        r = subprocess.run(CTL + ["keys", "--state-dir", str(tmp_path / "other")], capture_output=True, text=True,
                           timeout=60, env=env)  # the option wins over the environment
        assert r.returncode == 1 and f"kafilad is not running at {tmp_path / 'other' / 'kafilad.sock'}" in r.stderr
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(15)


def test_help_texts_show_defaults_and_wait_checks_state_names(tmp_path):
    def help_of(*args):
        r = subprocess.run(CTL + [*args, "--help"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "200"})
        assert r.returncode == 0, r.stderr
        return " ".join(r.stdout.split())
    assert "tokens to generate at most (default 64)" in help_of("generate")
    assert "tokens per reply at most (default 256)" in help_of("chat")
    wait = help_of("wait")
    assert "(default ready); one of admitted, closed, degraded, failed" in wait and "ready, reconnecting, recovering, restoring" in wait
    assert "seconds to wait before giving up (default 300)" in wait
    assert "$KAFILA_STATE_DIR" in help_of() and "default 120" in help_of("host")
    assert "ORG/NAME[@REVISION]" in help_of("host")
    r = ctl(tmp_path, "wait", "--state", "redy")
    assert r.returncode == 2 and "invalid choice: 'redy'" in r.stderr


def test_watch_into_a_pipe_prints_lines(daemon):
    _, state = daemon
    p = subprocess.Popen(CTL + ["--state-dir", str(state), "status", "--watch"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert re.fullmatch(r"\d\d:\d\d:\d\d alpha: not in a session\n", line), line
        assert "\x1b" not in line  # no terminal control sequences into a pipe
    finally:
        p.terminate()
        p.wait(15)


def test_service_install_runs_this_install(tmp_path):
    """The unit's ExecStart and the plist's ProgramArguments start this very install of kafilad."""
    import plistlib
    import shlex
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    env.pop("KAFILA_STATE_DIR", None)
    r = subprocess.run(CTL + ["service", "install", "--manager", "systemd", "--rendezvous", "ws://rdv.example:7400"],
                       capture_output=True, text=True, timeout=60, env=env)
    unit_path = tmp_path / "cfg" / "systemd" / "user" / "kafilad.service"
    assert r.returncode == 0 and f"wrote {unit_path}" in r.stdout and "systemctl --user enable --now kafilad" in r.stdout
    exec_line = next(x for x in unit_path.read_text().splitlines() if x.startswith("ExecStart="))
    argv = shlex.split(exec_line.removeprefix("ExecStart="))
    assert argv == [sys.executable, "-m", "kafilad.main", "--rendezvous", "ws://rdv.example:7400"]
    from importlib.metadata import version
    run = subprocess.run(argv + ["--version"], capture_output=True, text=True, timeout=60, env=env)
    assert run.stdout == f"kafilad {version('kafila')}\n"
    r = subprocess.run(CTL + ["service", "install", "--manager", "systemd", "--rendezvous", "ws://other:1"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1 and "already exists with other contents; pass --force" in r.stderr

    r = subprocess.run(CTL + ["--state-dir", str(tmp_path / "st"), "service", "install", "--manager", "launchd"],
                       capture_output=True, text=True, timeout=60, env=env)
    plist = tmp_path / "Library" / "LaunchAgents" / "org.kafila.kafilad.plist"
    assert r.returncode == 0, r.stderr
    args = plistlib.loads(plist.read_bytes())["ProgramArguments"]
    assert args == [sys.executable, "-m", "kafilad.main", "--state-dir", str(tmp_path / "st")]
    r = subprocess.run(CTL + ["service", "install", "--manager", "systemd", "--print"], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 0 and f"\nExecStart={sys.executable} -m kafilad.main\n" in r.stdout, r.stderr


STORIES_12 = "Once upon a time, there was a little girl named Lily. She"


@pytest.mark.slow
def test_readme_demo_command():
    """The README's first command (after install): `kafila-ctl demo` serves the packaged stories260K."""
    r = subprocess.run(CTL + ["demo", "--max-tokens", "12"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "formed in" in r.stdout and "plan: bottleneck" in r.stdout and "12 tokens" in r.stdout
    assert "model: stories260K, Andrej Karpathy's 260K-parameter TinyStories Llama (MIT licence)" in r.stdout
    assert STORIES_12 in r.stdout  # readable English, greedy, through a 3-member ring


@pytest.mark.slow
def test_demo_synth_says_its_text_is_noise(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "COLUMNS": "200"}
    r = subprocess.run(CTL + ["demo", "--synth", "--max-tokens", "12"], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "random weights and a byte-level tokenizer, so its text is noise" in r.stdout
    assert "12 tokens" in r.stdout and STORIES_12 not in r.stdout
    r = subprocess.run(CTL + ["demo", "--synth", "--model", str(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


def test_state_dir_and_rendezvous_startup_errors_say_what_to_change(tmp_path):
    """A new user's trial: a long --state-dir read "AF_UNIX path too long (check the address and port)",
    a file read "File exists (/etc/passwd)", and --rendezvous notaurl started and failed only at `host`.
    Each is refused before the daemon runs, with a sentence naming the cause and what to change."""
    def daemon(*args, env=None):
        r = subprocess.run(DAEMON + [*args, "--http", "off"], capture_output=True, text=True, timeout=30,
                           env={**os.environ, **(env or {})})
        assert "Traceback" not in r.stderr
        return r

    long_dir = tmp_path / ("x" * 120)
    sock = long_dir / "kafilad.sock"
    r = daemon("--state-dir", str(long_dir))
    assert r.returncode == 1 and r.stderr == (
        f"kafilad: The control socket in the state directory {long_dir}, {sock}, is a path of "
        f"{len(os.fsencode(str(sock)))} bytes, longer than the 107 bytes this OS allows for a Unix socket path; "
        "start kafilad with a shorter --state-dir (e.g. ~/.kafila).\n")
    assert not long_dir.exists()
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    fix = "start kafilad with --state-dir naming a directory you can write to (it is created when missing)."
    r = daemon("--state-dir", str(a_file))
    assert r.returncode == 1 and r.stderr == f"kafilad: The state directory {a_file} is a file, not a directory; {fix}\n"
    r = daemon("--state-dir", str(a_file / "below"))
    assert r.returncode == 1 and r.stderr == (
        f"kafilad: The state directory {a_file / 'below'} cannot be created: {a_file} is a file, not a directory; {fix}\n")
    r = daemon(env={"KAFILA_STATE_DIR": "/proc/kafila-nope"})
    assert r.returncode == 1 and r.stderr == (
        "kafilad: The state directory /proc/kafila-nope (from KAFILA_STATE_DIR) cannot be created: /proc does not "
        f"take new directories (No such file or directory); {fix}\n")

    looks = "it must look like ws://HOST:PORT or wss://HOST:PORT, e.g. ws://rdv.example.org:7400."
    state = str(tmp_path / "s")
    for url, why in (("notaurl", "is not a WebSocket URL: it has no scheme"),
                     ("http://rdv.example:7400", "is not a WebSocket URL: 'http://' is not ws:// or wss://"),
                     ("ws://:7400", "names no host"),
                     ("ws://rdv.example:99999", "is not a WebSocket URL (Port out of range 0-65535)")):
        r = daemon("--state-dir", state, "--rendezvous", url)
        assert r.returncode == 2 and f"argument --rendezvous: The rendezvous URL {url!r} {why}; {looks}" in r.stderr
    r = daemon("--state-dir", state, env={"KAFILA_RENDEZVOUS": "notaurl"})
    assert r.returncode == 2 and r.stderr == (
        f"kafilad: KAFILA_RENDEZVOUS: The rendezvous URL 'notaurl' is not a WebSocket URL: it has no scheme; {looks}\n")
    r = daemon("--state-dir", state, "--http", "99999")
    assert r.returncode == 2 and "argument --http: 99999 is not a port: a port is a number from 0 to 65535" in r.stderr
    assert not (tmp_path / "s").exists()  # nothing started


def test_rendezvous_urls_the_daemon_takes():
    from kafilad.main import rendezvous_url
    for url in ("ws://127.0.0.1:7400", "wss://rdv.example.org", "ws://[::1]:7400", " ws://rdv.example:7400/path "):
        assert rendezvous_url(url) == url.strip()


def test_plan_and_demo_refuse_members_and_context_in_the_hosts_own_words(daemon, tmp_path):
    """kafila-ctl's early checks (kafila_ctl/checks.py: `demo` before its daemons, `plan` offline) give
    the sentence the host gives (kafilad/node/serving/admission.py check_session_arguments), word for word; and `plan` takes a
    shipped model's bare name as `host` and `demo` do (a new user's trial: "stories260K is not a
    directory")."""
    _, state = daemon
    run = dict(capture_output=True, text=True, timeout=60, cwd=tmp_path)
    fleet = os.path.join(os.path.dirname(__file__), "..", "..", "fleets", "home-lab.json")
    host = ["--state-dir", str(state), "host", "--model", "stories260K", "--rendezvous", "ws://127.0.0.1:9"]
    r = subprocess.run(CTL + host + ["--members", "6"], **run)
    assert r.returncode == 1 and "must be between 1 and 5 for stories260K (got 6)" in r.stderr
    d = subprocess.run(CTL + ["demo", "--members", "6"], **run)
    assert d.returncode == 2 and d.stderr == r.stderr
    r = subprocess.run(CTL + host + ["--members", "2", "--context", "10000000"], **run)
    assert r.returncode == 1 and "exceeds stories260K's max_position_embeddings (512)" in r.stderr
    p = subprocess.run(CTL + ["plan", "--fleet", fleet, "--model", "stories260K", "--context", "10000000"], **run)
    assert p.returncode == 1 and p.stderr == r.stderr
    p = subprocess.run(CTL + ["plan", "--fleet", fleet, "--model", "stories260K", "--json"], **run)
    assert p.returncode == 0, p.stderr
    import json
    assert json.loads(p.stdout)["context"] == 512  # the fleet file's 4096, capped as the host caps its default
    assert p.stderr == ("kafila-ctl: the fleet file's context 4096 is past stories260K's max_position_embeddings; "
                        "planning with 512, as the host caps its default (--context chooses another).\n")


def test_watch_says_the_daemon_stopped_and_where_to_look(daemon):
    """A new user's trial: `status --watch` over a daemon that died read "kafilad closed the control
    connection during 'watch' without a reply."; it says the daemon stopped and where its log is."""
    p, state = daemon
    watch = subprocess.Popen(CTL + ["--state-dir", str(state), "status", "--watch"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert "alpha: not in a session" in watch.stdout.readline()
        p.kill()  # the daemon dies (no shutdown reply)
        p.wait()
        assert watch.wait(30) == 1
        err = watch.stderr.read()
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert err == (f"kafila-ctl: kafilad stopped during 'watch': it closed the control connection without a reply, "
                   f"and nothing answers on {state / 'kafilad.sock'} now. Its log says why: {state / 'kafilad.log'} "
                   f"(as a service: `systemctl --user status kafilad` or `journalctl --user -u kafilad`); start it "
                   f"again as it was started (`systemctl --user start kafilad`, or its own command line with "
                   f"`--state-dir {state}` and the same --rendezvous and --http).\n")


def test_watch_ends_quietly_when_the_daemon_is_stopped(daemon):
    """Issue 25: `status --watch` ended on `kafila-ctl stop` with "'watch' was not finished; send it
    again once the daemon is back". An orderly stop's reply carries code `shutting_down` (proto_spec
    05 §4): the watch says the daemon stopped and exits 0."""
    p, state = daemon
    watch = subprocess.Popen(CTL + ["--state-dir", str(state), "status", "--watch"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert "alpha: not in a session" in watch.stdout.readline()
        assert ctl(state, "stop").returncode == 0
        assert watch.wait(30) == 0
        out, err = watch.stdout.read(), watch.stderr.read()
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert err == "" and re.fullmatch(r"\d\d:\d\d:\d\d kafilad stopped\n", out), (out, err)
    p.wait(30)
