"""`kafila-ctl plan` on fleet files and synthesised Qwen3 header-only model directories (issue 4 items 1-5)."""

from __future__ import annotations

import argparse
import io
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kafila_ctl import plan_cmd
from kafilad.modelinfo import read_model_info
from kafilad.planner import load_fleet, plan
from kafilad.planner.workmem import working_bytes

REPO = Path(__file__).resolve().parents[2]
FLEETS = REPO / "fleets"
headers = runpy.run_path(str(REPO / "scripts" / "make_model_headers.py"))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models")
    for layout in ("single", "sharded"):
        headers["make_model"](out, "qwen3-14b", layout)
    headers["make_model"](out, "qwen3-32b", "single")
    return out


def run_cli(argv, capsys) -> tuple[int, str]:
    p = argparse.ArgumentParser(prog="kafila-ctl")
    plan_cmd.add_parser(p.add_subparsers(required=True))
    a = p.parse_args(["plan", *argv])
    rc = a.func(a)
    return rc, capsys.readouterr().out


def test_header_files_are_sparse_and_read_as_qwen3_14b(qwen_dir):
    d = qwen_dir / "qwen3-14b"
    f = d / "model.safetensors"
    assert f.stat().st_size > 29_000_000_000  # the declared checkpoint size
    assert f.stat().st_blocks * 512 < 10_000_000  # but only the header is on disk
    p = read_model_info(d).profile()
    # q 5120x5120, k,v 1024x5120, o 5120x5120, mlp 3 x 17408x5120, norms 2x5120 + 2x128, bf16
    per_block = 2 * (2 * 5120 * 5120 + 2 * 1024 * 5120 + 3 * 17408 * 5120 + 2 * 5120 + 2 * 128)
    assert p.block_bytes == (per_block,) * 40
    assert p.head_read_bytes == 2 * (151936 * 5120 + 5120)
    assert p.head_resident_bytes == 2 * (2 * 151936 * 5120 + 5120)
    assert p.kv_bytes_per_block_token == 2 * 8 * 128 * 2


def test_sharded_layout_profiles_identically(qwen_dir):
    single = read_model_info(qwen_dir / "qwen3-14b").profile()
    sharded_info = read_model_info(qwen_dir / "qwen3-14b-sharded")
    assert len({t.file for t in sharded_info.tensors.values()}) > 1
    sharded = sharded_info.profile()
    assert sharded.block_bytes == single.block_bytes
    assert (sharded.head_read_bytes, sharded.head_resident_bytes) == (single.head_read_bytes, single.head_resident_bytes)


def test_json_plan_on_the_home_lab(qwen_dir, capsys):
    rc, out = run_cli(["--fleet", str(FLEETS / "home-lab.json"), "--model", str(qwen_dir / "qwen3-14b"), "--json",
                       "--strategy", "kafila"], capsys)
    assert rc == 0
    j = json.loads(out)
    assert j["order"] == ["studio", "ddr4-box", "air-m1"] and j["head"] == "studio" and j["tier"] == "cost-model"
    assert j["blocks"] == {"studio": [0, 35], "ddr4-box": [35, 37], "air-m1": [37, 40]}
    assert j["bottleneck_s"] == pytest.approx(max(j["stage_s"].values()))
    assert j["utilization"] > 0.75
    # the done-when: uniform > 3x and memory-proportional > 2x Kafila's bottleneck
    assert j["baselines"]["uniform"]["bottleneck_s"] / j["bottleneck_s"] > 3
    assert j["baselines"]["memory"]["bottleneck_s"] / j["bottleneck_s"] > 2
    # the same plan as the library on the same fleet (what the daemon computes)
    f = load_fleet(FLEETS / "home-lab.json")
    p = plan(f.devices, read_model_info(qwen_dir / "qwen3-14b").profile(), context=f.context, concurrency=f.concurrency)
    assert {k: j[k] for k in p.to_json()} == json.loads(json.dumps(p.to_json()))


def test_nothing_fits_exits_2_with_error_object(qwen_dir, capsys):
    rc, out = run_cli(["--fleet", str(FLEETS / "student-laptops.json"), "--model", str(qwen_dir / "qwen3-32b"), "--json"], capsys)
    assert rc == 2
    err = json.loads(out)["error"]
    # 1,385,148,191 bytes of weights and KV cache beyond its memory, plus its working memory
    shape = read_model_info(qwen_dir / "qwen3-32b").profile().shape
    short = 1385148191 + working_bytes(shape, context=4096, concurrency=1, head=False)
    assert err["type"] == "AdmissionError" and err["device"] == "air-m2" and err["shortfall_bytes"] == short
    assert f"device 'air-m2' short by {short} bytes" in err["message"]


def test_uniform_cannot_place_32b_but_kafila_can(qwen_dir, capsys):
    args = ["--fleet", str(FLEETS / "home-lab.json"), "--model", str(qwen_dir / "qwen3-32b"), "--json"]
    rc, out = run_cli(args + ["--strategy", "uniform"], capsys)
    assert rc == 2 and json.loads(out)["error"]["device"] == "air-m1"
    rc, out = run_cli(args, capsys)
    assert rc == 0 and json.loads(out)["baselines"]["uniform"]["error"]["device"] == "air-m1"


def test_hold_dtype_f32_doubles_resident_weights(qwen_dir, capsys):
    base = ["--fleet", str(FLEETS / "gaming-pcs.json"), "--model", str(qwen_dir / "qwen3-14b"), "--json", "--strategy", "uniform"]
    _, out = run_cli(base + ["--context", "2"], capsys)  # the least context the host takes
    bf16 = json.loads(out)
    rc, out = run_cli(base + ["--context", "2", "--hold-dtype", "f32"], capsys)
    assert rc == 2  # 4070: blocks [10, 20) at f32 need 13.2 GB of its 11.8 GB
    err = json.loads(out)["error"]
    f32 = read_model_info(qwen_dir / "qwen3-14b").profile(float_dtype_bytes=4)
    work = working_bytes(f32.shape, context=2, concurrency=1, head=False)
    need = sum(f32.block_bytes[10:20]) + 10 * f32.kv_bytes_per_block_token * 2 + work
    assert err["device"] == "pc-4070" and err["shortfall_bytes"] == need - (11 * 2**30)
    bf16_work = working_bytes(read_model_info(qwen_dir / "qwen3-14b").profile().shape, context=2, concurrency=1,
                              head=False)
    assert bf16["working_bytes"]["pc-4070"] == bf16_work < work
    assert bf16["resident_bytes"]["pc-4070"] == sum(f32.block_bytes[10:20]) // 2 + 10 * 4096 * 2 + bf16_work
    assert bf16["context"] == 2 and bf16["concurrency"] == 1


def test_table_and_plot(qwen_dir, capsys, tmp_path):
    png = tmp_path / "p.png"
    rc, out = run_cli(["--fleet", str(FLEETS / "home-lab.json"), "--model", str(qwen_dir / "qwen3-14b"), "--plot", str(png)], capsys)
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_is_a_pure_function_of_the_outcomes(qwen_dir):
    f = load_fleet(FLEETS / "home-lab.json")
    prof = read_model_info(qwen_dir / "qwen3-32b").profile()
    outcomes = plan_cmd.plan_all(f.devices, prof, context=4096, concurrency=1, mu=0.05)
    buf = io.StringIO()
    plan_cmd.render(outcomes, "kafila", Console(file=buf, width=120), "home-lab")
    text = buf.getvalue()
    assert "qwen3-32b on home-lab" in text and "does not fit" in text
    assert "57H / 71.4" in text  # the studio: 57 blocks and the head, 71.4 ms
    short = 9320939295 + working_bytes(prof.shape, context=4096, concurrency=1, head=False)
    assert f"uniform division leaves device 'air-m1' short by {short} bytes" in " ".join(text.split())


def test_bad_inputs_exit_1(tmp_path, capsys, qwen_dir):
    rc, out = run_cli(["--fleet", str(tmp_path / "none.json"), "--model", str(qwen_dir / "qwen3-14b"), "--json"], capsys)
    assert rc == 1 and json.loads(out)["error"]["type"] == "FleetFormatError"
    rc, out = run_cli(["--fleet", str(FLEETS / "home-lab.json"), "--model", str(tmp_path), "--json"], capsys)
    assert rc == 1 and "has no config.json" in json.loads(out)["error"]["message"]


def test_stories260k_plans_on_a_tiny_fleet(stories260k, tmp_path, capsys):
    fleet = tmp_path / "f.json"
    fleet.write_text(json.dumps({"devices": [
        {"name": "a", "memory_bytes": 10**8, "bandwidth_Bps": 2e10, "step_overhead_s": 1e-4},
        {"name": "b", "memory_bytes": 10**8, "bandwidth_Bps": 1e10, "step_overhead_s": 1e-4}]}))
    rc, out = run_cli(["--fleet", str(fleet), "--model", str(stories260k), "--json", "--hold-dtype", "f32"], capsys)
    assert rc == 0
    j = json.loads(out)
    assert j["n_blocks"] == 5 and sum(b - a for a, b in j["blocks"].values()) == 5


def test_script_runs_as_a_subprocess(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "make_model_headers.py"), str(tmp_path),
                        "--models", "qwen3-8b", "--layout", "both"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "qwen3-8b-sharded" / "model.safetensors.index.json").exists()
    r = subprocess.run([sys.executable, str(REPO / "kafila_ctl" / "plan_cmd.py"), "plan", "--fleet",
                        str(FLEETS / "apple-family.json"), "--model", str(tmp_path / "qwen3-8b-sharded"), "--json",
                        "--strategy", "kafila"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["head"] == "mini-m4pro"


def test_load_strategy_shows_rates_for_one_and_k_users_and_why(qwen_dir, capsys):
    args = ["--fleet", str(FLEETS / "home-lab.json"), "--model", str(qwen_dir / "qwen3-14b")]
    rc, out = run_cli(args + ["--concurrency", "4", "--json", "--strategy", "load"], capsys)
    j = json.loads(out)
    assert rc == 0 and [t["users"] for t in j["throughput"]] == [1, 4]
    assert j["throughput"][1]["tokens_per_s"] >= j["baselines"]["kafila"]["throughput"][1]["tokens_per_s"] * 0.95
    rc, out = run_cli(args + ["--json", "--strategy", "load"], capsys)
    one = json.loads(out)
    # one user on the home lab: the studio alone (35.0 ms) beats the paper's ring's 85.7 ms circuit
    assert one["standby"] == ["ddr4-box", "air-m1"] and one["blocks"] == {"studio": [0, 40]}
    assert one["throughput"][0]["tokens_per_s"] == pytest.approx(1 / one["circuit_s"])
    assert one["baselines"]["kafila"]["throughput"][0]["tokens_per_s"] == pytest.approx(
        1 / one["baselines"]["kafila"]["circuit_s"])
    rc, out = run_cli(args + ["--concurrency", "4", "--strategy", "kafila"], capsys)
    text = " ".join(out.split())
    assert rc == 0
    assert "1 user: 11.7 tokens/s: each token goes round the circuit, stages 85.7 + hops 0.0 ms." in text
    assert "4 users: 32.4 tokens/s: 4 micro-batch(es) of 1 row(s) in flight" in text
    rc, out = run_cli(args + ["--strategy", "kafila"], capsys)
    text = " ".join(out.split())
    assert "Strategy load would serve 1 user(s) at 28.6 tokens/s (head studio, standby ddr4-box, air-m1)." in text
    rc, out = run_cli(args, capsys)  # load is the default strategy
    text = " ".join(out.split())
    assert "Standby (no blocks, ready for healing): ddr4-box, air-m1: 28.6 tokens/s for 1 user(s)" in text
    assert "standby" in out.split("per device")[1]


def test_status_view_shows_predicted_rates_and_standby():
    from kafila_ctl.render import status_renderable
    snap = {"name": "h", "peer_id": "p", "fingerprint": "f", "session": "s", "role": "host", "state": "ready",
            "members": [], "plan": {"bottleneck_s": 0.03, "circuit_s": 0.035, "utilization": 1.0, "tier": "cost-model",
                                    "strategy": "load", "standby": ["slow"],
                                    "throughput": [{"users": 1, "tokens_per_s": 28.57}, {"users": 4, "tokens_per_s": 30.8}]}}
    buf = io.StringIO()
    Console(file=buf, width=120).print(status_renderable(snap))
    text = " ".join(buf.getvalue().split())
    assert "predicted: 28.6 tokens/s for 1 user, 30.8 tokens/s for 4 users (load)" in text
    assert "standby (no blocks, ready for healing): slow" in text
    # why, and how to give every member blocks (a new user saw equal members stand by with no hint)
    snap["plan"]["full_fleet_tokens_per_s"] = 21.25
    buf = io.StringIO()
    Console(file=buf, width=400).print(status_renderable(snap))
    text = " ".join(buf.getvalue().split())
    assert ("standby (no blocks, ready for healing): slow — this ring is predicted faster for 4 users (30.8 tokens/s "
            "against 21.2 tokens/s with every member holding blocks); `kafila-ctl host --strategy kafila` (or a "
            "higher --concurrency) gives every member blocks") in text


def test_host_takes_a_strategy():
    from kafila_ctl.cli import build_parser
    from kafilad.errors import KafilaError
    from kafilad.daemon import _strategy
    a = build_parser().parse_args(["host", "--model", "m", "--members", "3", "--strategy", "uniform"])
    assert a.strategy == "uniform"
    assert build_parser().parse_args(["host", "--model", "m", "--members", "3"]).strategy == "load"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["host", "--model", "m", "--members", "3", "--strategy", "best"])
    assert _strategy({"strategy": "memory"}) == "memory" and _strategy({}) == "load"
    with pytest.raises(KafilaError, match="Unknown strategy 'best'; choose one of kafila, load, uniform, memory."):
        _strategy({"strategy": "best"})
    with pytest.raises(KafilaError, match="must be str"):
        _strategy({"strategy": 3})
