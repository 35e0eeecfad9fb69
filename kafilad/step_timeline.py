"""Per-token timeline of the ring, for measuring where a decode step's milliseconds go (issue 12).

Off by default. With `KAFILA_STEP_TIMELINE=<dir>` in a daemon's environment, every `mark(kind)`
appends (time.perf_counter(), kind) to this process's list, and `flush()` (the ring calls it
when a request ends) writes the list to `<dir>/<pid>.jsonl`, one `[t_s, kind]` per line, and
clears it. `time.perf_counter` is CLOCK_MONOTONIC on Linux, one clock for every process of the
machine, so the files of the daemons of a loopback ring merge into one timeline
(scripts/bench_ring.py `--timeline`). Disabled, `mark` costs one attribute test.

Kinds written by the ring (kafilad/node/serving/ring.py) and the HTTP layer (kafilad/control/api_common.py):
`rx` a frame was read from a link (before the inbox), `on_act` the ring loop took it, `c0`/`c1`
an MLX call began/ended on the MLX thread, `back` trio resumed after it, `sent` the next link's
send returned, `emit` the head queued a token event, `sse` the HTTP layer wrote its payload.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

#: environment switch: a directory for the per-process timeline files (unset: off)
TIMELINE_ENV = "KAFILA_STEP_TIMELINE"


class StepTimeline:
    """A list of (t_s, kind) marks of this process, written out by `flush`.

    Args:
        out_dir: where `flush` writes `<pid>.jsonl`; None disables every mark.
    """

    def __init__(self, out_dir: Optional[str]):
        self.out_dir = Path(out_dir) if out_dir else None
        self.enabled = self.out_dir is not None
        self.marks: list[tuple[float, str]] = []

    def mark(self, kind: str) -> None:
        """Record `kind` at time.perf_counter() (nothing when disabled)."""
        if self.enabled:
            self.marks.append((time.perf_counter(), kind))

    def flush(self) -> None:
        """Append the marks to `<out_dir>/<pid>.jsonl` and forget them (nothing when disabled)."""
        if not self.enabled or not self.marks:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / f"{os.getpid()}.jsonl", "a") as f:
            f.writelines(json.dumps([t, k]) + "\n" for t, k in self.marks)
        self.marks.clear()


#: this process's timeline (the ring and the HTTP layer mark it)
TIMELINE = StepTimeline(os.environ.get(TIMELINE_ENV) or None)


def read_timeline(out_dir: str | Path) -> list[tuple[float, str, int]]:
    """Every mark of every process's file in `out_dir`, as (t_s, kind, pid), in time order."""
    out = []
    for p in Path(out_dir).glob("*.jsonl"):
        pid = int(p.stem)
        for line in p.read_text().splitlines():
            if line.strip():
                t, k = json.loads(line)
                out.append((float(t), str(k), pid))
    out.sort()
    return out
