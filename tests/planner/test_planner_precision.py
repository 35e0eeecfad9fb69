"""Per-device precision in the planner (issue 12 item 4; kafilad/planner/precision.py).

Each device is counted in the dtype it holds its stage in: memory and bytes per token of a
bfloat16 member are its bf16 bytes, a CPU member holds float32 when its f32 stage fits and its
fallback (the checkpoint's dtype) otherwise, and a refusal names the device that is short even
in its narrowest dtype. The exact partition stays exact (checked against exhaustive search).
"""

from __future__ import annotations

import itertools
import runpy
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from kafilad.errors import AdmissionError, PlanError
from kafilad.modelinfo import read_model_info
from kafilad.planner import ChainCost, Device, ModelProfile, fleet_to_json, load_fleet, plan, solve_chain
from kafilad.planner.fleet import FleetFormatError
from kafilad.planner.partition import rotate
from kafilad.planner.workmem import working_bytes

REPO = Path(__file__).resolve().parents[2]

F32 = ModelProfile(model_id="toy", block_bytes=(400,) * 6, head_read_bytes=1000, head_resident_bytes=2000,
                   kv_bytes_per_block_token=8)
BF16 = ModelProfile(model_id="toy", block_bytes=(200,) * 6, head_read_bytes=500, head_resident_bytes=1000,
                    kv_bytes_per_block_token=4)
TOY = {"float32": F32, "bfloat16": BF16}


def test_a_mixed_fleet_counts_each_device_in_its_dtype():
    ds = [Device("a", 100_000, 1000.0), Device("mac", 100_000, 1000.0, dtype="bfloat16"),
          Device("c", 100_000, 1000.0, dtype="float32")]
    p = plan(ds, TOY, context=10)
    # stage times (bytes per token / bandwidth): as head, a = 0.4 k + 1.0 > 1.4 at best; mac reads
    # bf16: 0.2 k + 0.5 as head, so (2, 2, 2) from mac gives 0.9, > 5 % better: the head moves
    assert p.head == "mac" and p.order == ("mac", "c", "a")
    assert p.blocks == {"mac": (0, 2), "c": (2, 4), "a": (4, 6)}
    assert p.dtype == {"mac": "bfloat16", "c": "float32", "a": "float32"}
    assert p.stage_s == pytest.approx({"mac": 0.9, "c": 0.8, "a": 0.8}, rel=1e-12)
    # memory: bf16 weights, bf16 KV (4 bytes per block-token) and the bf16 head parts
    assert p.resident_bytes == {"mac": 2 * 200 + 2 * 4 * 10 + 1000, "c": 2 * 400 + 2 * 8 * 10,
                                "a": 2 * 400 + 2 * 8 * 10}
    assert p.to_json()["dtype"] == {"mac": "bfloat16", "c": "float32", "a": "float32"}
    # the same fleet, everyone float32, keeps the head on the anchor (0.4 + 1.0 vs 0.4 * 2 + 1.0)
    same = plan([Device(d.name, d.memory_bytes, d.bandwidth_Bps) for d in ds], TOY, context=10)
    assert same.dtype == {"a": "float32", "mac": "float32", "c": "float32"}
    assert same.resident_bytes["mac"] == sum(F32.block_bytes[slice(*same.blocks["mac"])]) + \
        (same.blocks["mac"][1] - same.blocks["mac"][0]) * 8 * 10


def test_one_profile_counts_every_device_alike_as_before():
    ds = [Device("a", 100_000, 1000.0), Device("mac", 100_000, 1000.0, dtype="bfloat16")]
    p = plan(ds, F32, context=10)
    assert p.dtype == {} and "dtype" not in p.to_json()
    assert p.resident_bytes[p.order[1]] == sum(F32.block_bytes[slice(*p.blocks[p.order[1]])]) + \
        (p.blocks[p.order[1]][1] - p.blocks[p.order[1]][0]) * 8 * 10


def test_cpu_member_holds_float32_when_it_fits_else_its_fallback():
    # a as head costs 0.001 + 0.0004 k s, b 0.0004 k s: the best division is a [0, 2), b [2, 6)
    cpu = dict(dtype="float32", fallback_dtype="bfloat16")
    roomy = plan([Device("a", 100_000, 1e6), Device("b", 100_000, 1e6, **cpu)], TOY, context=10)
    assert roomy.blocks == {"a": (0, 2), "b": (2, 6)}
    assert roomy.dtype == {"a": "float32", "b": "float32"}
    assert roomy.resident_bytes["b"] == 4 * 400 + 4 * 8 * 10  # 1920
    # 1919 bytes: the f32 stage is one byte short, the bf16 one (4 * (200 + 4 * 10) = 960) fits
    tight = plan([Device("a", 100_000, 1e6), Device("b", 1919, 1e6, **cpu)], TOY, context=10)
    assert tight.blocks == {"a": (0, 2), "b": (2, 6)}
    assert tight.dtype == {"a": "float32", "b": "bfloat16"}
    assert tight.resident_bytes["b"] == 960
    # a fallback stage is timed as its preferred dtype's (f32 bytes / bandwidth), never less
    assert tight.stage_s["b"] == pytest.approx(4 * 400 / 1e6, rel=1e-12)
    # without a fallback the same device cannot take four blocks: a takes more
    no_fb = plan([Device("a", 100_000, 1e6), Device("b", 1919, 1e6, dtype="float32")], TOY, context=10)
    assert no_fb.blocks == {"a": (0, 3), "b": (3, 6)} and no_fb.resident_bytes["b"] == 1440


def test_refusal_names_the_device_short_even_in_its_checkpoint_dtype():
    cpu = dict(dtype="float32", fallback_dtype="bfloat16")
    ds = [Device("a", 100_000, 1000.0), Device("mac", 100_000, 1000.0, dtype="bfloat16"),
          Device("tiny", 100, 1000.0, **cpu)]
    with pytest.raises(AdmissionError) as info:
        plan(ds, TOY, context=10)
    e = info.value
    # tiny's least share, one block, in bf16: 200 + 4 * 10 = 240 bytes in 100
    assert e.device == "tiny" and e.shortfall_bytes == 140
    assert "device 'tiny' short by 140 bytes" in str(e) and "in bfloat16, 240 bytes, in 100 bytes available" in str(e)


def test_a_dtype_the_profiles_lack_is_a_plan_error():
    with pytest.raises(PlanError, match="Device 'mac' holds its stage in float16, but the model's byte profile "
                                        "was made for bfloat16, float32 only"):
        plan([Device("a", 10**6, 1.0), Device("mac", 10**6, 1.0, dtype="float16")], TOY)
    with pytest.raises(PlanError, match="dtype 'int4'"):
        plan([Device("a", 10**6, 1.0, dtype="int4")], TOY)


# ---- a real checkpoint: Qwen3-8B headers, stored bf16 ------------------------------------------------
@pytest.fixture(scope="module")
def qwen8b(tmp_path_factory):
    out = tmp_path_factory.mktemp("models")
    runpy.run_path(str(REPO / "scripts" / "make_model_headers.py"))["make_model"](out, "qwen3-8b", "single")
    return read_model_info(out / "qwen3-8b")


def expected_resident(prof: ModelProfile, a: int, b: int, head: bool, context: int) -> int:
    r = sum(prof.block_bytes[a:b]) + (b - a) * prof.kv_bytes_per_block_token * context
    r += working_bytes(prof.shape, context=context, concurrency=1, head=head)
    return r + (prof.head_resident_bytes if head else 0)


def test_qwen3_8b_fits_a_bf16_mac_and_f32_boxes_that_all_f32_refuses(qwen8b):
    assert qwen8b.float_dtype == "bfloat16"
    profiles = qwen8b.profiles(["float32", "bfloat16"])
    f32, bf16 = profiles["float32"], profiles["bfloat16"]
    assert bf16.block_bytes[0] == 385892864 and f32.block_bytes[0] == 2 * 385892864
    assert (bf16.kv_bytes_per_block_token, f32.kv_bytes_per_block_token) == (4096, 8192)
    ds = [Device("mac", 14 * 10**9, 100e9, dtype="bfloat16"), Device("box1", 10 * 10**9, 20e9, dtype="float32"),
          Device("box2", 10 * 10**9, 20e9, dtype="float32")]
    with pytest.raises(AdmissionError):  # as before this item: everyone counted in f32
        plan(ds, f32, context=4096)
    p = plan(ds, profiles, context=4096)
    assert p.dtype == {"mac": "bfloat16", "box1": "float32", "box2": "float32"}
    for name in p.order:
        a, b = p.blocks[name]
        prof = profiles[p.dtype[name]]
        assert p.resident_bytes[name] == expected_resident(prof, a, b, name == p.head, 4096) <= p.memory_bytes[name]
        # bytes per token over the member's measured bandwidth, in its own dtype
        read = sum(prof.block_bytes[a:b]) + (prof.head_read_bytes if name == p.head else 0)
        assert p.stage_s[name] == pytest.approx(read / {"mac": 100e9}.get(name, 20e9), rel=1e-12)


# ---- exactness with mixed dtypes and fallbacks -----------------------------------------------------
def compositions(n: int, m: int):
    for cuts in itertools.combinations(range(1, n), m - 1):
        yield [0, *cuts, n]


@st.composite
def mixed_instances(draw):
    m = draw(st.integers(1, 4))
    n = draw(st.integers(m, 8))
    f32 = tuple(draw(st.lists(st.integers(2, 1000), min_size=n, max_size=n)))
    kv = draw(st.integers(0, 3))
    profiles = {
        "float32": ModelProfile("mix", f32, draw(st.integers(0, 1500)), draw(st.integers(0, 3000)), 2 * kv),
    }
    h = profiles["float32"]
    profiles["bfloat16"] = ModelProfile("mix", tuple(x // 2 for x in f32), h.head_read_bytes // 2,
                                        h.head_resident_bytes // 2, kv)
    kinds = [dict(), dict(dtype="bfloat16"), dict(dtype="float32", fallback_dtype="bfloat16")]
    devices = [Device(f"d{i}", draw(st.integers(100, 8000)), float(draw(st.integers(1, 1000))),
                      step_overhead_s=draw(st.sampled_from([0.0, 0.5])), **draw(st.sampled_from(kinds)))
               for i in range(m)]
    return devices, profiles, draw(st.integers(1, 32))


def direct_options(d: Device, profiles):
    first = d.dtype or "float32"
    return [profiles[first]] + ([profiles[d.fallback_dtype]] if d.fallback_dtype else []), profiles[first]


@settings(max_examples=300, deadline=None)
@given(mixed_instances())
def test_mixed_dtype_partition_matches_exhaustive_search(inst):
    devices, profiles, ctx = inst
    for r in range(len(devices)):
        chain = rotate(devices, r)
        cc = ChainCost(chain, profiles, context=ctx, concurrency=1, tier="cost-model")

        def fits(j, a, b):  # written out here, not taken from ChainCost
            opts, _ = direct_options(chain[j], profiles)
            return any(expected_resident(p, a, b, j == 0, ctx) <= chain[j].memory_bytes
                       for p in opts)

        def cost(j, a, b):
            _, first = direct_options(chain[j], profiles)
            work = sum(first.block_bytes[a:b]) + (first.head_read_bytes if j == 0 else 0)
            return chain[j].step_overhead_s + work / chain[j].bandwidth_Bps

        rows = []
        for bounds in compositions(cc.n, cc.m):
            if all(fits(j, bounds[j], bounds[j + 1]) for j in range(cc.m)):
                rows.append(max(cost(j, bounds[j], bounds[j + 1]) for j in range(cc.m)))
        sol = solve_chain(cc.n, cc.m, cc.stage_s, cc.fits)
        if not rows:
            assert sol is None
            continue
        assert sol is not None and sol[0] == pytest.approx(min(rows), rel=1e-12)
        bounds = sol[1]
        for j in range(cc.m):
            a, b = bounds[j], bounds[j + 1]
            assert fits(j, a, b) and cc.resident_bytes(j, a, b) <= chain[j].memory_bytes
            dt = cc.dtype(j, a, b)
            opts, _ = direct_options(chain[j], profiles)
            # the preferred dtype whenever it fits
            pref = chain[j].dtype or "float32"
            if expected_resident(profiles[pref], a, b, j == 0, ctx) <= chain[j].memory_bytes:
                assert dt == pref
            else:
                assert dt == chain[j].fallback_dtype
            assert cc.resident_bytes(j, a, b) == expected_resident(profiles[dt], a, b, j == 0, ctx)


# ---- the fleet file carries the dtypes --------------------------------------------------------------
def test_fleet_file_round_trips_dtypes():
    ds = (Device("a", 10**9, 1e9), Device("mac", 10**9, 1e9, dtype="bfloat16"),
          Device("cpu", 10**9, 1e9, dtype="float32", fallback_dtype="bfloat16"))
    obj = fleet_to_json(ds)
    assert obj["devices"][1]["dtype"] == "bfloat16" and "dtype" not in obj["devices"][0]
    assert obj["devices"][2]["fallback_dtype"] == "bfloat16"
    assert load_fleet(obj).devices == ds
    with pytest.raises(FleetFormatError, match="Fleet device 'x': 'dtype' must be one of float32, bfloat16, "
                                               "float16, not 'fp8'"):
        load_fleet({"devices": [{"name": "x", "memory_bytes": 1, "dtype": "fp8"}]})
