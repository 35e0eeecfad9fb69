"""The CPUs a process may use: its affinity mask and its cgroup's CPU quota (no mlx here).

kafilad/executor/blas.py gives OpenBLAS that many threads (issue 12; docs/performance.md "2026-12-02").
"""

from __future__ import annotations

import os
from typing import Optional


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[float]:
    """CPUs this process's cgroup may use (its CFS quota ÷ period), or None when unlimited or unknown.

    cgroup v2: `cpu.max` ("max 100000" or "20000 100000"); v1: `cpu.cfs_quota_us` (-1 unlimited) and
    `cpu.cfs_period_us`, at the process's own group as `proc_cgroup` (proc(5) /proc/pid/cgroup) names
    it under `root`.
    """
    try:
        lines = open(proc_cgroup).read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        try:
            if controllers == "":
                quota, period = open(f"{root}{path.rstrip('/')}/cpu.max").read().split()[:2]
                return None if quota == "max" else int(quota) / int(period)
            if "cpu" in controllers.split(","):
                base = f"{root}/{controllers}{path.rstrip('/')}"
                quota = int(open(f"{base}/cpu.cfs_quota_us").read())
                return None if quota < 0 else quota / int(open(f"{base}/cpu.cfs_period_us").read())
        except (OSError, ValueError):
            continue
    return None


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (os.sched_getaffinity, else os.cpu_count),
    capped by its cgroup's CPU quota rounded down; at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        n = min(n, int(limit))
    return max(1, n)
