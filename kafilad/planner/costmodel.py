"""Per-stage cost and resident bytes of a chain of devices (DESIGN §5.1, tiers of §5.4).

A *chain* is the ring cut at the head: device 0 of the chain is the head and holds blocks
from 0; device j holds the half-open range [a, b). All three tiers share one shape:

```
 stage_s(j, a, b) = step_overhead_s(j) + (work(a, b) + [j == 0] * head_work) / rate(j)

 tier         work per block              head_work             rate(j)
 cost-model   read_bytes                  head_read_bytes       bandwidth_Bps        (bytes/s)
 flops        block_flops_per_token       head_flops_per_token  flops_per_s          (FLOP/s)
 memory       block_bytes                 head_read_bytes       memory_bytes per 1 s (see below)
```

`read_bytes` is what one token reads of a block: all of a dense block's bytes; of a
mixture-of-experts block its attention, router and shared experts plus its routed experts'
bytes x experts per token / experts (kafilad.planner.moe; ModelProfile.read_bytes). Resident
bytes count every expert. The memory tier divides by resident bytes (exo's rule: shares in
proportion to memory), so it stays `block_bytes`.

The tier is the best one every device supports: all devices report `bandwidth_Bps` → the cost
model; else all report `flops_per_s` (and the profile carries FLOP counts) → raw arithmetic
throughput; else the working-set tier. In the working-set tier nothing about speed is known, so
a device is assumed to read its whole `memory_bytes` once per second: stage_s is then the
fraction of the device's memory its stage reads per token (plus any step overhead), i.e. a
*dimensionless working-set share expressed in pseudo-seconds*. Minimising its maximum divides
the model in proportion to memory (exo's rule) while still respecting the head's extra bytes,
and ratios between divisions remain meaningful; absolute values are not times.

Resident bytes (all tiers, DESIGN §5.1):

```
 resident(j, a, b) = Σ block_bytes[a:b] + (b - a) * kv_bytes_per_block_token * context * concurrency
                     + [j == 0] * head_resident_bytes
                     + working(j)                             must be <= memory_bytes(j)
```
working(j) is the prefill/decode working memory of kafilad.planner.workmem (0 when the profile
has no shape); it does not depend on [a, b), so resident bytes stay monotone in b.

Per-device precision (kafilad.planner.precision): given the model's profile per dtype, every
byte term of device j (block_bytes, head bytes, KV bytes and working memory) is that of the dtype
j holds [a, b) in: its own `dtype` when resident() in it fits, else its `fallback_dtype`. Its
stage time is always that of its own `dtype` (the one its bandwidth was timed in). `fits` is "some
dtype of j fits" and `overflow_bytes` the least shortfall over j's dtypes; both stay monotone.

Pure: no I/O. Cost is non-decreasing in b and non-increasing in a, which the exact partition
(kafilad.planner.partition) relies on.
"""

from __future__ import annotations

from typing import Optional, Sequence

from kafilad.errors import PlanError
from kafilad.planner import precision
from kafilad.planner.precision import Profiles
from kafilad.planner.records import Device, ModelProfile
from kafilad.planner.workmem import working_bytes

TIERS = ("cost-model", "flops", "memory")


def select_tier(devices: Sequence[Device], model: Profiles) -> str:
    """The best tier of DESIGN §5.4 every device supports.

    Returns:
        "cost-model" when every device has bandwidth_Bps; else "flops" when every device has
        flops_per_s and the profile has per-block FLOP counts; else "memory".
    """
    model = precision.reference(model)
    if devices and all(d.bandwidth_Bps for d in devices):
        return "cost-model"
    if devices and all(d.flops_per_s for d in devices) and len(model.block_flops_per_token) == model.n_blocks:
        return "flops"
    return "memory"


def check_devices(devices: Sequence[Device]) -> None:
    """Validate a fleet for planning.

    Raises:
        PlanError: no devices, duplicate names, or a non-positive memory, bandwidth or FLOP rate.
    """
    if not devices:
        raise PlanError("The fleet has no devices; list at least one.")
    seen: set[str] = set()
    for d in devices:
        if d.name in seen:
            raise PlanError(f"Device name {d.name!r} appears twice in the fleet; names must be unique.")
        seen.add(d.name)
        if d.memory_bytes <= 0:
            raise PlanError(f"Device {d.name!r} has memory_bytes {d.memory_bytes}; it must be positive.")
        for field in ("bandwidth_Bps", "flops_per_s"):
            v = getattr(d, field)
            if v is not None and v <= 0:
                raise PlanError(f"Device {d.name!r} has {field} {v}; it must be positive when given.")
        if d.batch_row_cost is not None and not d.batch_row_cost >= 0:
            raise PlanError(f"Device {d.name!r} has a negative batch_row_cost ({d.batch_row_cost}).")
        if d.step_overhead_s < 0:
            raise PlanError(f"Device {d.name!r} has a negative step_overhead_s ({d.step_overhead_s}).")
        for field in ("dtype", "fallback_dtype"):
            if getattr(d, field) is not None:
                precision.check_dtype(getattr(d, field), f"Device {d.name!r}'s {field}")


class _Holding:
    """Prefix sums of one profile: what a device holding its stage in one dtype is charged."""

    def __init__(self, dtype: Optional[str], model: ModelProfile, *, context: int, concurrency: int):
        self.dtype = dtype
        self.model = model
        self.bytes = [0]
        for x in model.block_bytes:
            self.bytes.append(self.bytes[-1] + int(x))
        self.kv_per_block = model.kv_bytes_per_block_token * int(context) * int(concurrency)
        self.working = working_bytes(model.shape, context=context, concurrency=concurrency, head=False)
        self.working_head = working_bytes(model.shape, context=context, concurrency=concurrency, head=True)

    def resident(self, head: bool, a: int, b: int) -> int:
        r = self.bytes[b] - self.bytes[a] + (b - a) * self.kv_per_block
        if head:
            return r + self.model.head_resident_bytes + self.working_head
        return r + self.working


class ChainCost:
    """Stage time and resident bytes of each device of one chain (head = chain[0]).

    Args:
        chain: devices in chain order, head first; length m.
        model: the model's byte profile (n blocks): one ModelProfile for every device, or one
            per dtype (kafilad.planner.precision `Profiles`), each device then counted in its own.
        context: tokens of context each request may reach.
        concurrency: concurrent requests.
        tier: one of TIERS (see the module docstring).

    Per-device precision (kafilad.planner.precision): device j's stage time is that of its
    preferred dtype (the one its bandwidth was measured in); its resident bytes are those of the
    dtype it holds [a, b) in (`dtype`): the preferred one when that fits, else its fallback. A
    fallback stage is costed at the preferred dtype's time: nothing timed the fallback, and on
    MLX's CPU backend (the one that falls back) a bf16 block runs no faster than an f32 one
    (DESIGN §6). So stage_s stays monotone, and `fits` (either dtype fits) and `overflow_bytes`
    (the smaller of the two shortfalls) are monotone too, as the partition needs.

    All block indices are half-open [a, b) with 0 <= a < b <= n.
    """

    def __init__(self, chain: Sequence[Device], model: Profiles, *, context: int,
                 concurrency: int, tier: str):
        if tier not in TIERS:
            raise PlanError(f"Unknown planner tier {tier!r}; expected one of {', '.join(TIERS)}.")
        self.chain = tuple(chain)
        self.model = precision.reference(model)
        self.tier = tier
        self.n = self.model.n_blocks
        self.m = len(self.chain)
        # integer prefix sums keep resident bytes exact; work prefix sums are floats only in
        # the flops tier, and every caller computes a cost through stage_s, so equal inputs
        # give bit-identical outputs (the exact search compares candidates with <=). Devices
        # holding the same dtype share one profile's sums.
        shared: dict = {}

        def holding(dtype, prof) -> _Holding:
            key = id(prof)
            if key not in shared:
                shared[key] = _Holding(dtype, prof, context=context, concurrency=concurrency)
            return shared[key]

        self._hold = [[holding(dt, prof) for dt, prof in precision.device_profiles(model, d)] for d in self.chain]
        works: dict = {}
        self._work, self._head_work, self._rate = [], [], []
        for d, opts in zip(self.chain, self._hold):
            prof = opts[0].model
            if tier == "flops":
                work, head_work, rate = prof.block_flops_per_token, float(prof.head_flops_per_token), d.flops_per_s
            else:
                if tier == "cost-model":
                    work, head_work, rate = prof.read_bytes, prof.head_read_bytes, d.bandwidth_Bps
                else:
                    work, head_work, rate = prof.block_bytes, prof.head_read_bytes, d.memory_bytes
            key = (id(prof), tier)
            if key not in works:
                prefix = [0]
                for x in work:
                    prefix.append(prefix[-1] + x)
                works[key] = prefix
            self._work.append(works[key])
            self._head_work.append(head_work)
            self._rate.append(float(rate))
        self._mem = [int(d.memory_bytes) for d in self.chain]
        self._ov = [float(d.step_overhead_s) for d in self.chain]

    def stage_s(self, j: int, a: int, b: int) -> float:
        """Predicted per-token time of chain device j holding blocks [a, b), seconds (tier units)."""
        work = self._work[j][b] - self._work[j][a]
        if j == 0:
            work = work + self._head_work[j]
        return self._ov[j] + work / self._rate[j]

    def _choice(self, j: int, a: int, b: int) -> _Holding:
        """The holding of chain device j for [a, b): precision.stage_dtype's rule."""
        opts = self._hold[j]
        if len(opts) == 1:
            return opts[0]
        first, fb = opts
        r0, r1 = first.resident(j == 0, a, b), fb.resident(j == 0, a, b)
        dt = precision.stage_dtype(first.dtype, fb.dtype, self._mem[j], {first.dtype: r0, fb.dtype: r1})
        return first if dt == first.dtype else fb

    def dtype(self, j: int, a: int, b: int) -> Optional[str]:
        """The dtype chain device j holds [a, b) in (None when one profile counts every device)."""
        return self._choice(j, a, b).dtype

    def resident_bytes(self, j: int, a: int, b: int) -> int:
        """Bytes chain device j needs for blocks [a, b) at the declared context and concurrency:
        weights, KV cache, head parts and working memory, in the dtype it holds them in."""
        return self._choice(j, a, b).resident(j == 0, a, b)

    def working_bytes(self, j: int, a: int = 0, b: Optional[int] = None) -> int:
        """The working-memory share of chain device j's resident bytes for [a, b) (by default its
        preferred dtype's; kafilad.planner.workmem)."""
        h = self._hold[j][0] if b is None else self._choice(j, a, b)
        return h.working_head if j == 0 else h.working

    def overflow_bytes(self, j: int, a: int, b: int) -> int:
        """The least resident bytes - memory_bytes (positive = shortfall) of chain device j on
        [a, b) over the dtypes it may hold them in: monotone in b (the refusal's search relies on
        it); equal to resident_bytes - memory_bytes whenever [a, b) does not fit."""
        return min(h.resident(j == 0, a, b) for h in self._hold[j]) - self._mem[j]

    def fits(self, j: int, a: int, b: int) -> bool:
        """Whether chain device j can hold blocks [a, b) (plus the head parts if j == 0) in a
        dtype it may hold them in."""
        return self.overflow_bytes(j, a, b) <= 0


def summarize(stage_s: Sequence[float]) -> tuple[float, float, float]:
    """(bottleneck_s, utilization, imbalance) of a list of stage times (DESIGN §5.1).

    utilization = Σ stage_s / (m * max); imbalance = max / min (inf when a stage costs 0).
    """
    mx = max(stage_s)
    mn = min(stage_s)
    util = sum(stage_s) / (len(stage_s) * mx) if mx > 0 else 1.0
    imb = mx / mn if mn > 0 else (1.0 if mx == 0 else float("inf"))
    return mx, util, imb
