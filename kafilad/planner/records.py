"""Planner records (DESIGN §5): devices, the model's byte profile, plans.

Pure data; no I/O. Units are in the field names.
"""

from __future__ import annotations

from typing import Optional

import attrs


@attrs.frozen
class Device:
    """One member as the planner sees it (DESIGN §5.1; fleet format in proto_spec/06-fleet.md).

    Attributes:
        name: unique member name.
        memory_bytes: memory available to the model after the runtime reserve.
        bandwidth_Bps: effective weight-read bandwidth the executor achieves, bytes/s.
        flops_per_s: raw arithmetic throughput (tier 2 of DESIGN §5.4).
        step_overhead_s: measured fixed per-step cost of a stage, seconds.
        nat_class: "O", "C" or "S" (DESIGN §3 step 4) when known.
        rendezvous_rtt_ms: round-trip time to the rendezvous, milliseconds, when known.
    """

    name: str
    memory_bytes: int
    bandwidth_Bps: Optional[float] = None
    flops_per_s: Optional[float] = None
    step_overhead_s: float = 0.0
    nat_class: Optional[str] = None
    rendezvous_rtt_ms: Optional[float] = None


@attrs.frozen
class ModelProfile:
    """Byte counts of a model as the executor will hold it (DESIGN §5.1).

    Attributes:
        model_id: a display name (the model directory's name).
        block_bytes: resident bytes of each transformer block, in block order; len = n_blocks.
        head_read_bytes: bytes the head reads per token beyond its blocks (lm_head + final norm).
        head_resident_bytes: bytes the head holds beyond its blocks (embedding + untied lm_head + norm).
        kv_bytes_per_block_token: 2 * num_key_value_heads * head_dim * kv_dtype_bytes.
        block_flops_per_token: arithmetic per block per token (2 FLOP per weight), for tier 2.
        head_flops_per_token: arithmetic of the head per token (lm_head), for tier 2.
    """

    model_id: str
    block_bytes: tuple[int, ...]
    head_read_bytes: int
    head_resident_bytes: int
    kv_bytes_per_block_token: int
    block_flops_per_token: tuple[float, ...] = ()
    head_flops_per_token: float = 0.0

    @property
    def n_blocks(self) -> int:
        return len(self.block_bytes)
