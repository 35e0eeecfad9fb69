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
from kafilad.node.serving.stagehost import TEST_CAPABILITY_ENV

pytestmark = pytest.mark.slow


#: a slow host (the anchor holds at least one block), a fast m1 and a mid m2: one user is served
#: fastest by m0 + m1, and the default strategy (load) leaves m2 on standby (tests/e2e/test_default_strategy.py);
#: the fleet is emulated by these reports, so the host trusts them (`host --head any`, issue 22 item 5)
SPEEDS_BPS = {0: 2e8, 1: 5e10, 2: 1e10}


class SlowThirdCluster(LoopbackCluster):
    def daemon_env(self, i: int) -> dict:
        return {**super().daemon_env(i), TEST_CAPABILITY_ENV: json.dumps({"bandwidth_Bps": SPEEDS_BPS[i],
                                                                          "step_overhead_s": 0.0})}


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
        plan = c.form(str(synth_llama), strategy=None, head="any")["status"]["plan"]
        assert plan["standby"] == ["m2"], plan
        # a member on standby is where `wait` (for ready) ends: it holds no blocks until a replan
        snap = c.call(2, "wait", states=["ready"], timeout_s=60)
        assert snap["state"] == "standby" and snap["blocks"] is None
        # the web page says what the CLI says: m2 stands by, and the ring counts it ready (it showed
        # "joining" and "2 of 3 members ready")
        from e2e.test_web_page import CHROMIUM, sync_playwright_or_skip, wait_until as page_wait
        sync_playwright = sync_playwright_or_skip()
        base = c.call(0, "status")["http"].removesuffix("/v1")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--disable-dev-shm-usage"])
            try:
                page = browser.new_page()
                page.goto(base + "/")
                page_wait(page, "() => document.querySelectorAll('#members tbody tr').length === 3")
                page_wait(page, "() => document.getElementById('summary').textContent.includes('members ready')")
                row = page.locator('#members tbody tr[data-name="m2"]').evaluate(
                    "r => Array.from(r.cells, c => c.textContent)")
                assert row[-1] == "standby (no blocks, ready for healing)", row
                assert "3 of 3 members ready (1 on standby)" in page.text_content("#summary")
            finally:
                browser.close()


def test_a_standby_member_that_leaves_is_no_longer_listed_as_standby(tmp_path, synth_llama):
    """After `leave` on a member on standby, the host's status still named it on the standby line."""
    with SlowThirdCluster(3, root=str(tmp_path / "c")) as c:
        plan = c.form(str(synth_llama), strategy=None, head="any")["status"]["plan"]
        assert plan["standby"] == ["m2"], plan
        wait_until(lambda: c.call(2, "status")["state"] == "standby", 30, "m2 told it stands by")
        assert "standby (no blocks, ready for healing): m2" in rendered_status(c, 0)
        c.call(2, "leave")

        def m2_left():
            st = c.call(0, "status")
            return st if any(m["name"] == "m2" and m.get("left") for m in st["members"]) else None
        host = wait_until(m2_left, 30, "m2's leave reached the host")
        assert host["state"] == "ready"
        assert [m for m in host["members"] if m.get("standby")] == []
        text = rendered_status(c, 0)
        assert "standby (no blocks" not in text, text
        row = next(line for line in text.splitlines() if line.lstrip("│ ").startswith("m2 "))
        assert "left" in row and "standby" not in row, row
