"""`kafila-ctl schedule`'s line (kafila_ctl/cli.py `schedule_line`). A new user's trial: `schedule
lockstep` answered "decode schedule: 1 (1 micro-batch in flight now)": the daemon reports lockstep as
a pinned 1. The line names the mode as the user typed it; shown without one, the daemon's mode."""

import pytest

from kafila_ctl.cli import schedule_line


@pytest.mark.parametrize("typed, result, line", [
    ("lockstep", {"mode": 1, "micro_batches": 1}, "decode schedule: lockstep (1 micro-batch in flight now)"),
    ("auto", {"mode": "auto", "micro_batches": 3}, "decode schedule: auto (3 micro-batches in flight now)"),
    ("per-request", {"mode": "per-request", "micro_batches": 1},
     "decode schedule: per-request (every request decodes in its own passes)"),
    ("2", {"mode": 2, "micro_batches": 2}, "decode schedule: 2 micro-batches pinned (2 micro-batches in flight now)"),
    ("1", {"mode": 1, "micro_batches": 1}, "decode schedule: 1 micro-batch pinned (1 micro-batch in flight now)"),
    (None, {"mode": 1, "micro_batches": 1}, "decode schedule: lockstep (1 micro-batch in flight now)"),
    (None, {"mode": "auto", "micro_batches": 2}, "decode schedule: auto (2 micro-batches in flight now)"),
])
def test_the_schedule_is_named_as_typed(typed, result, line):
    assert schedule_line(result, typed) == line
