"""/metrics shows the head's speculative decoding from the status snapshot (issue 24 item 1)."""

from __future__ import annotations

from kafilad.control.metrics import ApiMetrics
from kafilad.proto.status import NodeStatus
from tests.control.test_agent_apis import samples


def test_speculation_counters_as_metrics():
    snap = {"role": "host", "state": "ready", "session_id": "s1", "model_id": "m",
            "speculation": {"on": True, "k": "auto", "passes": 11, "drafted": 88, "accepted": 85, "tokens": 96,
                            "plain_passes": 3, "acceptance": 0.9659, "tokens_per_pass": 7.07, "gain": 3.9,
                            "batch_passes": 2}}
    got = samples(ApiMetrics().render(NodeStatus.from_json(snap)))
    assert got[("kafila_speculation_enabled", ())] == 1
    assert got[("kafila_speculation_passes_total", ())] == 11
    assert got[("kafila_speculation_batch_passes_total", ())] == 2
    assert got[("kafila_speculation_drafted_tokens_total", ())] == 88
    assert got[("kafila_speculation_accepted_tokens_total", ())] == 85
    assert got[("kafila_speculation_plain_passes_total", ())] == 3
    assert got[("kafila_speculation_acceptance_ratio", ())] == 0.9659
    assert got[("kafila_speculation_gain_ratio", ())] == 3.9
    off = samples(ApiMetrics().render(NodeStatus.from_json({**snap, "speculation": {
        "on": False, "why": "KAFILA_SPECULATE=0", "passes": 0, "gain": None}})))
    assert off[("kafila_speculation_enabled", ())] == 0 and ("kafila_speculation_gain_ratio", ()) not in off
