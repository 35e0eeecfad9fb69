"""The planner (DESIGN §5): pure code, no sockets, no trio, no MLX.

Public API:
    plan(devices, model, *, context=4096, concurrency=1, strategy="kafila", mu=0.05) -> Plan
    DEFAULT_STRATEGY = "load" (what host and `kafila-ctl plan` choose); STRATEGIES
    Plan, Device, ModelProfile                         records
    predict_path(a_class, b_class) -> "direct" | "relayed"   DESIGN §3 step 4
    order_ring(devices) -> list[Device]                DESIGN §5.2, anchor first
    load_fleet(obj_or_path) -> Fleet; fleet_to_json(devices, context, concurrency) -> dict
    uniform_counts(n, m), memory_counts(n, memory_bytes)      DESIGN §5.5
    backend_dtypes(backend, checkpoint_dtype), stage_dtype(...)  per-device precision (.precision)
    moe.moe_spec(config), moe.read_bytes(...)        bytes a mixture-of-experts token reads (.moe)
See docs/planner.md and proto_spec/06-fleet.md.
"""

from kafilad.planner.baselines import memory_counts, uniform_counts
from kafilad.planner.costmodel import ChainCost, select_tier
from kafilad.planner.fleet import Fleet, FleetFormatError, fleet_to_json, load_fleet
from kafilad.planner.partition import choose_rotation, solve_chain
from kafilad.planner.plan import DEFAULT_STRATEGY, STRATEGIES, admit, build_plan, plan
from kafilad.planner.precision import DTYPE_BYTES, backend_dtypes, stage_dtype
from kafilad.planner.records import Device, ModelProfile, Plan
from kafilad.planner.ring import order_ring, predict_path

__all__ = [
    "ChainCost", "DEFAULT_STRATEGY", "DTYPE_BYTES", "Device", "Fleet", "FleetFormatError", "ModelProfile", "Plan", "STRATEGIES",
    "admit", "backend_dtypes", "build_plan", "choose_rotation", "fleet_to_json", "load_fleet", "memory_counts",
    "order_ring", "plan", "predict_path", "select_tier", "solve_chain", "stage_dtype", "uniform_counts",
]
