"""The load objective (issue 12 item 2): the throughput model, the exact division for K users
against exhaustive search over divisions and standby subsets, and standby members in plans."""

from __future__ import annotations

import itertools
import math
import runpy
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from kafilad.errors import AdmissionError
from kafilad.modelinfo import read_model_info
from kafilad.planner import ChainCost, Device, ModelProfile, plan, order_ring
from kafilad.planner.partition import rotate
from kafilad.planner.plan import ring_hop_s
from kafilad.planner.throughput import micro_batchings, predict, row_costs, solve_chain_load

REPO = Path(__file__).resolve().parents[2]


def compositions(n: int, m: int):
    for cuts in itertools.combinations(range(1, n), m - 1):
        yield [0, *cuts, n]


# -- the throughput model ------------------------------------------------------------------------

def test_one_user_follows_the_circuit():
    t = predict([0.01, 0.03, 0.02], [1.0, 1.0, 1.0], 0.004, 1)
    assert t.tokens_per_s == pytest.approx(1 / 0.064)
    assert (t.micro_batches, t.rows, t.bound) == (1, 1, "circuit")


def test_without_batching_gain_it_is_design_10s_formula():
    # rho = 1: T(K) = K / max(circuit, K * bottleneck) (DESIGN §10), reached with K single rows
    stages, hop = [0.01, 0.03, 0.02], 0.004
    for k in range(1, 9):
        t = predict(stages, [1.0] * 3, hop, k)
        assert t.tokens_per_s == pytest.approx(k / max(0.064, k * 0.03))
    t = predict(stages, [1.0] * 3, hop, 4)
    assert (t.micro_batches, t.rows, t.bound) == (4, 1, "bottleneck")


def test_free_batching_serves_everyone_in_one_batch():
    # rho = 0: a step of b rows costs one row's time, so K rows go round the circuit together;
    # two micro-batches of 3 tie with one of 6 (2 x 30 ms < 64 ms) and win the tie (most P)
    t = predict([0.01, 0.03, 0.02], [0.0] * 3, 0.004, 6)
    assert t.tokens_per_s == pytest.approx(6 / 0.064)
    assert (t.micro_batches, t.rows, t.bound) == (2, 3, "circuit")


def test_batched_refinement_picks_micro_batches():
    # rho = 0.5, K = 4 on two equal 10 ms stages: P=1 b=4 -> max(2*25, 25) = 50 ms;
    # P=2 b=2 -> t(2) = 15 ms, max(30, 30) = 30 ms; P=4 b=1 -> max(20, 40) = 40 ms
    t = predict([0.01, 0.01], [0.5, 0.5], 0.0, 4)
    assert (t.micro_batches, t.rows) == (2, 2)
    assert t.round_s == pytest.approx(0.030) and t.tokens_per_s == pytest.approx(4 / 0.030)


def test_uneven_micro_batches_are_charged_the_larger_size():
    # K = 5 as P = 3: b = ceil(5/3) = 2 rows each (a lower bound on the rate)
    assert (3, 2) in micro_batchings(5)
    assert micro_batchings(5) == [(5, 1), (3, 2), (2, 3), (1, 5)]
    t = predict([0.01], [1.0], 0.0, 5)
    assert t.tokens_per_s == pytest.approx(100.0)  # one stage, no batching gain: 1 / t


@given(st.integers(1, 3000))
def test_micro_batchings_visit_every_p_with_its_fewest_rows(users):
    """The O(sqrt K) walk equals the definition: for b = 1..K, P = ceil(K / b), the fewest b per P."""
    want: dict[int, int] = {}
    for b in range(1, users + 1):
        want.setdefault(-(-users // b), b)
    assert micro_batchings(users) == sorted(want.items(), reverse=True)


def lines_run(fn, *args, limit: int):
    """(fn(*args), how many lines of `fn`'s own code ran): its work counted, not timed.

    Raises:
        AssertionError: past `limit` lines (raised inside `fn`, so an O(K) walk stops at once).
    """
    code, count, outer = fn.__code__, [0], sys.gettrace()

    def local(frame, event, arg):
        if event == "line":
            count[0] += 1
            if count[0] > limit:
                raise AssertionError(f"{fn.__name__} ran more than {limit} lines")
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code is code else None)
    try:
        out = fn(*args)
    finally:
        sys.settrace(outer)
    return out, count[0]


def test_a_huge_declared_concurrency_plans_at_once():
    """A new-user trial (2026-12-02): `host --concurrency 100000000` held the host's event loop 36 s
    (micro_batchings walked b = 1..K); there are at most 2 sqrt(K) distinct P, and the walk visits
    only those: its lines run are counted (at most 8 per P), so the test is as exact on a loaded machine."""
    users = 10 ** 8
    out, lines = lines_run(micro_batchings, users, limit=8 * 2 * math.isqrt(users))
    assert len(out) <= 2 * math.isqrt(users) and out[0] == (users, 1) and out[-1] == (1, users)
    assert lines <= 8 * len(out) + 8, (lines, len(out))


# -- exact search vs exhaustive enumeration ------------------------------------------------------

@st.composite
def load_instances(draw):
    m = draw(st.integers(1, 4))
    n = draw(st.integers(m, 8))
    model = ModelProfile(
        model_id="rand",
        block_bytes=tuple(draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n))),
        head_read_bytes=draw(st.integers(0, 1500)),
        head_resident_bytes=draw(st.integers(0, 3000)),
        kv_bytes_per_block_token=draw(st.integers(0, 3)),
    )
    with_rtt = draw(st.booleans())
    devices = [
        Device(
            name=f"d{i}",
            memory_bytes=draw(st.integers(200, 9000)),
            bandwidth_Bps=float(draw(st.integers(1, 1000))),
            step_overhead_s=draw(st.sampled_from([0.0, 0.0, 0.5, 3.0])),
            batch_row_cost=draw(st.sampled_from([None, 0.0, 0.3, 1.0])),
            nat_class=draw(st.sampled_from([None, "O", "C", "S"])),
            rendezvous_rtt_ms=float(draw(st.integers(0, 4000))) if with_rtt else None,
        )
        for i in range(m)
    ]
    users = draw(st.integers(1, 8))
    ctx = draw(st.integers(1, 40))
    return devices, model, users, ctx


def exhaustive_chain(cc: ChainCost, hop: float, users: int):
    """min over divisions of seconds per token at `users` (predict), or None."""
    best = None
    rho = row_costs(cc.chain)
    for bounds in compositions(cc.n, cc.m):
        if not all(cc.fits(j, bounds[j], bounds[j + 1]) for j in range(cc.m)):
            continue
        t = predict([cc.stage_s(j, bounds[j], bounds[j + 1]) for j in range(cc.m)], rho, hop, users)
        v = t.round_s / users
        best = v if best is None else min(best, v)
    return best


@settings(max_examples=250, deadline=None)
@given(load_instances())
def test_each_chain_matches_exhaustive_search(inst):
    devices, model, users, ctx = inst
    order = order_ring(devices)
    hop = ring_hop_s(order)
    for r in range(len(order)):
        cc = ChainCost(rotate(order, r), model, context=ctx, concurrency=users, tier="cost-model")
        sol = solve_chain_load(cc.n, cc.m, cc.stage_s, cc.fits, row_costs(cc.chain), hop, users)
        want = exhaustive_chain(cc, hop, users)
        if want is None:
            assert sol is None
            continue
        v, bounds = sol
        assert v == pytest.approx(want, rel=1e-9)
        stages = [cc.stage_s(j, bounds[j], bounds[j + 1]) for j in range(cc.m)]
        assert predict(stages, row_costs(cc.chain), hop, users).round_s / users == pytest.approx(want, rel=1e-9)
        assert all(cc.fits(j, bounds[j], bounds[j + 1]) for j in range(cc.m))


def exhaustive_candidates(devices, model, users, ctx, measured=None):
    """Every (active subset keeping the anchor, rotation) with its least seconds per token."""
    out = []
    for size in range(len(devices), 0, -1):
        for combo in itertools.combinations(range(1, len(devices)), size - 1):
            active = order_ring([devices[0], *(devices[i] for i in combo)], measured)
            hop = ring_hop_s(active, measured)
            for r in range(size):
                cc = ChainCost(rotate(active, r), model, context=ctx, concurrency=users, tier="cost-model")
                v = exhaustive_chain(cc, hop, users) if model.n_blocks >= size else None
                out.append((size == len(devices) and r == 0, v, active[r].name, {d.name for d in active}))
    return out


@st.composite
def measured_rtts(draw, devices):
    """Measured round trips for a random set of the devices' pairs (ms, either direction)."""
    out = {}
    for a, b in itertools.combinations([d.name for d in devices], 2):
        if draw(st.booleans()):
            out[(a, b) if draw(st.booleans()) else (b, a)] = float(draw(st.integers(0, 4000)))
    return out


@settings(max_examples=200, deadline=None)
@given(load_instances(), st.sampled_from([0.0, 0.05, 0.2]), st.data())
def test_load_plan_follows_its_rule_against_exhaustive_search(inst, mu, data):
    devices, model, users, ctx = inst
    # measured round trips (issue 24) for some pairs, none in a third of the cases
    measured = data.draw(st.one_of(st.just({}), measured_rtts(devices)))
    cands = exhaustive_candidates(devices, model, users, ctx, measured)
    feasible = [c for c in cands if c[1] is not None]
    if not feasible:
        with pytest.raises(AdmissionError):
            plan(devices, model, context=ctx, concurrency=users, strategy="load", mu=mu, measured_rtt_ms=measured)
        return
    p = plan(devices, model, context=ctx, concurrency=users, strategy="load", mu=mu, measured_rtt_ms=measured)
    v = p.throughput[-1].round_s / users
    best = min(c[1] for c in feasible)
    default = next((c[1] for c in cands if c[0]), None)
    tol = 1e-9
    if default is not None and (default - best) / default <= mu - tol:
        assert p.head == devices[0].name and not p.standby
        assert v == pytest.approx(default, rel=tol)
    elif default is None or (default - best) / default > mu + tol:
        assert v == pytest.approx(best, rel=tol)
    # every member is active or on standby, never both; blocks contiguous from the head
    assert sorted([*p.order, *p.standby]) == sorted(d.name for d in devices)
    assert devices[0].name in p.order  # the anchor (the host) always holds blocks
    assert set(p.blocks) == set(p.order) == set(p.stage_s) == set(p.resident_bytes)
    cur = 0
    for name in p.order:
        a, b = p.blocks[name]
        assert a == cur and b > a and p.resident_bytes[name] <= p.memory_bytes[name]
        cur = b
    assert cur == model.n_blocks
    # never more than the μ margin slower per token than the fastest candidate
    assert v <= best / (1 - mu) * (1 + tol)


# -- standby members -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen8b(tmp_path_factory) -> ModelProfile:
    out = tmp_path_factory.mktemp("models")
    runpy.run_path(str(REPO / "scripts" / "make_model_headers.py"))["make_model"](out, "qwen3-8b", "single")
    return read_model_info(out / "qwen3-8b").profile()


def test_the_issues_fast_and_slow_pair(qwen8b):
    """Issue 12: fast 100 GB/s + slow 10 GB/s on Qwen3-8B. The paper's plan gives the slow one 3
    blocks: bottleneck 139.8 ms but circuit 255.6 ms, 1.7x slower for one user than the fast one
    alone (151.4 ms). The load objective leaves it on standby for one user."""
    ds = [Device("fast", 64 * 10**9, 100e9), Device("slow", 64 * 10**9, 10e9)]
    paper = plan(ds, qwen8b, context=4096, concurrency=1)
    assert paper.counts()["slow"] == 3
    assert paper.bottleneck_s == pytest.approx(0.1398, abs=5e-5)
    assert paper.circuit_s == pytest.approx(0.2556, abs=5e-5)
    one = plan(ds, qwen8b, context=4096, concurrency=1, strategy="load")
    assert one.standby == ("slow",) and one.order == ("fast",) and one.blocks == {"fast": (0, 36)}
    assert one.throughput[0].tokens_per_s == pytest.approx(1 / 0.1514, rel=1e-3)
    assert one.throughput[0].tokens_per_s / paper.throughput[0].tokens_per_s == pytest.approx(0.2556 / 0.1514, rel=1e-3)
    # the best the pair can do for one user (the slow member with one block) is still slower
    assert 1 / paper.circuit_s < one.full_fleet_tokens_per_s < one.throughput[0].tokens_per_s
    j = one.to_json()
    assert j["standby"] == ["slow"] and "slow" not in j["blocks"] and j["memory_bytes"]["slow"] == 64 * 10**9
    # two users, pipelined: max(255.6, 2 x 139.8) / 2 = 139.8 ms per token with the pair beats
    # 151.4 ms alone by more than μ, so the slow member takes blocks again
    two = plan(ds, qwen8b, context=4096, concurrency=2, strategy="load")
    assert two.standby == () and two.throughput[-1].tokens_per_s > 1 / 0.1514


def test_a_member_without_working_memory_slack_is_refused_or_stands_by(qwen8b):
    """Working memory (issue 12 item 3): a device whose memory holds a block of weights and its KV
    cache but not the prefill working set is named by admission; the load objective leaves it
    out instead."""
    from kafilad.planner.workmem import working_bytes
    work = working_bytes(qwen8b.shape, context=4096, concurrency=1, head=False)
    one_block = qwen8b.block_bytes[0] + qwen8b.kv_bytes_per_block_token * 4096
    assert 9 * 10**8 < work < 10**9  # 0.92 GB at context 4096: the scores of a 2048-token chunk dominate
    tight = one_block + work // 2
    ds = [Device("big", 64 * 10**9, 100e9), Device("tight", tight, 100e9)]
    with pytest.raises(AdmissionError) as e:
        plan(ds, qwen8b, context=4096)
    assert e.value.device == "tight" and e.value.shortfall_bytes == work - work // 2
    p = plan(ds, qwen8b, context=4096, strategy="load")
    assert p.standby == ("tight",)
    # with the slack it is admitted
    ok = plan([ds[0], Device("tight", one_block + work, 100e9)], qwen8b, context=4096)
    assert ok.counts()["tight"] == 1 and ok.working_bytes["tight"] == work
