"""The head's decode schedule settings: the environment switches (`KAFILA_BATCH`,
`KAFILA_MICRO_BATCHES`, `KAFILA_SWITCH_INTERVAL_MS`) and the modes `kafila-ctl schedule` sets
(`parse_schedule`, `apply_schedule`); read by the daemon, the session drivers and the ring.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

#: environment switch: "0" decodes every request in its own passes (no batching).
BATCH_ENV = "KAFILA_BATCH"
#: environment switch: pin the decode micro-batches in flight (kafilad/proto/step_policy.py)
MICRO_BATCHES_ENV = "KAFILA_MICRO_BATCHES"

def _env_value(environ, name: str, parse: Callable[[str], float], valid: Callable[[float], bool], must: str):
    """`environ[name]` parsed, None when unset or blank.

    Raises:
        ValueError: a value `parse` refuses or `valid` rejects ("<name> must be <must>, not '<raw>'.").
    """
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or not valid(value):
        raise ValueError(f"{name} must be {must}, not {raw!r}.")
    return value


def pinned_micro_batches(environ=os.environ) -> Optional[int]:
    """`KAFILA_MICRO_BATCHES=N` pins the decode micro-batches in flight (N ≥ 1); unset: chosen from
    measured stage times (kafilad/proto/step_policy.py).

    Raises:
        ValueError: a value that is not a positive integer (the daemon refuses to start with it).
    """
    return _env_value(environ, MICRO_BATCHES_ENV, int, lambda n: n >= 1, "a positive integer")


#: environment switch: the daemon process's GIL switch interval, in milliseconds
SWITCH_INTERVAL_ENV = "KAFILA_SWITCH_INTERVAL_MS"
#: the daemon's GIL switch interval when the environment does not say (s); None keeps Python's 5 ms
DAEMON_SWITCH_INTERVAL_S: Optional[float] = None


def daemon_switch_interval_s(environ=os.environ) -> Optional[float]:
    """The GIL switch interval a daemon process sets (`sys.setswitchinterval`), in seconds.

    A daemon runs its trio thread (links, QUIC, Noise) beside one MLX worker thread; with Python's
    5 ms interval a thread wanting the GIL may wait up to 5 ms while the other runs Python code.
    Only the daemon's own entry point (kafilad/main.py) sets it: a process with many threads (the
    in-process session tests) ran 2-5x slower with 0.2 ms. `KAFILA_SWITCH_INTERVAL_MS=X` (X > 0)
    sets X ms; unset: DAEMON_SWITCH_INTERVAL_S.

    Raises:
        ValueError: a value that is not a positive number (the daemon refuses to start with it).
    """
    ms = _env_value(environ, SWITCH_INTERVAL_ENV, float, lambda x: 0 < x <= 1000,
                    "a number of milliseconds in (0, 1000]")
    return DAEMON_SWITCH_INTERVAL_S if ms is None else ms / 1e3


#: schedule modes of `apply_schedule` (the control API's `schedule` op): besides these, an integer M ≥ 1
SCHEDULE_MODES = ("auto", "lockstep", "per-request")


def parse_schedule(mode) -> object:
    """A schedule mode as `apply_schedule` takes it: "auto", "lockstep", "per-request" or an int M ≥ 1
    (also given as a string of digits).

    Raises:
        ValueError: anything else, with a sentence.
    """
    if isinstance(mode, str) and mode.strip().lstrip("+-").isdigit():
        mode = int(mode.strip())
    if isinstance(mode, int) and not isinstance(mode, bool):
        if mode < 1:
            raise ValueError(f"A schedule of {mode} micro-batches is not possible; give 1 or more.")
        return mode
    if mode in SCHEDULE_MODES:
        return mode
    raise ValueError(f"Unknown schedule {mode!r}; give auto, lockstep, per-request or a number of micro-batches.")


def apply_schedule(scheduler, mode) -> None:
    """Set the head's decode schedule (kafilad/proto/scheduler.py, step_policy.py): "auto" (micro-batches
    chosen from measured stage times, the default), "lockstep" (M = 1), "per-request" (every request
    its own passes, as `KAFILA_BATCH=0`) or an int M (pinned, as `KAFILA_MICRO_BATCHES=M`).

    Raises:
        ValueError: a bad mode (parse_schedule), or requests running (the schedule changes between requests).
    """
    mode = parse_schedule(mode)
    if scheduler.requests:
        raise ValueError(f"The schedule changes between requests; {len(scheduler.requests)} are running now.")
    policy = scheduler.policy
    scheduler.batching = mode != "per-request"
    policy.pinned = {"auto": None, "lockstep": 1, "per-request": None}.get(mode, mode)
    policy.current = policy.pinned or 1
    policy.trials.clear()


def batching_enabled(environ=os.environ) -> bool:
    """Whether decode steps are batched (the default) or per request (`KAFILA_BATCH=0`)."""
    return environ.get(BATCH_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def schedule_result(scheduler) -> dict:
    """The `schedule` op's answer for a head's scheduler: {"mode": "auto" | "per-request" | M pinned,
    plus the step policy's snapshot (micro_batches in flight, ...)}."""
    mode = "per-request" if not scheduler.batching else ("auto" if scheduler.policy.pinned is None
                                                         else scheduler.policy.pinned)
    return {"mode": mode, **scheduler.policy.snapshot()}
