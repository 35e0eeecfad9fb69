"""`kafila-ctl join` follows the member to ready (issue 10): rendering as a pure function of `watch`
snapshots (kafila_ctl/render.py), and the follower against a real daemon."""

from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest
import trio
from rich.console import Console

from kafilad.errors import KafilaError
from kafila_ctl.render import (STANDBY_SENTENCE, RateMeter, join_outcome, join_progress_key, join_progress_line,
                               join_progress_renderable)


def _snap(state, load=None, **kw):
    """A member's snapshot as Node.snapshot / MemberSession.snapshot give it (kafilad/node/session/member.py)."""
    return {"name": "bravo", "peer_id": "abcd1234", "session": "k3v9q2xa", "role": "member", "state": state,
            "error": None, "host": "alpha", "members": [], "blocks": None, "head": False, "load": load or {}, **kw}


def _text(renderable) -> str:
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def fetching(done, total=10_000_000):
    return _snap("loading", {"progress": "fetching", "done_bytes": done, "total_bytes": total})


def test_rate_meter_over_a_window_and_restart():
    m = RateMeter(window_s=2.0)
    assert m.update(0.0, 0) is None  # one sample: no rate yet
    assert m.update(1.0, 1_000_000) == pytest.approx(1e6)
    assert m.update(2.0, 3_000_000) == pytest.approx(1.5e6)
    assert m.update(3.0, 4_000_000) == pytest.approx(1.5e6)  # window [1, 3] s
    assert m.update(5.0, 4_000_000) == pytest.approx(0.0)  # window [3, 5] s: stalled
    assert m.update(7.0, 500) is None  # the count went back: a new fetch, the window restarts
    assert m.update(8.0, 2_000_500) == pytest.approx(2e6)
    assert m.update(9.0, None) is None


def test_the_fetch_bar_shows_bytes_percent_and_rate():
    out = _text(join_progress_renderable(fetching(2_500_000), 1_500_000.0))
    assert "fetching the weights" in out
    assert "2.5/10.0 MB 25%" in out and "1.5 MB/s" in out
    bar = out.split("fetching the weights")[1].split("2.5/10.0")[0]
    assert bar.strip() == "━━━━━━━╸"  # a quarter of a 30-cell bar: 7.5 cells (rich draws halves)
    assert len(bar) >= 30
    out = _text(join_progress_renderable(fetching(10_000_000), None))
    assert "10.0/10.0 MB 100%" in out and "MB/s" not in out


def test_the_phases_before_and_after_the_fetch():
    assert "waiting for the host to admit this key" in _text(join_progress_renderable(_snap("pending")))
    assert "waiting for the host's plan" in _text(join_progress_renderable(_snap("measured")))
    building = _snap("loading", {"progress": "building the stage", "done_bytes": 4_000_000, "total_bytes": 4_000_000})
    out = _text(join_progress_renderable(building, 9e6))
    assert "building the stage" in out and "4.0/4.0 MB 100%" in out and "MB/s" not in out  # rate only while fetching
    ready = _snap("ready", {"fetched_bytes": 3_000_000, "cached_bytes": 1_000_000, "load_s": 2.25},
                  blocks=[0, 4], head=True)
    assert join_outcome(ready) == "ready"
    assert " ".join(_text(join_progress_renderable(ready)).split()) == (
        "ready in session k3v9q2xa: blocks [0, 4) with the head; fetched 3.0 MB, 1.0 MB from the cache, "
        "loaded in 2.2 s")
    failed = _snap("failed", error="bravo could not load its stage: out of memory")
    assert join_outcome(failed) == "failed"
    assert "failed: bravo could not load its stage: out of memory" in _text(join_progress_renderable(failed))
    assert join_outcome({"name": "bravo", "session": None, "state": "idle"}) == "closed"
    assert join_outcome(_snap("loading")) is None and join_outcome(_snap("admitted")) is None
    # a trial (2026-12-02): a member the plan left on standby waited in `join` for 11 min, printing nothing
    standby = _snap("standby")
    assert join_outcome(standby) == "standby"
    said = " ".join(_text(join_progress_renderable(standby)).split())
    assert said.startswith("standing by in session k3v9q2xa: the plan is faster without this device's blocks")
    assert join_progress_line(standby) == STANDBY_SENTENCE.format(session="k3v9q2xa")


def test_plain_lines_change_with_the_phase_and_each_tenth_of_the_fetch():
    """Into a pipe: one line per new phase, fetch lines at most once per tenth (not one per tensor)."""
    snaps = [_snap("admitted"), _snap("measured"), _snap("measured")]
    snaps += [fetching(d) for d in range(0, 10_000_001, 250_000)]  # 41 tensors of 250 kB
    snaps += [_snap("loading", {"progress": "building the stage", "done_bytes": 10_000_000,
                                "total_bytes": 10_000_000}),
              _snap("loading", {"progress": "joining the ring", "done_bytes": 10_000_000, "total_bytes": 10_000_000}),
              _snap("ready", {"fetched_bytes": 10_000_000, "cached_bytes": 0, "load_s": 3.0}, blocks=[2, 6])]
    lines, last = [], None
    for s in snaps:
        if join_progress_key(s) != last:
            lines.append(join_progress_line(s, 2e6))
            last = join_progress_key(s)
    assert lines[:2] == ["admitted; measuring this machine",
                         "waiting for the host's plan (it comes once every member has joined)"]
    fetch = [ln for ln in lines if ln.startswith("fetching the weights")]
    assert len(fetch) == 11
    assert fetch[0] == "fetching the weights: 0% (0.0 of 10.0 MB, 2.0 MB/s)"
    assert fetch[5] == "fetching the weights: 50% (5.0 of 10.0 MB, 2.0 MB/s)"
    assert fetch[-1] == "fetching the weights: 100% (10.0 of 10.0 MB, 2.0 MB/s)"
    assert lines[-3:] == ["building the stage: 100% (10.0 of 10.0 MB)", "joining the ring: 100% (10.0 of 10.0 MB)",
                          "ready in session k3v9q2xa: blocks [2, 6); fetched 10.0 MB, 0.0 MB from the cache, "
                          "loaded in 3.0 s"]
    assert join_progress_line(_snap("failed", error="the host left")) == "failed: the host left"


def test_join_has_no_wait_and_the_follower_ends_when_the_daemon_has_no_session(tmp_path):
    """Against a real daemon with no session, following ends at once with a sentence, not a hang."""
    from kafila_ctl.cli import _follow_join, build_parser
    from kafila_ctl.client import ControlClient
    args = build_parser().parse_args(["join", "k3v9q2xa-mfrggzdfmztwq2lk", "--no-wait"])
    assert args.no_wait is True
    assert build_parser().parse_args(["join", "k3v9q2xa-mfrggzdfmztwq2lk"]).no_wait is False
    state = tmp_path / "state"
    log = open(tmp_path / "daemon.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "kafilad.main", "--state-dir", str(state), "--name", "bravo",
                          "--http", "off"], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while not (state / "kafilad.sock").exists():
            assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            time.sleep(0.05)
        for tty in (False, True):
            with pytest.raises(KafilaError, match="The session closed before this member was ready"):
                trio.run(lambda: _follow_join(ControlClient(state / "kafilad.sock"), tty=tty))
    finally:
        p.kill()
        p.wait()
