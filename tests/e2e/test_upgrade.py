"""Issue 3 item 4 / DESIGN §3 step 6: relayed ring edges are re-probed and upgraded to direct while a
generation runs, without interrupting it (proto_spec 07 §7).

Real daemons on loopback. The first connectivity checks of every edge are made to fail with the
documented test hook ``KAFILA_TEST_DROP_CHECKS=1`` (each daemon ignores the datagrams addressed
to attempt 0's checks, as a firewall would), so the ring forms over relayed circuits; the
re-probes (``KAFILA_REPROBE_S``) then find the direct paths and the ring switches onto them.
"""

from __future__ import annotations

import json
import time

import pytest

from kafila_ctl.demo import LoopbackCluster
from kafila_testing import STORIES_PROMPT, reference_tokens

pytestmark = pytest.mark.slow


def _form_relayed(cluster: LoopbackCluster, model, context: int) -> dict:
    formed = cluster.form(str(model), context=context)
    edges = formed["status"]["edges"]
    assert len(edges) == 3, edges
    for e in edges:
        assert e["path"] == "relayed" and "upgraded_at" not in e, edges
        assert e["reason"].startswith("no direct path answered within 5 s"), edges
    return formed


def _assert_upgraded(cluster: LoopbackCluster, windows: list[tuple[float, float]]) -> list[dict]:
    """Every edge ends direct, upgraded once, at a time inside one of the generations' windows."""
    status = cluster.call(0, "status")
    edges = status["edges"]
    assert [e["path"] for e in edges] == ["direct"] * 3, edges
    for e in edges:
        assert e["upgraded_from"] == "relayed" and e["tries"] >= 1 and "reason" not in e, e
        assert e["remote"].startswith("127.0.0.1:") and e["rtt_ms"] is not None and e["verify_s"] > 0, e
        assert any(a <= e["upgraded_at"] <= b for a, b in windows), (e, windows)
    trace = cluster.call(0, "trace")
    upgrades = [ev for ev in trace if ev["event"] == "edges" and ev.get("cause") == "upgrade"]
    assert upgrades, "the host's trace should record the upgrades"
    assert [x["path"] for x in upgrades[-1]["edges"]] == ["direct"] * 3
    first = [ev for ev in trace if ev["event"] == "edges"][0]["edges"]
    assert [x["path"] for x in first] == ["relayed"] * 3
    return edges


def test_relayed_ring_upgrades_to_direct_during_a_long_generation(tmp_path, synth_llama):
    """Synthesised model: one long generation spans the re-probes; tokens equal single-process mlx-lm."""
    prompt, n = "Kafila upgrades", 1500
    expected = reference_tokens(synth_llama, prompt, n)
    assert len(expected) > 300  # long enough to span the upgrade
    env = {"KAFILA_TEST_DROP_CHECKS": "1", "KAFILA_REPROBE_S": "1"}  # re-probes at ~1, 3, 7 s
    with LoopbackCluster(3, root=str(tmp_path / "c"), env=env) as cluster:
        _form_relayed(cluster, synth_llama, context=4096)
        t0 = time.time()
        result = cluster.generate(prompt, n)
        t1 = time.time()
        assert result["token_ids"] == expected
        edges = _assert_upgraded(cluster, [(t0, t1)])
        gen = [ev for ev in cluster.call(0, "trace") if ev["event"] == "generation"][-1]
        assert set(gen["path"].values()) == {"direct"}
        # the edge's bytes: every frame of the request, before and after the switch
        assert {e["from"]: e["bytes_sent"] for e in gen["edges"]} == \
            {name: st["ring_bytes_sent"] for name, st in gen["stages"].items()}
        assert all(e["bytes_sent"] > 0 for e in edges)
        again = cluster.generate(prompt, 40)  # and the direct ring keeps serving
        assert again["token_ids"] == expected[:40]


def test_stories260k_generations_continue_across_the_upgrade(tmp_path, stories260k):
    """stories260K (a story ends at EOS): generations back to back until every edge is direct."""
    expected = reference_tokens(stories260k, STORIES_PROMPT, 400)
    env = {"KAFILA_TEST_DROP_CHECKS": "1", "KAFILA_REPROBE_S": "1"}
    with LoopbackCluster(3, root=str(tmp_path / "c"), env=env) as cluster:
        _form_relayed(cluster, stories260k, context=512)
        windows = []
        deadline = time.monotonic() + 60
        while True:
            t0 = time.time()
            result = cluster.generate(STORIES_PROMPT, 400)
            windows.append((t0, time.time()))
            assert result["token_ids"] == expected
            if all(e["path"] == "direct" for e in cluster.call(0, "status")["edges"]):
                break
            assert time.monotonic() < deadline, cluster.call(0, "status")["edges"]
        _assert_upgraded(cluster, windows)


def test_trace_records_each_edge_with_live_bytes(tmp_path, synth_llama):
    """Issue 3 "Done when": per edge, predicted and actual path, time to verify and bytes sent, where the
    bytes are cumulative at each generation and at session end (proto_spec 07 §6)."""
    with LoopbackCluster(3, root=str(tmp_path / "c")) as cluster:
        formed = cluster.form(str(synth_llama))
        sid = formed["status"]["session_id"]
        sums: dict[str, int] = {}
        seen = []
        for prompt, n in (("Kafila", 12), ("Kafila serves", 30)):
            cluster.generate(prompt, n)
            gen = [ev for ev in cluster.call(0, "trace") if ev["event"] == "generation"][-1]
            for name, st in gen["stages"].items():
                assert st["ring_bytes_sent"] > 0
                sums[name] = sums.get(name, 0) + st["ring_bytes_sent"]
            assert {e["from"]: e["bytes_sent"] for e in gen["edges"]} == sums
            for e in gen["edges"]:
                assert e["path"] == "direct" and e["predicted_path"] == "direct"
                assert e["verify_s"] is not None and e["verify_s"] > 0 and e["rtt_ms"] is not None
            host_edge = next(e for e in gen["edges"] if e["from"] == "m0")  # the host's own link counter is live
            assert host_edge["link_bytes_sent"] >= host_edge["bytes_sent"]
            seen.append(dict(sums))
        assert all(seen[1][k] > seen[0][k] for k in seen[0])
        status_edges = cluster.call(0, "status")["edges"]
        assert {e["from"]: e["bytes_sent"] for e in status_edges} == sums
        formed_ev = [ev for ev in cluster.call(0, "trace") if ev["event"] == "edges"][0]["edges"]
        assert [e["bytes_sent"] for e in formed_ev] == [0, 0, 0]
        cluster.call(0, "leave")
        trace = [json.loads(line) for line in
                 (cluster.state_dir(0) / "traces" / f"{sid}.jsonl").read_text().splitlines()]
        closed = [ev for ev in trace if ev["event"] == "session_closed"]
        assert len(closed) == 1
        assert {e["from"]: e["bytes_sent"] for e in closed[0]["edges"]} == sums
        assert [e["path"] for e in closed[0]["edges"]] == ["direct"] * 3
