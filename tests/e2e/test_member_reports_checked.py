"""Members checked against what they do (issue 22 item 5), with real processes on loopback: a member
that reports a bandwidth far beyond its real one is not made the head on its word; once its stage has
run, the host finds its measured stage time off the prediction by more than the bound, says so,
plans again with its figures derived from measurement, and `status` shows reported against measured."""

from __future__ import annotations

import io
import json
import time

import pytest
import trio
from rich.console import Console

from kafila_ctl.demo import LoopbackCluster
from kafila_ctl.render import status_renderable
from kafilad.node.serving.stagehost import TEST_CAPABILITY_ENV
from kafilad.planner.trust import RATIO_HIGH

pytestmark = pytest.mark.slow

#: m1 says it reads 10 TB/s with no step overhead: thousands of times what a CPU core reads
LIE = {"bandwidth_Bps": 1e13, "step_overhead_s": 0.0}


class LiarCluster(LoopbackCluster):
    def daemon_env(self, i: int) -> dict:
        env = super().daemon_env(i)
        return {**env, TEST_CAPABILITY_ENV: json.dumps(LIE)} if i == 1 else env


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """A model wide enough that a stage's step takes milliseconds (beyond trust.SLACK_S)."""
    from kafilad.executor.synth import synthesize_model
    return synthesize_model(tmp_path_factory.mktemp("synth") / "wide-llama", arch="llama", seed=3,
                            num_hidden_layers=6, hidden_size=512)


def generate(c, n: int) -> dict:
    async def main():
        result = None
        async for kind, body in c.client(0).stream("generate", prompt="Once upon a time", max_tokens=n):
            if kind != "event":
                result = body
        return result
    return trio.run(main)


def member(st: dict, name: str) -> dict:
    return next(m for m in st["members"] if m["name"] == name)


def test_a_member_that_overstates_its_speed_is_not_head_and_is_replanned_around(wide_llama, tmp_path):
    with LiarCluster(3, root=str(tmp_path / "c")) as c:
        code = c.call(0, "host", model_dir=str(wide_llama), members=3, context=512, open=True)["code"]
        for i in (1, 2):
            c.call(i, "join", code=code)
        st = c.call(0, "wait", states=["ready"], timeout_s=180)
        m1 = member(st, "m1")
        # only the host may head before any member's report is confirmed by measurement
        assert st["plan"]["head"] == "m0"
        assert not m1["head"] and not m1["head_allowed"] and m1["blocks"] is not None
        assert m1["reported"]["bandwidth_Bps"] == LIE["bandwidth_Bps"] and m1["check"] is None
        generate(c, 40)  # ≥ MIN_STEPS decode steps through every stage
        deadline = time.monotonic() + 120
        while True:  # judged off, then a new plan: kept (the same division) or loaded (another one)
            events = c.call(0, "trace")
            checked = [r for r in events if r["event"] == "report_checked" and r["member"] == "m1"]
            kinds = [r["event"] for r in events]
            reassessed = "reassessed" in kinds and any(k in ("plan_kept", "replanned")
                                                      for k in kinds[kinds.index("reassessed"):])
            st = c.call(0, "status")
            if reassessed and st["state"] == "ready":
                break
            assert time.monotonic() < deadline, f"no new plan after m1's check: {checked} {kinds} {st['state']}"
            time.sleep(0.3)
        assert checked[0]["outcome"] == "off" and checked[0]["ratio"] > RATIO_HIGH
        assert any(r["event"] == "reassessed" and r["name"] == "m1" for r in events)
        log = (c.root / "m0.log").read_text()
        assert "member m1's stage measured" in log and "planning again with its figures scaled by" in log
        m1 = member(st, "m1")
        assert m1["check"]["outcome"] == "off" and m1["check"]["scale"] == pytest.approx(checked[0]["scale"])
        assert m1["planned_with"]["bandwidth_Bps"] == pytest.approx(LIE["bandwidth_Bps"] / checked[0]["scale"])
        assert st["plan"]["head"] != "m1" and not m1["head_allowed"]
        if "plan_kept" in kinds:  # the same blocks: the derived figures predict exactly what was measured
            assert m1["predicted_stage_s"] == pytest.approx(checked[0]["measured_s"], rel=1e-6)
        # the session serves on under the new plan
        assert generate(c, 8)["decode_tokens"] >= 1
        console = Console(file=io.StringIO(), width=240, color_system=None)
        console.print(status_renderable({**c.call(0, "status"), "name": "m0"}))
        out = console.file.getvalue()
        assert "reported GB/s" in out and "meas./pred." in out and f"x{checked[0]['ratio']:.2f} off" in out
