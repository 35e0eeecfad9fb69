"""The fleet file (proto_spec/06-fleet.md §1): what `kafila-ctl plan --fleet` reads and what
`status --json` reports as the live session's `fleet`.

```
{
  "devices": [                                   anchor (host) first
    {"name": "studio", "memory_bytes": 144000000000,          required
     "bandwidth_Bps": 8.0e11, "flops_per_s": 2.7e13,          optional measurements
     "step_overhead_s": 0.0, "nat_class": "O",                optional
     "rendezvous_rtt_ms": 12.5, "batch_row_cost": 0.3,
     "dtype": "float32", "fallback_dtype": "bfloat16", ...}   unknown keys ignored
  ],
  "context": 4096, "concurrency": 1,                          optional (flags win)
  "heads": ["studio"],                                         optional: who may be the head (absent: any)
  "edges": [{"from": "studio", "to": "pc", "rtt_ms": 41.0}]   optional: measured round trips
}
```
Pure: `load_fleet` reads a file only when given a path.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import attrs

from kafilad.errors import KafilaError
from kafilad.planner.precision import DTYPE_BYTES
from kafilad.planner.records import Device

NAT_CLASSES = ("O", "C", "S", "UNKNOWN")  # unknown: no STUN answer; its edges are checked (DESIGN §3)


class FleetFormatError(KafilaError):
    """A fleet file is missing, not JSON, or holds a malformed device (proto_spec/06-fleet.md)."""


@attrs.frozen
class Fleet:
    """A parsed fleet file.

    Attributes:
        devices: the devices, anchor first.
        context: top-level context (tokens) or None when absent.
        concurrency: top-level concurrency or None when absent.
        name: optional display name of the fleet ("" when absent).
        heads: names of the devices that may be the head (a live session's host and the members
            whose reports measurement confirmed, issue 22 item 5), or None: any.
        rtt_ms: measured round trips of device pairs, {(from, to): ms} (a live session's ring
            edges, proto_spec/06-fleet.md §1 `edges`), for `plan(measured_rtt_ms=...)`; empty when
            none were given.
    """

    devices: tuple
    context: Optional[int] = None
    concurrency: Optional[int] = None
    name: str = ""
    heads: Optional[tuple] = None
    rtt_ms: dict = attrs.field(factory=dict)


def _num(d: dict, key: str, where: str, *, integer: bool = False, positive: bool = True,
         optional: bool = True) -> Any:
    if key not in d or d[key] is None:
        if optional:
            return None
        raise FleetFormatError(f"{where} lacks '{key}'.")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise FleetFormatError(f"{where}: '{key}' must be a number, not {v!r}.")
    if integer:
        if isinstance(v, float) and not v.is_integer():
            raise FleetFormatError(f"{where}: '{key}' must be a whole number, not {v!r}.")
        v = int(v)
    if positive and v <= 0:
        raise FleetFormatError(f"{where}: '{key}' must be positive, not {v!r}.")
    if not positive and v < 0:
        raise FleetFormatError(f"{where}: '{key}' must not be negative, not {v!r}.")
    return v


def _device(obj: Any, i: int) -> Device:
    where = f"Fleet device #{i}"
    if not isinstance(obj, dict):
        raise FleetFormatError(f"{where} must be a JSON object, not {type(obj).__name__}.")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise FleetFormatError(f"{where} needs a non-empty string 'name'.")
    where = f"Fleet device {name!r}"
    nat = obj.get("nat_class")
    if nat is not None and (not isinstance(nat, str) or nat.upper() not in NAT_CLASSES):
        raise FleetFormatError(f"{where}: 'nat_class' must be one of O, C, S or unknown, not {nat!r}.")
    ov = _num(obj, "step_overhead_s", where, positive=False)
    dtypes = {}
    for key in ("dtype", "fallback_dtype"):
        v = obj.get(key)
        if v is not None and v not in DTYPE_BYTES:
            raise FleetFormatError(f"{where}: '{key}' must be one of {', '.join(DTYPE_BYTES)}, not {v!r}.")
        dtypes[key] = v
    return Device(
        name=name,
        memory_bytes=_num(obj, "memory_bytes", where, integer=True, optional=False),
        bandwidth_Bps=_num(obj, "bandwidth_Bps", where),
        flops_per_s=_num(obj, "flops_per_s", where),
        step_overhead_s=float(ov) if ov is not None else 0.0,
        nat_class=None if nat is None else ("unknown" if nat.upper() == "UNKNOWN" else nat.upper()),
        rendezvous_rtt_ms=_num(obj, "rendezvous_rtt_ms", where, positive=False),
        batch_row_cost=_num(obj, "batch_row_cost", where, positive=False),
        **dtypes,
    )


def load_fleet(obj_or_path: Any) -> Fleet:
    """Parse a fleet (proto_spec/06-fleet.md §1) from a dict, a JSON string's path, or a Path.

    Args:
        obj_or_path: a parsed JSON object, or a str/Path naming a fleet file.
    Returns:
        the Fleet.
    Raises:
        FleetFormatError: unreadable file, invalid JSON, no devices, duplicate names, or a
            device with a missing or malformed field (the message names the device and field).
    """
    if isinstance(obj_or_path, (str, Path)):
        path = Path(obj_or_path)
        try:
            obj = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise FleetFormatError(f"Fleet file {path} does not exist.") from e
        except OSError as e:
            raise FleetFormatError(f"Cannot read fleet file {path}: {e.strerror}.") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise FleetFormatError(f"Fleet file {path} is not valid JSON ({e}).") from e
    else:
        obj = obj_or_path
    if not isinstance(obj, dict) or not isinstance(obj.get("devices"), list) or not obj["devices"]:
        raise FleetFormatError("A fleet must be a JSON object whose 'devices' is a non-empty list.")
    devices = tuple(_device(d, i) for i, d in enumerate(obj["devices"]))
    names = [d.name for d in devices]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise FleetFormatError(f"Fleet device names must be unique; {', '.join(map(repr, dup))} repeats.")
    ctx = _num(obj, "context", "The fleet", integer=True)
    conc = _num(obj, "concurrency", "The fleet", integer=True)
    name = obj.get("name") if isinstance(obj.get("name"), str) else ""
    heads = obj.get("heads")
    if heads is not None:
        if not isinstance(heads, list) or not heads or not all(isinstance(h, str) and h in names for h in heads):
            raise FleetFormatError("The fleet's 'heads' must be a non-empty list of its device names.")
        heads = tuple(heads)
    return Fleet(devices=devices, context=ctx, concurrency=conc, name=name, heads=heads,
                 rtt_ms=_edges(obj.get("edges"), set(names)))


def _edges(obj: Any, names: set) -> dict:
    """The fleet's measured round trips, {(from, to): rtt_ms}, from its `edges` list (§1)."""
    if obj is None:
        return {}
    if not isinstance(obj, list):
        raise FleetFormatError("The fleet's 'edges' must be a list of {from, to, rtt_ms} objects.")
    out = {}
    for i, e in enumerate(obj):
        where = f"Fleet edge #{i}"
        if not isinstance(e, dict) or e.get("from") not in names or e.get("to") not in names \
                or e.get("from") == e.get("to"):
            raise FleetFormatError(f"{where} must be an object whose 'from' and 'to' are two of the fleet's device names.")
        out[e["from"], e["to"]] = float(_num(e, "rtt_ms", where, positive=False, optional=False))
    return out


def fleet_to_json(devices: Sequence[Device], context: Optional[int] = None,
                  concurrency: Optional[int] = None, heads: Optional[Sequence[str]] = None,
                  rtt_ms: Optional[dict] = None) -> dict:
    """The fleet object of proto_spec/06-fleet.md §1 for `devices` (anchor first); `heads`: the
    names that may be the head (None: any, omitted); `rtt_ms`: measured round trips,
    {(from, to): ms} (omitted when empty).

    Optional fields that are unknown (None) are omitted, and step_overhead_s when 0, so that
    load_fleet(fleet_to_json(ds)) == ds. Used by `status --json` for the live session.
    """
    out: dict = {"devices": []}
    for d in devices:
        e: dict = {"name": d.name, "memory_bytes": int(d.memory_bytes)}
        if d.bandwidth_Bps is not None:
            e["bandwidth_Bps"] = d.bandwidth_Bps
        if d.flops_per_s is not None:
            e["flops_per_s"] = d.flops_per_s
        if d.step_overhead_s:
            e["step_overhead_s"] = d.step_overhead_s
        if d.nat_class is not None:
            e["nat_class"] = d.nat_class
        if d.rendezvous_rtt_ms is not None:
            e["rendezvous_rtt_ms"] = d.rendezvous_rtt_ms
        if d.batch_row_cost is not None:
            e["batch_row_cost"] = d.batch_row_cost
        if d.dtype is not None:
            e["dtype"] = d.dtype
        if d.fallback_dtype is not None:
            e["fallback_dtype"] = d.fallback_dtype
        out["devices"].append(e)
    if context is not None:
        out["context"] = int(context)
    if concurrency is not None:
        out["concurrency"] = int(concurrency)
    if heads is not None:
        out["heads"] = [d.name for d in devices if d.name in set(heads)]
    if rtt_ms:
        out["edges"] = [{"from": a, "to": b, "rtt_ms": float(v)} for (a, b), v in sorted(rtt_ms.items())]
    return out
