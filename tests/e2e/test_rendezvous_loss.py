"""Issue 8 §3 with real processes: the rendezvous is killed mid-session and started again on the
same address. DESIGN §2: it is signalling and a last-resort relay, so

- head = host, every edge direct: the session serves on *during* the outage, token-identical; the
  host's status says `reconnecting (attempt n, next in s)`; members stay `ready` (control down);
- head = another member, or relayed edges: the members' links went with the rendezvous; the host
  replans over what is left (here the host alone holds the small model) and serves on; the
  members' status says `reconnecting` (attempt, next try, why) while their daemons rejoin;
- after the restart every daemon reconnects by itself (`"rendezvous": "connected"`), the session
  keeps its id and code, the members rejoin and are planned back in, token-identical again.
In every case every daemon stays up.
"""

from __future__ import annotations

import time

import pytest

from kafila_ctl.demo import LoopbackCluster

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"
MAX_TOKENS = 12
FORM_TRIES = 4


def daemons_alive(c: LoopbackCluster) -> None:
    for i, p in enumerate(c.daemons):
        assert p.poll() is None, f"daemon {c.names[i]} exited"
        assert c.call(i, "keys")["name"] == c.names[i]


def wait_status(c: LoopbackCluster, i: int, pred, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        st = c.call(i, "status")
        if pred(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"{c.names[i]} status never matched: {st}")
        time.sleep(0.2)


def form_with_head(c: LoopbackCluster, model: str, want_host_head: bool) -> dict:
    """Form (leave and form again, up to FORM_TRIES times) until the planner's head is / is not the
    host; return the status of the last formation (the caller checks which case it got)."""
    for attempt in range(FORM_TRIES):
        if attempt:
            for i in range(c.n):
                c.call(i, "leave")
        st = c.form(model, head="auto")["status"]
        if (st["plan"]["head"] == c.names[0]) == want_host_head:
            break
    return st


def planned(st: dict) -> int:
    return sum(1 for m in st["members"] if m["blocks"])


def check_back(c: LoopbackCluster, code: str, before: dict) -> None:
    """After the rendezvous restart: everyone connected, same code, 3 members planned, same tokens."""
    c.restart_rendezvous()
    st = wait_status(c, 0, lambda s: s["rendezvous"] == "connected" and s["state"] == "ready" and planned(s) == 3,
                     timeout_s=60)
    assert st["code"] == code
    for i in (1, 2):
        ms = wait_status(c, i, lambda s: s["rendezvous"] == "connected" and s["state"] == "ready", timeout_s=60)
        assert ms["code"] == code
    assert c.generate(PROMPT, MAX_TOKENS)["token_ids"] == before["token_ids"]
    events = [r["event"] for r in c.call(0, "trace")]
    assert "rendezvous_lost" in events and "rendezvous_reconnected" in events


@pytest.mark.parametrize("want_host_head", [True, False], ids=["head-is-host", "head-is-member"])
def test_direct_ring_outlives_the_rendezvous_and_reconnects(tmp_path, synth_llama, want_host_head):
    with LoopbackCluster(3, root=str(tmp_path / "c")) as c:
        st = form_with_head(c, str(synth_llama), want_host_head)
        assert all(e["path"] == "direct" for e in st["edges"]), st["edges"]
        assert st["rendezvous"] == "connected"
        code, head = st["code"], st["plan"]["head"]
        before = c.generate(PROMPT, MAX_TOKENS)
        assert len(before["token_ids"]) == MAX_TOKENS
        c.rdv.kill()
        c.rdv.wait(timeout=10)
        st = wait_status(c, 0, lambda s: s["rendezvous"].startswith("reconnecting (attempt "))
        if head == c.names[0]:  # the direct ring serves on during the outage
            assert st["state"] == "ready"
            assert {m["name"]: m["control"] for m in st["members"]} == {"m0": None, "m1": "down", "m2": "down"}
            for i in (1, 2):
                ms = wait_status(c, i, lambda s: s["state"] == "ready" and s["control"] == "down")
                assert ms["error"] is None
        else:  # the host lost its head's link: it replans over itself and serves on
            wait_status(c, 0, lambda s: s["state"] == "ready" and planned(s) == 1)
        assert c.generate(PROMPT, MAX_TOKENS)["token_ids"] == before["token_ids"]
        daemons_alive(c)
        check_back(c, code, before)
        daemons_alive(c)


def test_relayed_ring_heals_over_a_rendezvous_restart(tmp_path, synth_llama):
    with LoopbackCluster(3, root=str(tmp_path / "c"), env={"KAFILA_DIRECT": "0"}) as c:
        st = c.form(str(synth_llama))["status"]
        assert all(e["path"] == "relayed" for e in st["edges"]), st["edges"]
        before = c.generate(PROMPT, MAX_TOKENS)
        c.rdv.kill()
        c.rdv.wait(timeout=10)
        st = wait_status(c, 0, lambda s: s["state"] == "ready" and planned(s) == 1)
        lost = [m for m in st["members"] if m["lost"]]
        assert {m["name"] for m in lost} == {"m1", "m2"} and all("rendezvous" in m["lost"] for m in lost)
        for i in (1, 2):  # their daemons rejoin: `reconnecting`, with the attempt and why (not `failed`)
            ms = wait_status(c, i, lambda s: s["state"] == "reconnecting")
            assert ms["code"] == st["code"] and ms["rendezvous"].startswith("reconnecting (attempt "), ms
            assert "rendezvous" in ms["reconnecting"]["reason"], ms
        daemons_alive(c)
        check_back(c, st["code"], before)
        daemons_alive(c)
