"""Session trace: one JSON object per line (DESIGN §8).

Every record has "ts" (Unix seconds) and "event"; events written by the host:
session_opened, plan (predicted per-stage cost, fleet), session_formed (form_s, per-member load),
generation (prefill/ttft, decode tokens/s, circuit time, per-stage measured compute, ring bytes
per hop, path per edge), session_failed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class Trace:
    """Append-only JSONL writer."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields) -> None:
        rec = {"ts": time.time(), "event": event, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=_default) + "\n")

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
