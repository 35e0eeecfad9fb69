"""Exact chain-on-chain partition and the rotation rule (DESIGN §5.3).

Problem: split blocks 0..n-1 into m contiguous, non-empty ranges, range j on chain device j
(device 0 is the head), each within the device's memory, minimising the largest stage cost.

Method (DESIGN §5.3): the optimal bottleneck is one of the candidate values cost(j, a, b);
sort them and binary-search the smallest one for which a division exists.

Feasibility of a bound B. DESIGN §5.3 describes a left-to-right greedy that gives each device
the most blocks it can take. With heterogeneous devices and the rule that every device holds
at least one block, that greedy is *not* exact: blocks [1, 1, 100, 1] on speeds 100/1/100 admit
(1, 1, 2) with bottleneck 1.01, but at B = 1.01 the greedy gives the fast head two blocks and
leaves the slow device only the 100-byte block. We therefore track the *set* of reachable
boundaries: R_0 = {0}; R_{j+1} = ∪_{a ∈ R_j} [a + 1, hi_j(a)], where hi_j(a) is the largest end
b with cost(j, a, b) <= B and the range fitting in memory (found by bisection, both are
monotone in b). B is feasible iff n ∈ R_m. Cost per probe O(m·n·log n); overall
O(m·n² log(m·n²)) for the candidate sort, trivial for sessions (m <= ~10, n <= ~128).

Among the divisions reaching the optimal bottleneck, the one with the least Σ stage cost
(the shortest circuit, DESIGN §5.1) is returned: a DP over (device, end) bounded by B*,
O(m·n²). It lowers single-request latency at no cost to the pipelined rate.

Rotation rule: solve every rotation exactly; keep the anchor's (rotation 0) unless the best
rotation lowers the bottleneck by more than μ relatively: (B_0 - B_best) / B_0 > μ.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

CostFn = Callable[[int, int, int], float]
FitsFn = Callable[[int, int, int], bool]


def _hi(j: int, a: int, cap: int, bound: float, cost: CostFn, fits: Optional[FitsFn]) -> int:
    """Largest b in [a+1, cap] with cost(j,a,b) <= bound and fits(j,a,b); a if none."""
    lo, hi = a, cap  # invariant: b <= lo is OK (lo == a means "none yet"), b > hi is not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(j, a, mid) <= bound and (fits is None or fits(j, a, mid)):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _feasible(n: int, m: int, bound: float, cost: CostFn, fits: Optional[FitsFn]) -> bool:
    """Whether some division keeps every stage <= bound and fits (reachable-set pass)."""
    reach = [False] * (n + 1)
    reach[0] = True
    for j in range(m):
        cap = n - (m - 1 - j)  # leave >= 1 block for each later device
        diff = [0] * (n + 2)
        for a in range(n):
            if not reach[a] or a + 1 > cap:
                continue
            hi = _hi(j, a, cap, bound, cost, fits)
            if hi >= a + 1:
                diff[a + 1] += 1
                diff[hi + 1] -= 1
        run = 0
        for b in range(n + 1):
            run += diff[b]
            reach[b] = run > 0
    return reach[n]


def _min_sum(n: int, m: int, bound: float, cost: CostFn, fits: Optional[FitsFn]) -> Optional[list[int]]:
    """Among divisions with every stage <= bound (and fitting), one with the least Σ cost.

    DP over (device, end): O(m·n²) cost evaluations. Ties go to the first found (earlier
    devices take fewer blocks), so the result is deterministic.
    """
    inf = float("inf")
    best = [inf] * (n + 1)
    best[0] = 0.0
    parents: list[list[int]] = []
    for j in range(m):
        cap = n - (m - 1 - j)
        nxt = [inf] * (n + 1)
        par = [-1] * (n + 1)
        for a in range(j, cap):
            if best[a] == inf:
                continue
            for b in range(a + 1, cap + 1):
                c = cost(j, a, b)
                if c > bound or (fits is not None and not fits(j, a, b)):
                    break  # both monotone in b
                if best[a] + c < nxt[b]:
                    nxt[b] = best[a] + c
                    par[b] = a
        parents.append(par)
        best = nxt
    if best[n] == inf:
        return None
    bounds = [n]
    for par in reversed(parents):
        bounds.append(par[bounds[-1]])
    bounds.reverse()
    return bounds


def solve_chain(n: int, m: int, cost: CostFn, fits: Optional[FitsFn] = None) -> Optional[tuple[float, list[int]]]:
    """Minimise max_j cost(j, b_j, b_{j+1}) over contiguous divisions with >= 1 block each.

    Args:
        n: number of blocks.
        m: number of chain devices (device 0 is the head).
        cost: cost(j, a, b) of device j holding [a, b); non-decreasing in b, non-increasing in a.
        fits: optional fits(j, a, b); monotone (true for small ranges, false past a point).
    Returns:
        (bottleneck, bounds) — the least bottleneck and, among divisions reaching it, one with
        the least Σ cost — with bounds = [0, b_1, ..., b_{m-1}, n], device j holding
        [bounds[j], bounds[j+1]); or None when n < m or no division fits.
    """
    if m <= 0 or n < m:
        return None
    cands = set()
    for j in range(m):
        for a in range(j, n - (m - j) + 1):
            for b in range(a + 1, n - (m - 1 - j) + 1):
                if fits is not None and not fits(j, a, b):
                    break
                cands.add(cost(j, a, b))
    if not cands:
        return None
    order = sorted(cands)
    if not _feasible(n, m, order[-1], cost, fits):
        return None
    lo, hi = 0, len(order) - 1  # order[hi] is feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if _feasible(n, m, order[mid], cost, fits):
            hi = mid
        else:
            lo = mid + 1
    bounds = _min_sum(n, m, order[lo], cost, fits)
    assert bounds is not None
    return max(cost(j, bounds[j], bounds[j + 1]) for j in range(m)), bounds


def rotate(seq: Sequence, r: int) -> list:
    """Rotation r of (d0 .. dm-1): (dr, dr+1, ..., dr-1) (DESIGN §5.3)."""
    seq = list(seq)
    return seq[r:] + seq[:r]


def choose_rotation(bottlenecks: Sequence[Optional[float]], mu: float) -> Optional[int]:
    """The μ rule of DESIGN §5.3.

    Args:
        bottlenecks: best bottleneck per rotation (index 0 = anchor as head), None = infeasible.
        mu: relative improvement a rotation must exceed to displace the anchor (0.05).
    Returns:
        the chosen rotation index (the anchor unless (B_0 - B_best) / B_0 > mu; the lowest
        index among equal best), or None when no rotation is feasible.
    """
    feasible = [(b, r) for r, b in enumerate(bottlenecks) if b is not None]
    if not feasible:
        return None
    best_b, best_r = min(feasible)
    b0 = bottlenecks[0]
    if b0 is None:
        return best_r
    if b0 > 0 and (b0 - best_b) / b0 > mu:
        return best_r
    return 0
