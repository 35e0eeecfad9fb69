"""The planner entry point: order the ring, divide the model, choose the head (DESIGN §5).

Steps of `plan` (strategy "kafila"):
1. validate the fleet and pick the tier every device supports (§5.4, kafilad.planner.costmodel);
2. order the ring from NAT classes and rendezvous RTTs, anchor first (§5.2, .ring);
3. for each of the m rotations, solve the chain partition exactly within memory (§5.3, .partition);
4. keep the anchor as head unless another rotation lowers the bottleneck by more than μ;
5. if no rotation fits, find the division that minimises the worst memory shortfall and
   raise AdmissionError naming that device and its shortfall (§5.4).
Strategies "uniform" and "memory" (§5.5) use the same order with the head on the anchor, are
evaluated with the same cost model, and are admitted against memory the same way.

Strategy "load" (issue 12 item 2, beyond the paper) maximises the predicted tokens/s at the
declared concurrency K (kafilad.planner.throughput): the circuit for one user, the bottleneck
for many. It searches every active subset that keeps the anchor (the others stand by), each
subset's ring order (§5.2) and rotations, and the exact division of each; it keeps the full
fleet with the anchor as head unless the best candidate is more than μ faster per token.

Every plan carries its predicted tokens/s for 1 and for K users, and resident bytes include
the working memory of kafilad.planner.workmem.

Per-device precision (issue 12 item 4, kafilad.planner.precision): given the model's profile per
dtype, each device is counted in the dtype it holds its stage in (its reported one when that
fits, else its fallback), and the plan says which (`Plan.dtype`); a refusal names the device that
is short even in the narrowest dtype it may hold.
"""

from __future__ import annotations

import itertools
from typing import Mapping, Optional, Sequence

import attrs

from kafilad.errors import AdmissionError, PlanError
from kafilad.planner import baselines, partition, precision, ring, throughput
from kafilad.planner.costmodel import ChainCost, check_devices, select_tier, summarize
from kafilad.planner.precision import Profiles
from kafilad.planner.records import Device, Plan

STRATEGIES = ("kafila", "load", "uniform", "memory")
#: the division `host` and `plan` choose unless told: the most tokens/s at the declared concurrency
#: (issue 12 item 2; "kafila" is the paper's least-bottleneck objective, DESIGN §5.3)
DEFAULT_STRATEGY = "load"
DEFAULT_MU = 0.05


def _gb(x: int) -> str:
    return f"{x / 1e9:.2f} GB"


def ring_hop_s(order: Sequence[Device], measured_rtt_ms: Optional[Mapping] = None) -> float:
    """H: Σ one-way latency (RTT / 2; measured where `measured_rtt_ms` has the pair, else the
    rendezvous estimate, kafilad.planner.ring) of the ring's edges whose RTT is known, seconds."""
    total = 0.0
    for a, b in ring.ring_edges(order):
        rtt = ring.edge_rtt_ms(a, b, measured_rtt_ms)
        if rtt is not None:
            total += rtt / 2.0 / 1000.0
    return total


#: A plan is made again once the ring edges' measured round trips move its hops (H, the Σ of one-way
#: latencies a token pays) by at least this much a token and this fraction of its circuit (issue 24:
#: the rendezvous RTTs cannot see a slow hop between two members). The floor keeps LAN and loopback
#: rings from replanning on noise: their check RTTs are 0.4-5 ms on this 2-core VM when quiet (one
#: sample per edge, taken while three daemons start), more under load, and at a 5 ms floor a
#: loaded loopback ring once replanned two equal members into one. Across WAN hops (10-80 ms one
#: way) a ring of two or more edges moves by 20 ms or more.
RTT_REPLAN_MIN_S = 0.015
RTT_REPLAN_FRACTION = 0.10


def hop_change_s(p: Plan, measured_rtt_ms: Optional[Mapping]) -> tuple[float, Optional[tuple]]:
    """How much the measured round trips change plan `p`'s hops, seconds a token.

    Args:
        p: a plan; its edges and `edge_latency_s` are what it was made with.
        measured_rtt_ms: measured round trips, {(from, to): ms} (either direction).
    Returns:
        (Σ over the plan's ring edges of measured one-way latency − the latency the plan used, with
        an unknown latency counted as 0; the (from, to) edge whose latency changed most, or None
        when no edge of the plan was measured).
    """
    total, worst, worst_d = 0.0, None, 0.0
    for i, (a, b, _path) in enumerate(p.edges):
        rtt = ring.measured_rtt(measured_rtt_ms, a, b)
        if rtt is None:
            continue
        used = p.edge_latency_s[i] if i < len(p.edge_latency_s) and p.edge_latency_s[i] is not None else 0.0
        d = rtt / 2.0 / 1000.0 - used
        total += d
        if worst is None or abs(d) > abs(worst_d):
            worst, worst_d = (a, b), d
    return total, worst


def rtt_replan_due(p: Plan, measured_rtt_ms: Optional[Mapping]) -> bool:
    """Whether plan `p` should be made again with `measured_rtt_ms`: its hops moved by at least
    RTT_REPLAN_MIN_S and RTT_REPLAN_FRACTION of its circuit (a plan made with those very figures
    never is, so replanning on them ends)."""
    change_s, _ = hop_change_s(p, measured_rtt_ms)
    return abs(change_s) >= max(RTT_REPLAN_MIN_S, RTT_REPLAN_FRACTION * p.circuit_s)


def build_plan(chain: Sequence[Device], model: Profiles, bounds: Sequence[int], *, tier: str,
               strategy: str, context: int, concurrency: int,
               rotation_bottleneck_s: Optional[dict] = None, standby: Sequence[Device] = (),
               full_fleet_tokens_per_s: Optional[float] = None, measured_rtt_ms: Optional[Mapping] = None) -> Plan:
    """Evaluate a division of `model` over `chain` (head = chain[0]) as a Plan.

    Args:
        chain: the active devices in ring order, head first.
        bounds: [0, b1, ..., n]; chain[j] holds [bounds[j], bounds[j+1]).
        tier, strategy, context, concurrency, measured_rtt_ms: as in `plan`.
        standby: fleet members left without blocks (strategy "load").
    Returns:
        the Plan (no memory check; see `admit`).
    """
    cc = ChainCost(chain, model, context=context, concurrency=concurrency, tier=tier)
    names = [d.name for d in chain]
    dtypes = {names[j]: cc.dtype(j, bounds[j], bounds[j + 1]) for j in range(len(chain))}
    stage = [cc.stage_s(j, bounds[j], bounds[j + 1]) for j in range(len(chain))]
    bottleneck, util, imb = summarize(stage)
    edges, lat, measured = [], [], []
    for a, b in ring.ring_edges(chain):
        edges.append((a.name, b.name, ring.predict_path(a.nat_class, b.nat_class)))
        rtt = ring.edge_rtt_ms(a, b, measured_rtt_ms)
        lat.append(None if rtt is None else rtt / 2.0 / 1000.0)
        measured.append(ring.measured_rtt(measured_rtt_ms, a.name, b.name) is not None)
    hop = sum(x for x in lat if x is not None)
    circuit = sum(stage) + hop
    rho = throughput.row_costs(chain)
    rates = [throughput.predict(stage, rho, hop, 1)]
    if concurrency > 1:
        rates.append(throughput.predict(stage, rho, hop, concurrency))
    return Plan(
        order=tuple(names),
        head=names[0],
        blocks={names[j]: (bounds[j], bounds[j + 1]) for j in range(len(chain))},
        stage_s=dict(zip(names, stage)),
        bottleneck_s=bottleneck,
        circuit_s=circuit,
        utilization=util,
        imbalance=imb,
        resident_bytes={names[j]: cc.resident_bytes(j, bounds[j], bounds[j + 1]) for j in range(len(chain))},
        tier=tier,
        strategy=strategy,
        edges=edges,
        model_id=cc.model.model_id,
        n_blocks=cc.n,
        context=context,
        concurrency=concurrency,
        memory_bytes={d.name: int(d.memory_bytes) for d in [*chain, *standby]},
        edge_latency_s=tuple(lat),
        edge_measured=tuple(measured),
        rotation_bottleneck_s=dict(rotation_bottleneck_s or {}),
        standby=tuple(d.name for d in standby),
        working_bytes={names[j]: cc.working_bytes(j, bounds[j], bounds[j + 1]) for j in range(len(chain))},
        throughput=tuple(rates),
        full_fleet_tokens_per_s=full_fleet_tokens_per_s,
        dtype={n: dt for n, dt in dtypes.items() if dt is not None},
    )


def _admission_error(p: Plan, name: str, shortfall: int, best: bool) -> AdmissionError:
    a, b = p.blocks[name]
    what = "even the division that best fits memory" if best else f"the {p.strategy} division"
    head = " and the head's embedding and output layers" if name == p.head else ""
    dtype = f" in {p.dtype[name]}" if name in p.dtype else ""
    msg = (f"{p.model_id or 'The model'} does not fit this fleet at context {p.context} x "
           f"concurrency {p.concurrency}: {what} leaves device {name!r} short by {shortfall} bytes "
           f"({_gb(shortfall)}); it would hold blocks [{a}, {b}){head}{dtype}, {p.resident_bytes[name]} "
           f"bytes, in {p.memory_bytes[name]} bytes available. Add memory or a device, or lower "
           f"the context or concurrency.")
    return AdmissionError(msg, name, shortfall)


def admit(p: Plan) -> Plan:
    """Check every member's resident bytes against its memory (DESIGN §5.4).

    Raises:
        AdmissionError: naming the device with the largest shortfall and that shortfall in bytes.
    """
    worst = max(p.order, key=lambda n: p.resident_bytes[n] - p.memory_bytes[n])
    short = p.resident_bytes[worst] - p.memory_bytes[worst]
    if short > 0:
        raise _admission_error(p, worst, short, best=False)
    return p


def _refuse(order: list[Device], model: Profiles, *, tier: str, context: int,
            concurrency: int, measured_rtt_ms: Optional[Mapping] = None) -> AdmissionError:
    """The AdmissionError for a fleet no rotation fits: the division minimising the worst
    shortfall (exact, over all rotations, anchor preferred on ties) names the device."""
    best = None
    for r in range(len(order)):
        chain = partition.rotate(order, r)
        cc = ChainCost(chain, model, context=context, concurrency=concurrency, tier=tier)
        sol = partition.solve_chain(cc.n, len(chain), cc.overflow_bytes)
        if sol is not None and (best is None or sol[0] < best[0]):
            best = (sol[0], chain, sol[1])
    assert best is not None  # n >= m was checked
    short, chain, bounds = best
    p = build_plan(chain, model, bounds, tier=tier, strategy="kafila", context=context,
                   concurrency=concurrency, measured_rtt_ms=measured_rtt_ms)
    worst = max(p.order, key=lambda n: p.resident_bytes[n] - p.memory_bytes[n])
    return _admission_error(p, worst, p.resident_bytes[worst] - p.memory_bytes[worst], best=True)


def _plan_load(devices: Sequence[Device], model: Profiles, mu: float, *, tier: str, context: int,
               concurrency: int, head_self: bool = False, heads: Optional[frozenset] = None,
               measured_rtt_ms: Optional[Mapping] = None) -> Plan:
    """Strategy "load": the plan with the most predicted tokens/s at `concurrency` users.

    Candidates, in preference order: active subsets that keep the anchor, largest first (then in
    listed order); for each, its ring order (§5.2) and rotations, the subset's anchor first; for
    each, the exact division (throughput.solve_chain_load). The full fleet with the anchor as
    head is kept unless the best candidate's seconds per token are more than μ lower; otherwise
    the best wins (ties: the earliest in preference order). Candidates that cannot beat the best
    so far are pruned by a lower bound, never by a heuristic.

    `heads` (see `plan`): only candidates headed by one of them compete; the best candidate headed
    by another is named in `held_back` when it is more than μ faster, and taken (`head_unconfirmed`)
    when no allowed head fits.

    Raises:
        AdmissionError: no subset fits (named for the full fleet, as strategy "kafila" would).
    """
    n, m = precision.reference(model).n_blocks, len(devices)
    measured = measured_rtt_ms
    order = ring.order_ring(devices, measured)
    kw = dict(tier=tier, context=context, concurrency=concurrency)
    # each member's cost rows as head and as a later stage, computed once (throughput.cost_rows)
    rows = {}
    for d in devices:
        for head in (True, False):
            cc = ChainCost([d] if head else [d, d], model, **kw)
            j = 0 if head else 1
            rows[d.name, head] = throughput.cost_rows(n, lambda a, b: cc.stage_s(j, a, b),
                                                      lambda a, b: cc.fits(j, a, b))
    best = None  # (seconds per token, chain, bounds, active set), among the rotations whose head may head
    best_any = None  # ... among every rotation: the head the `heads` restriction holds back, if any
    default_v = full_v = None
    for size in range(min(m, n), 0, -1):
        for combo in itertools.combinations(range(1, m), size - 1):
            active = ring.order_ring([devices[0], *(devices[i] for i in combo)], measured)
            hop = ring_hop_s(active, measured)
            for r in range(1 if head_self else size):  # head_self: only the anchor heads
                chain = partition.rotate(active, r)
                allowed = heads is None or chain[0].name in heads
                cc = ChainCost(chain, model, **kw)
                is_default = size == m and r == 0
                mine = best if allowed else best_any
                cutoff = throughput.INF if (is_default or mine is None) else mine[0]
                sol = throughput.solve_chain_load(n, size, cc.stage_s, cc.fits, throughput.row_costs(chain),
                                                  hop, concurrency, cutoff,
                                                  [rows[d.name, j == 0] for j, d in enumerate(chain)])
                if sol is None:
                    continue
                if is_default and allowed:
                    default_v = sol[0]
                cand = (sol[0], chain, sol[1], {d.name for d in active})
                if best_any is None or sol[0] < best_any[0]:
                    best_any = cand
                if allowed and (best is None or sol[0] < best[0]):
                    best = cand
        if size == m and best is not None:
            full_v = best[0]
    unconfirmed = False
    if best is None and best_any is not None:  # no head allowed by `heads` fits: the planner's choice
        best, unconfirmed = best_any, True
    if best is None:
        raise _refuse(order, model, measured_rtt_ms=measured, **kw)
    if not unconfirmed and default_v is not None and default_v > 0 and (default_v - best[0]) / default_v <= mu:
        chain = order
        cc = ChainCost(chain, model, **kw)
        sol = throughput.solve_chain_load(n, m, cc.stage_s, cc.fits, throughput.row_costs(chain),
                                          ring_hop_s(chain, measured), concurrency)
        assert sol is not None
        best = (sol[0], list(chain), sol[1], {d.name for d in chain})
    held_back, gain = None, 0.0
    if best_any is not None and best_any[1][0].name != best[1][0].name and best[0] > 0 \
            and (best[0] - best_any[0]) / best[0] > mu:
        held_back, gain = best_any[1][0].name, (best[0] - best_any[0]) / best[0]
    _, chain, bounds, active_names = best
    standby = [d for d in order if d.name not in active_names]
    full_rate = None if full_v is None or full_v <= 0 else 1.0 / full_v
    return attrs.evolve(build_plan(chain, model, bounds, strategy="load", standby=standby,
                                   full_fleet_tokens_per_s=full_rate, measured_rtt_ms=measured, **kw),
                        held_back=held_back, held_back_gain=gain, head_unconfirmed=unconfirmed)


def plan(devices: Sequence[Device], model: Profiles, *, context: int = 4096,
         concurrency: int = 1, strategy: str = "kafila", mu: float = DEFAULT_MU, head_self: bool = False,
         heads: Optional[frozenset] = None, measured_rtt_ms: Optional[Mapping] = None) -> Plan:
    """Divide `model` over `devices` (DESIGN §5).

    Args:
        devices: the fleet, anchor (the host) first.
        model: the byte profile as the members will hold it (kafilad.modelinfo ... .profile()),
            or one per dtype ({dtype: profile}, ModelInfo.profiles): each device is then counted
            in the dtype it holds its stage in (kafilad.planner.precision).
        context: tokens of context per request the KV cache must hold.
        concurrency: concurrent requests the KV cache must hold.
        strategy: "kafila" (the paper's exact partition + rotation rule; this function's default),
            "load" (most tokens/s at `concurrency` users, members may stand by; DEFAULT_STRATEGY,
            what `host` and `kafila-ctl plan` choose unless told), "uniform" or "memory" (§5.5).
        mu: relative bottleneck gain a rotation needs to move the head off the anchor.
        head_self: the anchor (the host) is the head whatever the other rotations would gain
            (`host --head self`, issue 22 item 5: the head sees every prompt and samples every
            token, so a group may want that machine to be its own).
        heads: names that may be the head (None: any). The host passes itself and the members whose
            reports measurement confirmed (kafilad/planner/trust.py; docs/planner.md "Who may be
            the head"). Strategies "kafila" and "load" choose the head among them; when a device
            outside them would be more than μ faster as head, `Plan.held_back` names it; when none of
            them can hold the head's share, the unrestricted choice is taken and `Plan.head_unconfirmed`
            is set. "uniform" and "memory" keep the anchor as head, as before.
        measured_rtt_ms: measured round trips of device pairs, {(from name, to name): ms} (either
            direction), e.g. a live session's ring edges' connectivity checks (proto_spec 07 §6);
            they win over the rendezvous estimates in the ring order and in every edge's latency
            (kafilad.planner.ring), so a slow hop the rendezvous cannot see is planned for. None or
            empty: estimates only, as before.
    Returns:
        the Plan; `order` is the ring from the head.
    Raises:
        PlanError: no devices, duplicate names, bad values, fewer blocks than devices, unknown
            strategy, context/concurrency below 1, or a device dtype the profiles lack.
        AdmissionError: a device cannot hold its share (names it and the shortfall in bytes).
    """
    if strategy not in STRATEGIES:
        raise PlanError(f"Unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}.")
    if context < 1 or concurrency < 1:
        raise PlanError(f"Context ({context}) and concurrency ({concurrency}) must both be at least 1.")
    check_devices(devices)
    n, m = precision.reference(model).n_blocks, len(devices)
    for d in devices:
        precision.device_profiles(model, d)  # raises the PlanError for a dtype the profiles lack
    if n < m:
        baselines.uniform_counts(n, m)  # raises the PlanError with its message
    tier = select_tier(devices, model)
    measured = dict(measured_rtt_ms or {})
    order = ring.order_ring(devices, measured)
    kw = dict(tier=tier, context=context, concurrency=concurrency, measured_rtt_ms=measured)
    if strategy == "load":
        return _plan_load(devices, model, mu, head_self=head_self, heads=heads, **kw)
    if strategy == "uniform":
        counts = baselines.uniform_counts(n, m)
        return admit(build_plan(order, model, baselines.bounds_of(counts), strategy=strategy, **kw))
    if strategy == "memory":
        counts = baselines.memory_counts(n, [d.memory_bytes for d in order])
        return admit(build_plan(order, model, baselines.bounds_of(counts), strategy=strategy, **kw))
    sols = []
    for r in range(1 if head_self else m):
        chain = partition.rotate(order, r)
        cc = ChainCost(chain, model, tier=tier, context=context, concurrency=concurrency)
        sols.append((chain, partition.solve_chain(n, m, cc.stage_s, cc.fits)))
    rot_b = {chain[0].name: (sol[0] if sol else None) for chain, sol in sols}
    every = [sol[0] if sol else None for _, sol in sols]
    r_any = partition.choose_rotation(every, mu)
    r = partition.choose_rotation([b if heads is None or chain[0].name in heads else None
                                   for (chain, _), b in zip(sols, every)], mu)
    unconfirmed = r is None and r_any is not None  # no allowed head fits: the planner's choice
    r = r_any if unconfirmed else r
    if r is None:
        raise _refuse(order, model, **kw)
    chain, sol = sols[r]
    gain = (every[r] - every[r_any]) / every[r] if r_any is not None and r_any != r and every[r] else 0.0
    held_back = sols[r_any][0][0].name if gain > mu else None
    return attrs.evolve(build_plan(chain, model, sol[1], strategy=strategy, rotation_bottleneck_s=rot_b, **kw),
                        held_back=held_back, held_back_gain=gain, head_unconfirmed=unconfirmed)
