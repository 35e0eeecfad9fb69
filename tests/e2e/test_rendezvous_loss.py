"""DESIGN §2: the rendezvous is signalling and a last-resort relay, so losing it must not end a
session whose ring edges are all direct. Real processes on loopback (edges go direct there); the
rendezvous process is killed mid-session.

- head = host: generation after the kill is token-identical to generation before it; the host's
  status says the rendezvous and every member's control link are down; members stay `ready`.
- head = another member: the host's control link to the head was a relayed circuit, so the host
  cannot start requests any more; the session fails with a sentence naming the head and the
  rendezvous, and generate says so.
- every edge relayed (KAFILA_DIRECT=0): the ring itself went through the rendezvous; the session
  fails with a sentence naming the rendezvous loss.
In every case every daemon stays up.
"""

from __future__ import annotations

import time

import pytest

from kafila_ctl.demo import LoopbackCluster
from kafilad.errors import KafilaError

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"
MAX_TOKENS = 12
FORM_TRIES = 4


def daemons_alive(c: LoopbackCluster) -> None:
    for i, p in enumerate(c.daemons):
        assert p.poll() is None, f"daemon {c.names[i]} exited"
        assert c.call(i, "keys")["name"] == c.names[i]


def kill_rendezvous(c: LoopbackCluster) -> None:
    c.rdv.kill()
    c.rdv.wait(timeout=10)


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
        st = c.form(model)["status"]
        if (st["plan"]["head"] == c.names[0]) == want_host_head:
            break
    return st


def check_host_head(c: LoopbackCluster, before: dict) -> None:
    st = wait_status(c, 0, lambda s: s.get("rendezvous") == "lost")
    assert st["state"] == "ready" and st["error"] is None
    assert {m["name"]: m["control"] for m in st["members"]} == {"m0": None, "m1": "down", "m2": "down"}
    assert all(e["path"] == "direct" for e in st["edges"])
    after = c.generate(PROMPT, MAX_TOKENS)
    assert after["token_ids"] == before["token_ids"] and after["text"] == before["text"]
    again = c.generate(PROMPT, MAX_TOKENS)  # and again: the ring keeps serving
    assert again["token_ids"] == before["token_ids"]
    for i in (1, 2):
        ms = wait_status(c, i, lambda s: s.get("rendezvous") == "lost")
        assert ms["state"] == "ready" and ms["error"] is None and ms["control"] == "down"


def check_member_head(c: LoopbackCluster, head: str) -> None:
    st = wait_status(c, 0, lambda s: s["state"] == "failed")
    assert st["rendezvous"] == "lost"
    assert f"the control link to the head {head} went down with the rendezvous" in st["error"]
    with pytest.raises(KafilaError) as e:
        c.generate(PROMPT, MAX_TOKENS)
    assert f"the control link to the head {head} went down with the rendezvous" in str(e.value)
    for i in (1, 2):  # the members lost only their ctl link: they keep their ring stage up
        ms = wait_status(c, i, lambda s: s.get("rendezvous") == "lost")
        assert ms["state"] == "ready" and ms["error"] is None and ms["control"] == "down"


@pytest.mark.parametrize("want_host_head", [True, False], ids=["head-is-host", "head-is-member"])
def test_direct_ring_outlives_the_rendezvous(tmp_path, synth_llama, want_host_head):
    with LoopbackCluster(3, root=str(tmp_path / "c")) as c:
        st = form_with_head(c, str(synth_llama), want_host_head)
        assert all(e["path"] == "direct" for e in st["edges"]), st["edges"]
        assert st["rendezvous"] == "connected"
        head = st["plan"]["head"]
        before = c.generate(PROMPT, MAX_TOKENS)
        assert len(before["token_ids"]) == MAX_TOKENS
        kill_rendezvous(c)
        if head == c.names[0]:
            check_host_head(c, before)
        else:
            check_member_head(c, head)
        daemons_alive(c)
        for i in range(c.n):  # leaving still works without the rendezvous
            c.call(i, "leave")
        daemons_alive(c)


def test_relayed_ring_fails_naming_the_rendezvous(tmp_path, synth_llama):
    with LoopbackCluster(3, root=str(tmp_path / "c"), env={"KAFILA_DIRECT": "0"}) as c:
        st = c.form(str(synth_llama))["status"]
        assert all(e["path"] == "relayed" for e in st["edges"]), st["edges"]
        assert len(c.generate(PROMPT, 4)["token_ids"]) == 4
        kill_rendezvous(c)
        st = wait_status(c, 0, lambda s: s["state"] == "failed")
        assert "the connection to the rendezvous was lost" in st["error"], st["error"]
        assert st["rendezvous"] == "lost"
        for i in (1, 2):
            ms = wait_status(c, i, lambda s: s["state"] == "failed")
            assert "rendezvous" in ms["error"], ms["error"]
        with pytest.raises(KafilaError) as e:
            c.generate(PROMPT, 4)
        assert "the connection to the rendezvous was lost" in str(e.value)
        daemons_alive(c)
