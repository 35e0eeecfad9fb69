"""Upgrade of a relayed edge in the real NAT lab (DESIGN §3 step 6; proto_spec 07 §7).

Two members behind O NATs would go direct, but while the session forms an nft rule in kf-nat1
drops every forwarded UDP datagram to or from the other NAT (a transient block: a firewall
change, a flapping route). Both ring edges relay. The rule is removed mid-session; the
re-probes (``KAFILA_REPROBE_S=2``) find the path and the ring switches to direct while
generations keep running, token-identical to single-process mlx-lm.
"""

from __future__ import annotations

import time

import pytest

from kafila_testing import reference_tokens

from .conftest import require_lab
from .test_paths_lab import LabCluster

BLOCK_TABLE = "kfblock"
OTHER_NAT_WAN = "172.16.0.22"  # kf-nat2's WAN address (member 2)


def _block(lab) -> None:
    for cmd in (["add", "table", "ip", BLOCK_TABLE],
                ["add", "chain", "ip", BLOCK_TABLE, "blockfwd", "{ type filter hook forward priority 0; policy accept; }"],
                ["add", "rule", "ip", BLOCK_TABLE, "blockfwd", "ip", "daddr", OTHER_NAT_WAN, "meta", "l4proto", "udp", "drop"],
                ["add", "rule", "ip", BLOCK_TABLE, "blockfwd", "ip", "saddr", OTHER_NAT_WAN, "meta", "l4proto", "udp", "drop"]):
        r = lab.run("nat1", "nft", *cmd)
        assert r.returncode == 0, r.stderr


def _unblock(lab) -> None:
    lab.run("nat1", "nft", "delete", "table", "ip", BLOCK_TABLE)


@pytest.mark.parametrize("natlab", [("O", "O")], indirect=True)
def test_an_edge_relayed_by_a_transient_block_is_upgraded(natlab, tmp_path):
    require_lab()
    from kafilad.executor.synth import default_synth_model_dir
    model = default_synth_model_dir()
    prompt, n = "Once upon a time", 120
    expected = reference_tokens(model, prompt, n)
    _block(natlab)
    cluster = LabCluster(natlab, env={"KAFILA_REPROBE_S": "2"})
    cluster.__enter__()
    try:
        snap = cluster.form_in_order(str(model))
        assert [m["nat_class"] for m in snap["members"]] == ["O", "O"]
        assert [e["path"] for e in snap["edges"]] == ["relayed", "relayed"], (snap["edges"], cluster.logs())
        assert [e["predicted_path"] for e in snap["edges"]] == ["direct", "direct"]
        assert all(e["reason"].startswith("no direct path answered") for e in snap["edges"]), snap["edges"]
        _unblock(natlab)
        unblocked_at = time.time()
        windows, deadline = [], time.monotonic() + 90
        while True:
            t0 = time.time()
            result = cluster.generate(prompt, n)
            windows.append((t0, time.time()))
            assert result["token_ids"] == expected
            edges = cluster.call(0, "status")["edges"]
            if all(e["path"] == "direct" for e in edges):
                break
            assert time.monotonic() < deadline, (edges, cluster.logs())
        for e in edges:
            assert e["upgraded_from"] == "relayed" and e["upgraded_at"] > unblocked_at and e["tries"] >= 1, e
            assert e["remote"].startswith("172.16.0.2"), e  # the other member's NAT, not the rendezvous
        again = cluster.generate(prompt, n)  # and the direct ring serves
        assert again["token_ids"] == expected
        trace = cluster.call(0, "trace")
        assert [ev for ev in trace if ev["event"] == "edges" and ev.get("cause") == "upgrade"]
        assert set([ev for ev in trace if ev["event"] == "generation"][-1]["path"].values()) == {"direct"}
    finally:
        _unblock(natlab)
        cluster.__exit__(None, None, None)
