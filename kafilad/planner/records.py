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
        batch_row_cost: measured marginal cost of one more row in a batched step, as a fraction
            of a one-row step (rho of docs/planner.md "Throughput": a b-row step costs
            stage_s * (1 + rho * (b - 1))); None = unknown, planned as 1 (no gain from batching).
        dtype: the float dtype the device's backend runs fastest with, in which bandwidth_Bps was
            measured ("float32", "bfloat16", "float16"); None = "float32" (kafilad.planner.precision).
        fallback_dtype: a narrower dtype the device holds a stage in when the stage does not fit
            in `dtype` (a CPU member of a bf16 checkpoint: "bfloat16"); None = none.
    """

    name: str
    memory_bytes: int
    bandwidth_Bps: Optional[float] = None
    flops_per_s: Optional[float] = None
    step_overhead_s: float = 0.0
    nat_class: Optional[str] = None
    rendezvous_rtt_ms: Optional[float] = None
    batch_row_cost: Optional[float] = None
    dtype: Optional[str] = None
    fallback_dtype: Optional[str] = None


@attrs.frozen
class ArchShape:
    """The shapes a stage's working memory follows (docs/planner.md "Working memory").

    Attributes:
        hidden_size: D. num_attention_heads: Hq. num_key_value_heads: Hkv. head_dim: hd.
        intermediate_size: F, the MLP's inner width (for mixture-of-experts models the widest of
            the dense MLP and the active experts together).
        vocab_size: V.
        act_bytes: bytes per activation element (the executor's float dtype; the KV dtype).
        prefill_chunk_tokens: the longest prefill chunk the head sends (mlx-lm's 2048).
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    act_bytes: int
    prefill_chunk_tokens: int = 2048


@attrs.frozen
class ModelProfile:
    """Byte counts of a model as the executor will hold it (DESIGN §5.1).

    Attributes:
        model_id: a display name (the model directory's name).
        block_bytes: resident bytes of each transformer block, in block order; len = n_blocks.
        block_read_bytes: bytes one token reads of each block (a mixture-of-experts block reads
            its routed experts' bytes times experts per token / experts, kafilad.planner.moe);
            empty = every block reads all its bytes (a dense model, a hand-made profile). Use
            `read_bytes`.
        head_read_bytes: bytes the head reads per token beyond its blocks (lm_head + final norm).
        head_resident_bytes: bytes the head holds beyond its blocks (embedding + untied lm_head + norm).
        kv_bytes_per_block_token: 2 * num_key_value_heads * head_dim * kv_dtype_bytes.
        block_flops_per_token: arithmetic per block per token (2 FLOP per weight a token reads:
            active weights for a mixture-of-experts block), for tier 2.
        head_flops_per_token: arithmetic of the head per token (lm_head), for tier 2.
        shape: the architecture's shapes for working memory (kafilad.planner.workmem); None
            counts no working memory (a hand-made profile).
    """

    model_id: str
    block_bytes: tuple[int, ...]
    head_read_bytes: int
    head_resident_bytes: int
    kv_bytes_per_block_token: int
    block_flops_per_token: tuple[float, ...] = ()
    head_flops_per_token: float = 0.0
    shape: Optional[ArchShape] = None
    block_read_bytes: tuple[int, ...] = ()

    @property
    def n_blocks(self) -> int:
        return len(self.block_bytes)

    @property
    def read_bytes(self) -> tuple[int, ...]:
        """Bytes one token reads of each block: `block_read_bytes`, or `block_bytes` when empty."""
        return self.block_read_bytes or self.block_bytes


def _edges_converter(edges) -> tuple[tuple[str, str, str], ...]:
    return tuple(tuple(e) for e in edges)


@attrs.frozen
class Plan:
    """A division of a model over a ring of devices and its predicted costs (DESIGN §5).

    Attributes:
        order: device names in ring order, head first (the chosen rotation).
        head: name of the head (holds blocks from 0, embedding, final norm, lm_head; DESIGN §2).
        blocks: name -> (start, end), the half-open block range the device holds.
        stage_s: name -> predicted per-token stage time, seconds (in the "memory" tier a
            working-set proxy, see kafilad.planner.costmodel).
        bottleneck_s: max of stage_s.
        circuit_s: sum of stage_s plus the one-way latency (RTT/2) of every ring edge whose RTT
            estimate is known (DESIGN §5.1, §5.2).
        utilization: sum(stage_s) / (m * bottleneck_s), in (0, 1].
        imbalance: max(stage_s) / min(stage_s), >= 1.
        resident_bytes: name -> bytes the device holds at the declared context and concurrency.
        tier: "cost-model", "flops" or "memory" (DESIGN §5.4).
        strategy: "kafila", "uniform" or "memory" (DESIGN §5.3, §5.5).
        edges: (from, to, predicted_path) for each ring edge in order, the last closing the ring
            back to the head; predicted_path is "direct" or "relayed" (DESIGN §3 step 4).
        model_id: the model's display name.
        n_blocks: number of transformer blocks divided.
        context: context length (tokens) the resident bytes were checked at.
        concurrency: concurrent requests the resident bytes were checked at.
        memory_bytes: name -> memory available to the model on that device.
        edge_latency_s: one-way latency of each edge in `edges` (RTT / 2), or None
            where an RTT is unknown.
        edge_measured: for each edge in `edges`, whether its latency is from a measured round
            trip (`plan(measured_rtt_ms=...)`) rather than the rendezvous estimate; empty on plans
            made before it existed.
        rotation_bottleneck_s: head name -> best bottleneck with that head (None where that
            rotation cannot fit); for the "kafila" strategy only, else empty.
        standby: members of the fleet left without blocks (strategy "load" only): they are
            in no other per-member field but `memory_bytes`, stay in the session and can take
            blocks when the session replans (docs/planner.md "Standby members").
        working_bytes: name -> the working-memory share of resident_bytes (kafilad.planner.workmem).
        throughput: the predicted rate for 1 user and for `concurrency` users (Throughput
            records of kafilad.planner.throughput; one entry when concurrency is 1).
        full_fleet_tokens_per_s: strategy "load": the best rate for `concurrency` users with
            every member holding blocks (None when that cannot fit); else None.
        dtype: name -> the float dtype the device holds its stage in (kafilad.planner.precision);
            empty when the model was given as one profile for every device.
        held_back: the device the planner would have made head had `plan(heads=...)` allowed it
            (more than μ faster), or None (kafilad/planner/trust.py; issue 22 item 5).
        held_back_gain: the fraction of the bottleneck (strategy "kafila") or of the seconds per
            token (strategy "load") that head would save; 0.0 when none is held back.
        head_unconfirmed: no device allowed to head could hold the head's share, so the head is
            one `heads` did not allow (the planner's choice on reported figures).
    """

    order: tuple[str, ...]
    head: str
    blocks: dict
    stage_s: dict
    bottleneck_s: float
    circuit_s: float
    utilization: float
    imbalance: float
    resident_bytes: dict
    tier: str
    strategy: str
    edges: tuple = attrs.field(converter=_edges_converter, default=())
    model_id: str = ""
    n_blocks: int = 0
    context: int = 0
    concurrency: int = 0
    memory_bytes: dict = attrs.field(factory=dict)
    edge_latency_s: tuple = ()
    edge_measured: tuple = ()
    rotation_bottleneck_s: dict = attrs.field(factory=dict)
    standby: tuple = ()
    working_bytes: dict = attrs.field(factory=dict)
    throughput: tuple = ()
    full_fleet_tokens_per_s: Optional[float] = None
    dtype: dict = attrs.field(factory=dict)
    held_back: Optional[str] = None
    held_back_gain: float = 0.0
    head_unconfirmed: bool = False

    def counts(self) -> dict:
        """name -> number of blocks held."""
        return {name: end - start for name, (start, end) in self.blocks.items()}

    def to_json(self) -> dict:
        """The `kafila-ctl plan --json` object (issue 4 item 2, proto_spec/06-fleet.md §3).

        Keys: order, head, blocks ({name: [start, end]}), stage_s, bottleneck_s, circuit_s,
        utilization, imbalance, resident_bytes, tier, plus strategy, model_id, n_blocks, context,
        concurrency, memory_bytes, edges ([{from, to, path, latency_s, measured}]), rotation_bottleneck_s,
        standby, working_bytes, throughput ([{users, tokens_per_s, round_s, micro_batches, rows,
        circuit_s, bottleneck_s, bound}], 1 user first), full_fleet_tokens_per_s and dtype
        ({name: dtype}, present when the plan decided each stage's dtype).
        """
        return {
            "order": list(self.order),
            "head": self.head,
            "blocks": {n: [int(a), int(b)] for n, (a, b) in self.blocks.items()},
            "stage_s": dict(self.stage_s),
            "bottleneck_s": self.bottleneck_s,
            "circuit_s": self.circuit_s,
            "utilization": self.utilization,
            "imbalance": self.imbalance,
            "resident_bytes": {n: int(v) for n, v in self.resident_bytes.items()},
            "tier": self.tier,
            "strategy": self.strategy,
            "model_id": self.model_id,
            "n_blocks": self.n_blocks,
            "context": self.context,
            "concurrency": self.concurrency,
            "memory_bytes": {n: int(v) for n, v in self.memory_bytes.items()},
            "edges": [
                {"from": a, "to": b, "path": p,
                 "latency_s": (self.edge_latency_s[i] if i < len(self.edge_latency_s) else None),
                 "measured": bool(self.edge_measured[i]) if i < len(self.edge_measured) else False}
                for i, (a, b, p) in enumerate(self.edges)
            ],
            "rotation_bottleneck_s": dict(self.rotation_bottleneck_s),
            "standby": list(self.standby),
            "working_bytes": {n: int(v) for n, v in self.working_bytes.items()},
            "throughput": [t.to_json() for t in self.throughput],
            "full_fleet_tokens_per_s": self.full_fleet_tokens_per_s,
            **({"dtype": dict(self.dtype)} if self.dtype else {}),
            **({"held_back": self.held_back, "held_back_gain": self.held_back_gain} if self.held_back else {}),
            **({"head_unconfirmed": True} if self.head_unconfirmed else {}),
        }
