"""Issue 9 "Clean stop": `kafila-ctl stop` or SIGTERM of a daemon in a session exits 0, and the
other side is told, in a loop of runs with generations before each stop.

Each run starts a rendezvous and three daemons, forms a session (the host's daemon is m0), serves
two generations, then stops every daemon, alternating the order and the means:

- even runs: `kafila-ctl stop` on the host first; its members are told (their session is over
  within a few seconds), then SIGTERM to both members at once;
- odd runs: SIGTERM to a member first; the host is told (that member shows as lost), then
  `kafila-ctl stop` on the host and SIGTERM to the last member.

Every daemon must exit with status 0 (no `terminate called without an active exception`, exit 134)
after its stop. A stop that never ends fails after STOP_HANG_GUARD_S; how long each stop took is
printed (issue 9's target is 5 s: a measurement, which a loaded machine stretches, not an assertion). `KAFILA_STOP_RUNS` sets the number of runs: 5 by default (about 20 s on
two cores), 20 for the issue's full loop (75 s; `KAFILA_STOP_RUNS=20 pytest tests/e2e/test_stop.py`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kafila_ctl.demo import LoopbackCluster

pytestmark = pytest.mark.slow

RUNS = int(os.environ.get("KAFILA_STOP_RUNS", "5"))
#: seconds after which a daemon that has not exited since its stop is hung
STOP_HANG_GUARD_S = 60.0
#: how long each stop took, (daemon, seconds), printed at the end (`pytest -s` shows it)
STOPS_S: list[tuple[str, float]] = []


def exited_within(proc: subprocess.Popen, t0: float, name: str, log) -> None:
    try:
        rc = proc.wait(timeout=max(0.1, t0 + STOP_HANG_GUARD_S - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"daemon {name} did not exit within {STOP_HANG_GUARD_S:g} s of its stop; see {log}")
    took = time.monotonic() - t0
    STOPS_S.append((name, took))
    assert rc == 0, f"daemon {name} exited {rc} after its stop ({took:.1f} s); see {log}"


def wait_until(fn, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def ctl_stop(c: LoopbackCluster, i: int) -> None:
    r = subprocess.run([sys.executable, "-m", "kafila_ctl.cli", "--state-dir", str(c.state_dir(i)), "stop"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "kafilad is stopping" in r.stdout, r.stderr


def one_run(tmp_path, model, run: int) -> None:
    with LoopbackCluster(3, root=str(tmp_path / f"run{run}")) as c:
        c.form(str(model), concurrency=2, context=256)
        for prompt in ("Kafila serves", "Once upon a time"):
            out = c.generate(prompt, 12)
            assert len(out["token_ids"]) >= 1
        logs = [c.root / f"{n}.log" for n in c.names]
        if run % 2 == 0:
            t0 = time.monotonic()
            ctl_stop(c, 0)
            exited_within(c.daemons[0], t0, "m0 (host, kafila-ctl stop)", logs[0])
            for i in (1, 2):  # the members were told: their session is over (till the host is back: reconnecting)
                wait_until(lambda i=i: c.call(i, "status")["state"] in ("failed", "closed", "idle", "reconnecting"), 10,
                           f"m{i} learns that the host stopped")
            t0 = time.monotonic()
            for i in (1, 2):
                c.daemons[i].send_signal(signal.SIGTERM)
            for i in (1, 2):
                exited_within(c.daemons[i], t0, f"m{i} (member, SIGTERM)", logs[i])
        else:
            t0 = time.monotonic()
            c.daemons[2].send_signal(signal.SIGTERM)
            exited_within(c.daemons[2], t0, "m2 (member, SIGTERM)", logs[2])
            wait_until(lambda: any(m["name"] == "m2" and m["lost"] for m in c.call(0, "status")["members"]), 10,
                       "the host learns that m2 left")
            t0 = time.monotonic()
            ctl_stop(c, 0)
            exited_within(c.daemons[0], t0, "m0 (host, kafila-ctl stop)", logs[0])
            t0 = time.monotonic()
            c.daemons[1].send_signal(signal.SIGTERM)
            exited_within(c.daemons[1], t0, "m1 (member, SIGTERM)", logs[1])
        for log in logs:
            assert "terminate called" not in log.read_text()


def test_stop_and_sigterm_exit_zero_in_a_loop(tmp_path, synth_llama):
    STOPS_S.clear()
    for run in range(RUNS):
        one_run(tmp_path, synth_llama, run)
    slowest = max(STOPS_S, key=lambda x: x[1])
    print(f"{len(STOPS_S)} stops: median {sorted(s for _, s in STOPS_S)[len(STOPS_S) // 2]:.2f} s, "
          f"slowest {slowest[1]:.2f} s ({slowest[0]}); issue 9's target: 5 s")
