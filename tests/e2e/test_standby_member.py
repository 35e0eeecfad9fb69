"""A member on standby as a new user meets it (issue 25 item 6), with real processes on loopback:
`kafila-ctl wait` on it returns (it waited out its whole timeout, "state: standby"), and after
`leave` on it the host's status no longer lists it as standby. The model is a synthesised Llama."""

from __future__ import annotations

import io
import json
import time

import pytest
from rich.console import Console

from kafila_ctl.demo import LoopbackCluster
from kafila_ctl.render import status_renderable
from kafilad.node.stagehost import TEST_CAPABILITY_ENV

pytestmark = pytest.mark.slow


class SlowThirdCluster(LoopbackCluster):
    """m2 reports 1 MB/s of memory bandwidth: the default strategy (load) leaves it on standby."""

    def daemon_env(self, i: int) -> dict:
        env = super().daemon_env(i)
        return {**env, TEST_CAPABILITY_ENV: json.dumps({"bandwidth_Bps": 1e6})} if i == 2 else env


def rendered_status(c: LoopbackCluster, i: int) -> str:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(status_renderable({**c.call(i, "status"), "name": c.names[i]}))
    return console.file.getvalue()


def wait_until(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := pred()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return value


def test_wait_returns_on_a_standby_member(tmp_path, synth_llama):
    """`kafila-ctl wait` on a member on standby waited out its whole timeout ("state: standby")."""
    with SlowThirdCluster(3, root=str(tmp_path / "c")) as c:
        plan = c.form(str(synth_llama), strategy=None)["status"]["plan"]
        assert plan["standby"] == ["m2"], plan
        # a member on standby is where `wait` (for ready) ends: it holds no blocks until a replan
        snap = c.call(2, "wait", states=["ready"], timeout_s=60)
        assert snap["state"] == "standby" and snap["blocks"] is None
