"""Issue 9 "Trust roster": real daemons on loopback (no model is loaded: the sessions stay forming).

A key admitted by an `--open` session holds for that session only (`trust list` says so) and is
held for approval by the next session; a key admitted with `kafila-ctl admit` is remembered and
admitted silently later; `kafila-ctl trust revoke` forgets it; a denied key is never trusted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from kafila_ctl.demo import LoopbackCluster
from kafilad.errors import KafilaError

pytestmark = pytest.mark.slow


class Join:
    """`join` on daemon i in a thread; keeps its result or error."""

    def __init__(self, c: LoopbackCluster, i: int, code: str):
        self.result = self.error = None
        self.thread = threading.Thread(target=self._run, args=(c, i, code), daemon=True)
        self.thread.start()

    def _run(self, c, i, code):
        try:
            self.result = c.call(i, "join", code=code)
        except KafilaError as e:
            self.error = e

    def wait(self, timeout_s: float = 60) -> "Join":
        self.thread.join(timeout_s)
        assert not self.thread.is_alive()
        return self


def pending_names(c: LoopbackCluster, timeout_s: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pending = c.call(0, "pending")
        if pending:
            return [p["name"] for p in pending]
        time.sleep(0.1)
    return []


def host(c: LoopbackCluster, model, *, open_: bool) -> str:
    return c.call(0, "host", model_dir=str(model), members=3, open=open_, admit_timeout_s=60)["code"]


def ctl(c: LoopbackCluster, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kafila_ctl.cli", "--state-dir", str(c.state_dir(0)), *argv],
                          capture_output=True, text=True, timeout=60)


def roster(c: LoopbackCluster) -> dict:
    path = c.state_dir(0) / "trusted_keys.json"
    return json.loads(path.read_text()) if path.exists() else {}


def test_open_admissions_hold_for_their_session_and_the_roster_is_listed_and_revoked(tmp_path, synth_llama):
    with LoopbackCluster(3, root=str(tmp_path / "c")) as c:
        m1 = c.call(1, "keys")["peer_id"]
        # an --open session admits m1 for itself only
        Join(c, 1, host(c, synth_llama, open_=True)).wait()
        listed = c.call(0, "trust_list")
        assert [(k["peer_id"], k["name"], k["scope"]) for k in listed] == [(m1, "m1", "this session")]
        assert m1 not in roster(c)
        c.call(1, "leave")
        c.call(0, "leave")
        assert c.call(0, "trust_list") == []
        # the next session holds it for approval; admitted by the host, it is remembered
        j = Join(c, 1, host(c, synth_llama, open_=False))
        assert pending_names(c) == ["m1"]
        c.call(0, "admit", peer="m1")
        assert j.wait().error is None
        assert roster(c)[m1]["name"] == "m1"
        r = ctl(c, "trust", "list")
        assert r.returncode == 0 and f"{m1}  m1  fingerprint" in r.stdout and "(roster)" in r.stdout
        c.call(1, "leave")
        c.call(0, "leave")
        # remembered: a later session admits it without asking
        j = Join(c, 1, host(c, synth_llama, open_=False)).wait()
        assert j.error is None and c.call(0, "pending") == []
        c.call(1, "leave")
        c.call(0, "leave")
        # revoked: held for approval again, and a denied key is never trusted
        r = ctl(c, "trust", "revoke", "m1")
        assert r.returncode == 0 and r.stdout.startswith(f"revoked m1 ({m1})")
        assert m1 not in roster(c)
        r = ctl(c, "trust", "revoke", "m1")
        assert r.returncode == 1 and "No trusted key named 'm1'" in r.stderr
        j = Join(c, 1, host(c, synth_llama, open_=False))
        assert pending_names(c) == ["m1"]
        c.call(0, "deny", peer="m1")
        assert "The host refused this device with `kafila-ctl deny`" in str(j.wait().error)
        assert m1 not in roster(c) and c.call(0, "trust_list") == []
        c.call(0, "leave")
        # a key denied earlier and then admitted by an --open session is not trusted by later sessions
        Join(c, 1, host(c, synth_llama, open_=True)).wait()
        c.call(1, "leave")
        c.call(0, "leave")
        j = Join(c, 1, host(c, synth_llama, open_=False))
        assert pending_names(c) == ["m1"]
        c.call(0, "deny", peer="m1")
        j.wait()
        for p in c.daemons:
            assert p.poll() is None
