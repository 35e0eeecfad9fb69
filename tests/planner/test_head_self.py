"""`host --head self` (issue 22 item 5): the anchor (the host) is the head of every plan, whatever a
member reports. Without it, a member that says it is very fast takes the head (and with it every
prompt and every sampled token) under every strategy that rotates."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kafilad.errors import AdmissionError
from kafilad.planner import Device, ModelProfile, plan

MODEL = ModelProfile(model_id="m", block_bytes=(100,) * 8, head_read_bytes=400, head_resident_bytes=800,
                     kv_bytes_per_block_token=0)
#: the host is slow; m1 claims a huge bandwidth
FLEET = [Device("host", 10_000, 1e3), Device("m1", 10_000, 1e12), Device("m2", 10_000, 1e3)]


@pytest.mark.parametrize("strategy", ["kafila", "load"])
def test_a_member_claiming_speed_heads_unless_the_host_pins_the_head(strategy):
    assert plan(FLEET, MODEL, context=8, strategy=strategy).head == "m1"
    pinned = plan(FLEET, MODEL, context=8, strategy=strategy, head_self=True)
    assert pinned.head == "host" and pinned.order[0] == "host"
    assert pinned.blocks["host"][0] == 0


@settings(max_examples=60, deadline=None)
@given(bw=st.lists(st.floats(1.0, 1e12), min_size=2, max_size=4), mem=st.lists(st.integers(900, 5000), min_size=4,
                                                                                 max_size=4),
       strategy=st.sampled_from(["kafila", "load", "uniform", "memory"]))
def test_the_pinned_head_is_always_the_anchor(bw, mem, strategy):
    fleet = [Device(f"d{i}", mem[i], b) for i, b in enumerate(bw)]
    try:
        p = plan(fleet, MODEL, context=8, strategy=strategy, head_self=True)
    except AdmissionError:
        return
    assert p.head == "d0"
