"""Baseline divisions for reports and benchmarks (DESIGN §5.5).

Both give block counts in ring order with the head on the anchor (counts[0] starts at block 0);
kafilad.planner.plan evaluates them with the same cost model as Kafila's division.

- uniform (GPipe-style): equal counts, the remainder one each to the first members.
- memory-proportional (exo-style): shares ∝ memory_bytes, largest-remainder rounding, then
  every member raised to at least one block by taking from the member with the most blocks
  (largest share first on ties), so no count is ever zero or negative.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence

from kafilad.errors import PlanError


def _check(n: int, m: int) -> None:
    if m <= 0:
        raise PlanError("The fleet has no devices; list at least one.")
    if n < m:
        raise PlanError(
            f"The model has {n} blocks but the fleet has {m} devices; every member must hold at "
            f"least one block, so remove {m - n} device(s) or choose a deeper model.")


def uniform_counts(n: int, m: int) -> list[int]:
    """Equal counts, remainder to the first members.

    Raises:
        PlanError: n < m.
    """
    _check(n, m)
    q, r = divmod(n, m)
    return [q + (1 if i < r else 0) for i in range(m)]


def memory_counts(n: int, memory_bytes: Sequence[int]) -> list[int]:
    """Counts ∝ memory with largest-remainder rounding and >= 1 each.

    Args:
        n: number of blocks.
        memory_bytes: per member, in ring order (head first).
    Returns:
        counts summing to n, each >= 1.
    Raises:
        PlanError: n < len(memory_bytes), or a non-positive memory.
    """
    m = len(memory_bytes)
    _check(n, m)
    if any(x <= 0 for x in memory_bytes):
        raise PlanError("Every device needs a positive memory_bytes for a memory-proportional division.")
    total = sum(int(x) for x in memory_bytes)
    quotas = [Fraction(n * int(x), total) for x in memory_bytes]  # exact: no float rounding
    counts = [int(q) for q in quotas]
    left = n - sum(counts)
    by_rem = sorted(range(m), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_rem[:left]:
        counts[i] += 1
    for i in range(m):
        while counts[i] < 1:
            donor = max(range(m), key=lambda k: (counts[k], quotas[k], -k))
            counts[donor] -= 1
            counts[i] += 1
    return counts


def bounds_of(counts: Sequence[int]) -> list[int]:
    """[0, c0, c0+c1, ..., n] from counts."""
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out
