"""The host's default strategy, `load` (issue 12 item 2), with real processes on loopback: a member
too slow to help stands by; losing it fails nothing and replans nothing; when it returns the plan
that keeps it on standby is kept without reloading; when a member of the ring is lost, a standby
takes blocks; generation stays token-identical to single-process mlx-lm throughout. On the shared stories260K and its twin, a synthesised Llama."""

from __future__ import annotations

import json
import signal
import time

import pytest

from kafila_ctl.demo import LoopbackCluster
from kafila_testing import STORIES_PROMPT, reference_tokens
from kafilad.node.serving.stagehost import TEST_CAPABILITY_ENV
from kafilad.planner import DEFAULT_STRATEGY

pytestmark = pytest.mark.slow

#: m2 reports a memory bandwidth of 1 MB/s: any block it held would cost seconds per token
SLOW = {"bandwidth_Bps": 1e6}


class SlowThirdCluster(LoopbackCluster):
    def daemon_env(self, i: int) -> dict:
        env = super().daemon_env(i)
        return {**env, TEST_CAPABILITY_ENV: json.dumps(SLOW)} if i == 2 else env


#: a slow host (the anchor holds at least one block), a fast m1 and a mid m2: one user is served
#: fastest by m0 + m1, m2 stands by; without m1, m0 + m2 beats the slow host alone. These tests are about
#: standby members in a fleet emulated by reports, so the host trusts them (`host --head any`, issue 22 item 5)
SPEEDS_BPS = {0: 2e8, 1: 5e10, 2: 1e10}


class SpeedsCluster(LoopbackCluster):
    def daemon_env(self, i: int) -> dict:
        return {**super().daemon_env(i), TEST_CAPABILITY_ENV: json.dumps({"bandwidth_Bps": SPEEDS_BPS[i],
                                                                          "step_overhead_s": 0.0})}


def wait_for(cluster, pred, timeout_s: float, what: str) -> dict:
    t0 = time.monotonic()
    while True:
        st = cluster.call(0, "status")
        if pred(st):
            return st
        assert time.monotonic() - t0 < timeout_s, f"{what}: state {st['state']} ({st.get('error')}) after {timeout_s} s"
        time.sleep(0.2)


def events(cluster) -> list[dict]:
    return cluster.call(0, "trace")


@pytest.mark.parametrize("model", ["stories260k", "synth_llama"])
def test_a_slow_member_stands_by_and_its_loss_and_return_change_nothing(model, request, tmp_path):
    model_dir = request.getfixturevalue(model)
    ref = reference_tokens(model_dir, STORIES_PROMPT, 24)
    with SlowThirdCluster(3, root=str(tmp_path / "c")) as c:
        st = c.form(str(model_dir), strategy=None, head="any")["status"]  # the host's default
        plan = st["plan"]
        assert DEFAULT_STRATEGY == "load" and plan["strategy"] == "load"
        assert "m2" in plan["standby"] and "m2" not in plan["blocks"] and plan["order"][0] == plan["head"]
        assert set(plan["order"]) | set(plan["standby"]) == {"m0", "m1", "m2"}
        assert [(m["blocks"], m["standby"]) for m in st["members"] if m["name"] == "m2"] == [(None, True)]
        wait_for(c, lambda s: c.call(2, "status")["state"] == "standby", 10, "m2 told it stands by")
        assert c.generate(STORIES_PROMPT, 24)["token_ids"] == ref

        c.daemons[2].send_signal(signal.SIGKILL)
        c.daemons[2].wait()
        wait_for(c, lambda s: any(m["name"] == "m2" and m.get("lost") for m in s["members"]), 30, "m2 lost")
        lost = [e for e in events(c) if e["event"] == "member_lost"]
        assert len(lost) == 1 and lost[0]["name"] == "m2" and lost[0]["standby"] is True
        assert c.call(0, "status")["state"] == "ready"
        assert c.generate(STORIES_PROMPT, 24)["token_ids"] == ref
        assert not [e for e in events(c) if e["event"] in ("replanned", "ring_broken")]

        c.daemons[2] = c.start_daemon(2)  # same state dir: it rejoins by itself
        c.wait_daemon(2)
        wait_for(c, lambda s: s["state"] == "ready" and any(e["event"] == "plan_kept" for e in events(c)), 60,
                 "m2 back on standby")
        kinds = [e["event"] for e in events(c)]
        assert "member_returned" in kinds and "replanned" not in kinds
        kept = next(e for e in events(c) if e["event"] == "plan_kept")
        assert kept["epoch"] == 1 and "m2" in kept["standby"]
        wait_for(c, lambda s: c.call(2, "status")["state"] == "standby", 10, "m2 told it stands by again")
        assert c.generate(STORIES_PROMPT, 24)["token_ids"] == ref


def test_a_standby_takes_blocks_when_a_member_of_the_ring_is_lost(synth_llama, tmp_path):
    ref = reference_tokens(synth_llama, STORIES_PROMPT, 24)
    with SpeedsCluster(3, root=str(tmp_path / "c")) as c:
        plan = c.form(str(synth_llama), strategy=None, head="any")["status"]["plan"]
        assert plan["strategy"] == "load" and plan["standby"] == ["m2"] and set(plan["blocks"]) == {"m0", "m1"}
        assert c.generate(STORIES_PROMPT, 24)["token_ids"] == ref
        c.daemons[1].send_signal(signal.SIGKILL)
        c.daemons[1].wait()
        st = wait_for(c, lambda s: s["state"] == "ready" and s["plan"] and "m2" in s["plan"]["blocks"], 60,
                      "m2 planned in")
        assert st["plan"]["standby"] == [] and set(st["plan"]["blocks"]) == {"m0", "m2"}
        assert c.call(2, "status")["state"] == "ready"
        assert c.generate(STORIES_PROMPT, 24)["token_ids"] == ref
        replanned = [e for e in events(c) if e["event"] == "replanned"]
        assert len(replanned) == 1 and replanned[0]["old_plan"]["standby"] == ["m2"]
