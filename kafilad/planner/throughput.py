"""Tokens per second for K concurrent requests, and the exact division that maximises it
(issue 12 item 2; docs/planner.md "Throughput and the load objective").

The paper always minimises the bottleneck. That is right when many requests are in flight, but
one request's token goes round the whole circuit: with one user a slow member that takes a few
blocks lowers the bottleneck and still lengthens the circuit. The model (DESIGN §10):

```
 t_j           stage_s of active member j (one row, seconds; DESIGN §5.1)
 H             Σ one-way latency of the active ring's edges whose RTT is known
 rho_j         member j's batch_row_cost: a b-row step costs t_j(b) = t_j · (1 + rho_j·(b − 1));
               unknown = 1 (rows cost as much as separate steps: no gain from batching)
 K users       decoded as P micro-batches in flight round the ring (1 <= P <= K), b = ceil(K / P)
               rows each: P = 1 is lockstep batching, P = K per-request pipelining
 round(P)      = max(Σ_j t_j(b) + H, P · max_j t_j(b))      every request advances one token
 T(K)          = max over P of K / round(P)                 tokens/s
 T(1)          = 1 / (Σ_j t_j + H) = 1 / circuit
```

round(P) is the cycle time of P equal micro-batches circulating a ring of k single-server stages
(each micro-batch needs the circuit; each stage serves P steps per round); when P does not
divide K every micro-batch is charged ceil(K / P) rows, so T(K) is then a lower bound. For a
given b only the least P = ceil(K / b) matters (round grows with P), so the P tried are
{ceil(K / b)} over b = 1..K: about 2·sqrt(K) of them. With rho = 1 everywhere P = K wins and
T(K) = K / max(circuit, K · bottleneck), DESIGN §10's formula.

Exact division for K (`solve_chain_load`): for each P, minimise f(D) = max(S(D) + H, P·M(D))
over divisions D, where S is the sum and M the max of the scaled stage times. With
minsum(B) = the least S among divisions with M <= B (a DP bounded by B, exact), the optimum is
min over candidate values B of max(minsum(B) + H, P·B); minsum is non-increasing and P·B
increasing, so the minimum sits where they cross: a binary search over the sorted candidates
between B* (the least feasible bottleneck) and the max of the unbounded min-sum division, then
the better of the two divisions either side of the crossing. O(k·n² · log(k·n²)) per P.

Pure: no I/O.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Optional, Sequence

import attrs

CostFn = Callable[[int, int, int], float]
FitsFn = Callable[[int, int, int], bool]
INF = float("inf")


@attrs.frozen
class Throughput:
    """The predicted rate of one division for `users` concurrent requests.

    Attributes:
        users: K. tokens_per_s: T(K). round_s: round(P) at the best P.
        micro_batches: P. rows: b = ceil(K / P).
        circuit_s: Σ t_j(b) + H. bottleneck_s: max t_j(b).
        bound: "circuit" when circuit_s >= P · bottleneck_s (the micro-batches wait for each
            other's trip round the ring), else "bottleneck" (the slowest stage is busy all round).
    """

    users: int
    tokens_per_s: float
    round_s: float
    micro_batches: int
    rows: int
    circuit_s: float
    bottleneck_s: float
    bound: str

    def to_json(self) -> dict:
        return attrs.asdict(self)


def row_costs(devices) -> list[float]:
    """rho_j of each device (batch_row_cost, unknown = 1.0)."""
    return [1.0 if d.batch_row_cost is None else float(d.batch_row_cost) for d in devices]


def batch_row_cost_of(one_row_s: Sequence[float], batch_s: Sequence[float], rows: int) -> float:
    """rho from paired timings of one decode step at 1 row and at `rows` rows (the inverse of
    t(b) = t · (1 + rho·(b − 1)); kafilad/executor/probe.py `measure_stage` times the pairs).

    The median over pairs of batch_s[i] / one_row_s[i] is the ratio r; rho = (r − 1) / (rows − 1),
    clamped to [0, 1] (a batched step faster than one row, or dearer than `rows` separate steps, is
    noise) and rounded to 3 digits.

    Args:
        one_row_s: seconds per 1-row step, one per repeat (> 0).
        batch_s: seconds per `rows`-row step of the same repeats (same length, > 0).
        rows: B >= 2, the rows of the batched step.
    Returns:
        rho in [0, 1], 3 decimals.
    Raises:
        ValueError: fewer than 2 rows, no pairs, unequal lengths, or a time that is not positive.
    """
    if rows < 2:
        raise ValueError(f"A batched step needs at least 2 rows to give a row cost, not {rows}.")
    if not one_row_s or len(one_row_s) != len(batch_s):
        raise ValueError(f"Row cost needs equal, non-empty lists of timings ({len(one_row_s)} and {len(batch_s)}).")
    if not all(t > 0 for t in (*one_row_s, *batch_s)):
        raise ValueError("Row cost needs positive step times.")
    ratios = sorted(b / a for a, b in zip(one_row_s, batch_s))
    mid = len(ratios) // 2
    ratio = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return round(min(1.0, max(0.0, (ratio - 1.0) / (rows - 1))), 3)


def _scale(rho: Sequence[float], rows: int) -> list[float]:
    return [1.0 + r * (rows - 1) for r in rho]


def micro_batchings(users: int) -> list[tuple[int, int]]:
    """(P, b) pairs worth trying for `users` rows: P = ceil(K / b) for b = 1..K, most P first
    (per-request pipelining first: on ties it relies least on batching), each P with the fewest
    rows b that give it. There are at most 2·sqrt(K) distinct P; they are visited directly (the next
    b whose P is below p is ceil(K / (p - 1))), so a declared concurrency of 10^8 plans in
    milliseconds (b = 1..K took 36 s on the host's event loop, a new-user trial)."""
    out: list[tuple[int, int]] = []
    b = 1
    while b <= users:
        p = -(-users // b)
        out.append((p, b))
        if p == 1:
            break
        b = -(-users // (p - 1))
    return out


def predict(stage_s: Sequence[float], rho: Sequence[float], hop_s: float, users: int) -> Throughput:
    """T(users) of a division with these stage times (module docstring).

    Args:
        stage_s: one-row stage time of each active member, ring order.
        rho: batch_row_cost of each (same order). hop_s: H. users: K >= 1.
    Returns:
        the Throughput at the best P (ties: the most micro-batches).
    """
    best: Optional[Throughput] = None
    for p, b in micro_batchings(users):
        t = [s * g for s, g in zip(stage_s, _scale(rho, b))]
        circ = sum(t) + hop_s
        bn = max(t)
        rnd = max(circ, p * bn)
        if best is None or rnd < best.round_s:
            best = Throughput(users=users, tokens_per_s=(users / rnd if rnd > 0 else INF), round_s=rnd,
                              micro_batches=p, rows=b, circuit_s=circ, bottleneck_s=bn,
                              bound="circuit" if circ >= p * bn else "bottleneck")
    assert best is not None
    return best


def cost_rows(n: int, cost: Callable[[int, int], float], fits: Optional[Callable[[int, int], bool]]) -> list[list[float]]:
    """rows[a][i] = cost(a, a + 1 + i) for every fitting end b <= n (fits is monotone in b).

    One member in one role (head or not) has the same rows in every chain it joins, so the load
    search computes them once per member and role and slices them per chain (`_tables`).
    """
    rows: list[list[float]] = []
    for a in range(n):
        out: list[float] = []
        for b in range(a + 1, n + 1):
            if fits is not None and not fits(a, b):
                break
            out.append(cost(a, b))
        rows.append(out)
    return rows


def _tables(n: int, k: int, cost: CostFn, fits: Optional[FitsFn],
            rows: Optional[Sequence[list[list[float]]]] = None) -> list[list[list[float]]]:
    """tab[j][a][i] = cost(j, a, a + 1 + i) for the fitting ends b <= n - (k - 1 - j), from
    `rows` (cost_rows of each chain member in its role) when given."""
    tab = []
    for j in range(k):
        cap = n - (k - 1 - j)
        if rows is not None:
            tab.append([[] if a < j or a >= cap else rows[j][a][:cap - a] for a in range(n)])
            continue
        member = cost_rows(cap, lambda a, b, j=j: cost(j, a, b),
                           None if fits is None else (lambda a, b, j=j: fits(j, a, b)))
        tab.append([member[a] if j <= a < cap else [] for a in range(n)])
    return tab


def _min_sum(tab, n: int, k: int, g: Sequence[float], bound: float) -> Optional[tuple[float, list[int]]]:
    """The least Σ g_j·cost over divisions with every g_j·cost <= bound: (sum, bounds) or None.

    DP over (member, end), O(k·n²); ties go to the first found (earlier members take fewer blocks).
    """
    best = [INF] * (n + 1)
    best[0] = 0.0
    parents = []
    for j in range(k):
        nxt = [INF] * (n + 1)
        par = [-1] * (n + 1)
        gj = g[j]
        for a, costs in enumerate(tab[j]):
            ba = best[a]
            if ba == INF:
                continue
            for i, c in enumerate(costs):
                c = c * gj
                if c > bound:
                    break  # non-decreasing in b
                v = ba + c
                e = a + 1 + i
                if v < nxt[e]:
                    nxt[e] = v
                    par[e] = a
        parents.append(par)
        best = nxt
    if best[n] == INF:
        return None
    bounds = [n]
    for par in reversed(parents):
        bounds.append(par[bounds[-1]])
    bounds.reverse()
    return best[n], bounds


def _feasible(tab, n: int, k: int, g: Sequence[float], bound: float) -> bool:
    """Whether some division keeps every g_j·cost <= bound: the reachable-boundary pass of
    kafilad.planner.partition, O(k·n·log n) (each row is non-decreasing: bisect its prefix)."""
    reach = [False] * (n + 1)
    reach[0] = True
    for j in range(k):
        gj = g[j]
        diff = [0] * (n + 2)
        for a, costs in enumerate(tab[j]):
            if not reach[a] or not costs:
                continue
            m = bisect.bisect_right(costs, bound, key=lambda c: c * gj)
            if m:
                diff[a + 1] += 1
                diff[a + 1 + m] -= 1
        run = 0
        for e in range(n + 1):
            run += diff[e]
            reach[e] = run > 0
    return reach[n]


def _scaled_stage(tab, g: Sequence[float], bounds: Sequence[int]) -> list[float]:
    return [tab[j][bounds[j]][bounds[j + 1] - bounds[j] - 1] * g[j] for j in range(len(g))]


def _min_round(tab, n: int, k: int, g: Sequence[float], p: int, hop_s: float, free: tuple[float, list[int]],
               cutoff: float = INF) -> Optional[tuple[float, list[int]]]:
    """min over divisions of max(Σ g·t + H, p · max g·t): (round, bounds), or None when the
    optimum cannot be below `cutoff` (then the search is skipped). `free` is the unbounded
    min-sum division (_min_sum with bound INF)."""

    def rnd(bounds):
        t = _scaled_stage(tab, g, bounds)
        return max(sum(t) + hop_s, p * max(t))

    best = (rnd(free[1]), free[1])
    if p == 1 or best[0] <= free[0] + hop_s:
        return best  # the circuit binds at the least circuit: nothing is lower
    hi_val = max(_scaled_stage(tab, g, free[1]))
    cands = sorted({c * g[j] for j in range(k) for row in tab[j] for c in row if c * g[j] <= hi_val})
    # least feasible bottleneck: first candidate with a division (bisection on feasibility)
    lo, hi = 0, len(cands) - 1  # cands[hi] == hi_val is feasible (the free division)
    while lo < hi:
        mid = (lo + hi) // 2
        if _feasible(tab, n, k, g, cands[mid]):
            hi = mid
        else:
            lo = mid + 1
    first = lo
    if max(free[0] + hop_s, p * cands[first]) >= min(best[0], cutoff):
        return best if best[0] < cutoff else None  # the lower bound already loses
    # crossing: the first i with p·c_i >= minsum(c_i) + H (monotone predicate)
    lo, hi = first, len(cands) - 1
    memo: dict[int, tuple[float, list[int]]] = {}

    def ms(i):
        if i not in memo:
            memo[i] = _min_sum(tab, n, k, g, cands[i])  # type: ignore[assignment]
        return memo[i]

    if p * cands[hi] < ms(hi)[0] + hop_s:
        lo = hi + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if p * cands[mid] >= ms(mid)[0] + hop_s:
            hi = mid
        else:
            lo = mid + 1
    for i in (lo - 1, lo):
        if first <= i < len(cands):
            r = rnd(ms(i)[1])
            if r < best[0]:
                best = (r, ms(i)[1])
    return best


def solve_chain_load(n: int, k: int, cost: CostFn, fits: Optional[FitsFn], rho: Sequence[float],
                     hop_s: float, users: int, cutoff: float = INF,
                     rows: Optional[Sequence[list[list[float]]]] = None) -> Optional[tuple[float, list[int]]]:
    """The division of n blocks over a chain of k members that maximises T(users).

    Args:
        n, k: blocks and chain members (member 0 is the head).
        cost: one-row stage_s(j, a, b); fits: whether member j can hold [a, b).
        rho: batch_row_cost per chain member. hop_s: H of this ring. users: K.
        cutoff: seconds per token (round / K) the caller already has; divisions that cannot beat
            it are not searched (None is returned for them).
        rows: optional precomputed cost_rows of each chain member in its role (equal to `cost`
            and `fits`; a speed-up only).
    Returns:
        (seconds per token = round / K at the best P, bounds [0, ..., n]), or None when nothing
        fits (or nothing beats `cutoff`).
    """
    if k <= 0 or n < k:
        return None
    tab = _tables(n, k, cost, fits, rows)
    # a lower bound on round(P) for every P first: max(least circuit, P · a bound on the least
    # bottleneck: the mean stage of that division, or each member's cheapest single block)
    todo = []
    for p, b in micro_batchings(users):
        g = _scale(rho, b)
        free = _min_sum(tab, n, k, g, INF)
        if free is None:
            return None  # memory does not depend on P: nothing fits at all
        single = max(min(row[0] for row in tab[j] if row) * g[j] for j in range(k))
        todo.append((max(free[0] + hop_s, p * max(free[0] / k, single)), p, g, free))
    todo.sort(key=lambda e: e[0])  # stable: most micro-batches first among equal bounds
    best: Optional[tuple[float, list[int]]] = None
    for lb, p, g, free in todo:
        lim = min(cutoff, best[0] if best else INF) * users
        if lb >= lim:
            break  # neither this P nor any later one can do better
        sol = _min_round(tab, n, k, g, p, hop_s, free, lim)
        if sol is not None and (best is None or sol[0] / users < best[0]) and sol[0] / users < cutoff:
            best = (sol[0] / users, sol[1])
    return best


def seconds_per_token(t: Throughput) -> float:
    """1 / T(K) (inf for a zero rate)."""
    return t.round_s / t.users if t.tokens_per_s > 0 else math.inf
