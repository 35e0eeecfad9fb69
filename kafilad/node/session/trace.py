"""Session trace: one JSON object per line (DESIGN §8).

Every record has "ts" (Unix seconds) and "event"; events written by the host:
session_opened, plan (predicted per-stage cost, fleet), session_formed (form_s, per-member load),
generation (prefill/ttft, decode tokens/s, circuit time, per-stage measured compute, ring bytes
per hop, path per edge), session_failed.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

log = logging.getLogger("kafilad.trace")


class Trace:
    """Append-only JSONL writer. A record that cannot be written (a full disk) is dropped with one
    warning until writes work again: a trace never fails its session (issue 22 §6)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.failing = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._failed(e)

    def write(self, event: str, **fields) -> None:
        rec = {"ts": time.time(), "event": event, **fields}
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec, default=_default) + "\n")
        except OSError as e:
            self._failed(e)
            return
        if self.failing:
            log.info("the trace %s is written again", self.path)
            self.failing = False

    def _failed(self, e: OSError) -> None:
        if not self.failing:
            from kafilad.node.session.statedir import disk_advice
            log.warning("Could not write the trace %s: %s; its records are dropped until it can; %s", self.path,
                        e.strerror or e, disk_advice(e, self.path.parent))
        self.failing = True

    def read(self) -> list[dict]:
        try:
            return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return []


def _default(o):
    if isinstance(o, (bytes, bytearray)):
        return o.hex()
    if isinstance(o, tuple):
        return list(o)
    return str(o)
