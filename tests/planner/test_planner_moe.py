"""Mixture-of-experts in the cost model (issue 21 item 4): bytes a token reads, header-only MoE
models written from published configs, and `kafila-ctl plan` on them."""

from __future__ import annotations

import argparse
import json
import runpy
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from kafila_ctl import plan_cmd
from kafilad.errors import ModelFormatError
from kafilad.modelinfo import read_model_info
from kafilad.planner import ChainCost, Device, ModelProfile, moe, plan

REPO = Path(__file__).resolve().parents[2]
headers = runpy.run_path(str(REPO / "scripts" / "make_model_headers.py"))

#: published total and active parameter counts (billions) and what each publisher counts as active:
#: Qwen counts both embedding tables (Qwen3 technical report, model cards), OpenAI the blocks and the
#: unembedding (gpt-oss model card: 5.13 B of 116.83 B), DeepSeek both tables (37 B of 671 B), Zhipu
#: the blocks only (GLM-4.5 report: 12 B of 106 B for GLM-4.5-Air).
PUBLISHED = {
    "qwen3-30b-a3b": (30.5, 3.3, "blocks+lm_head+embed"),
    "qwen3-235b-a22b": (235.0, 22.0, "blocks+lm_head+embed"),
    "gpt-oss-120b": (116.83, 5.13, "blocks+lm_head"),
    "deepseek-v3": (671.0, 37.0, "blocks+lm_head+embed"),
    "glm-4.5-air": (106.0, 12.0, "blocks"),
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moe-models")
    for name in PUBLISHED:
        headers["make_model"](out, name, "single")
    return out


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_header_models_hold_and_read_the_published_parameter_counts(moe_dir, name):
    total_b, active_b, counted = PUBLISHED[name]
    p = read_model_info(moe_dir / name).profile()  # bf16 as written: 2 bytes per parameter
    lm_head = p.head_read_bytes / 2e9
    embed = (p.head_resident_bytes - p.head_read_bytes) / 2e9
    total = (sum(p.block_bytes) + p.head_resident_bytes) / 2e9
    active = sum(p.read_bytes) / 2e9
    if "lm_head" in counted:
        active += lm_head
    if "embed" in counted:
        active += embed
    assert total == pytest.approx(total_b, rel=0.01)
    assert active == pytest.approx(active_b, rel=0.03)
    assert sum(p.read_bytes) < 0.12 * sum(p.block_bytes)  # a token reads about a tenth or less


def test_qwen3_30b_a3b_block_reads_attention_router_and_8_of_128_experts(moe_dir):
    p = read_model_info(moe_dir / "qwen3-30b-a3b").profile()
    D, E, F, hd = 2048, 128, 768, 128
    attention = 2 * D * 32 * hd + 2 * D * 4 * hd + 2 * D + 2 * hd  # q, o; k, v; two norms; q/k norms
    experts = 3 * D * F * E
    assert p.block_bytes == (2 * (attention + D * E + experts),) * 48
    assert p.read_bytes == (2 * (attention + D * E + experts * 8 // 128),) * 48
    assert p.block_flops_per_token == (2.0 * (attention + D * E + experts * 8 // 128),) * 48


def test_dense_blocks_of_deepseek_and_glm_read_all_their_bytes(moe_dir):
    ds = read_model_info(moe_dir / "deepseek-v3").profile()
    assert ds.read_bytes[:3] == ds.block_bytes[:3]
    assert all(r < b / 10 for r, b in zip(ds.read_bytes[3:], ds.block_bytes[3:]))
    glm = read_model_info(moe_dir / "glm-4.5-air").profile()
    assert glm.read_bytes[0] == glm.block_bytes[0]
    assert all(r < b / 5 for r, b in zip(glm.read_bytes[1:], glm.block_bytes[1:]))


def test_a_dense_model_has_no_separate_read_bytes(tmp_path):
    headers["make_model"](tmp_path, "qwen3-8b", "single")
    p = read_model_info(tmp_path / "qwen3-8b").profile()
    assert p.block_read_bytes == () and p.read_bytes == p.block_bytes


def test_plan_times_follow_bytes_read_and_memory_every_expert(moe_dir):
    p = read_model_info(moe_dir / "qwen3-30b-a3b").profile()
    bw = 400e9
    fleet = [Device("a", memory_bytes=40_000_000_000, bandwidth_Bps=bw),
             Device("b", memory_bytes=40_000_000_000, bandwidth_Bps=bw)]
    pl = plan(fleet, p, context=4096, concurrency=1, strategy="kafila")
    for name, (a, b) in pl.blocks.items():
        head = p.head_read_bytes if name == pl.head else 0
        assert pl.stage_s[name] == pytest.approx((sum(p.read_bytes[a:b]) + head) / bw)
        assert pl.resident_bytes[name] > sum(p.block_bytes[a:b])  # every expert is held
    assert pl.circuit_s == pytest.approx((sum(p.read_bytes) + p.head_read_bytes) / bw)
    # charging every byte (the cost model before MoE) would predict about 10x the time
    assert (sum(p.block_bytes) + p.head_read_bytes) / bw > 8 * pl.circuit_s


def run_cli(argv, capsys) -> tuple[int, str]:
    ap = argparse.ArgumentParser(prog="kafila-ctl")
    plan_cmd.add_parser(ap.add_subparsers(required=True))
    a = ap.parse_args(["plan", *argv])
    rc = a.func(a)
    return rc, capsys.readouterr().out


def test_kafila_ctl_plan_says_what_a_token_reads(moe_dir, capsys):
    fleet = str(REPO / "fleets" / "home-lab.json")
    rc, out = run_cli(["--fleet", fleet, "--model", str(moe_dir / "qwen3-30b-a3b")], capsys)
    assert rc == 0
    assert "Mixture of experts (8 of 128 experts per token): a token reads 5.5 GB of the blocks' 59.8 GB" in " ".join(out.split())
    rc, out = run_cli(["--fleet", fleet, "--model", str(moe_dir / "qwen3-30b-a3b"), "--json"], capsys)
    obj = json.loads(out)
    p = read_model_info(moe_dir / "qwen3-30b-a3b").profile()
    assert obj["moe"] == {"num_experts": 128, "experts_per_tok": 8, "block_bytes": sum(p.block_bytes),
                          "block_read_bytes": sum(p.read_bytes)}
    assert obj["bottleneck_s"] < 0.02  # 6 GB a token on an 800 GB/s studio, not 60 GB


# ------------------------------------------------------------------------------------ pure parts --
@pytest.mark.parametrize("name", [
    "model.layers.3.mlp.switch_mlp.gate_proj.weight", "model.layers.3.mlp.switch_mlp.down_proj.scales",
    "model.layers.0.block_sparse_moe.switch_mlp.up_proj.biases", "model.layers.1.mlp.experts.gate_up_proj",
    "model.layers.1.mlp.experts.gate_up_proj_blocks", "model.layers.1.mlp.experts.down_proj_bias",
    "model.layers.1.mlp.experts.gate_proj.weight", "model.layers.7.mlp.experts.127.up_proj.weight",
    "model.layers.0.block_sparse_moe.experts.3.w1.weight", "layers.0.mlp.switch_mlp.up_proj.weight",
])
def test_routed_expert_names(name):
    assert moe.is_routed_expert(name)


@pytest.mark.parametrize("name", [
    "model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
    "model.layers.3.mlp.router.weight", "model.layers.3.mlp.shared_experts.gate_proj.weight",
    "model.layers.3.mlp.shared_expert.up_proj.weight", "model.layers.3.mlp.shared_expert_gate.weight",
    "model.layers.3.mlp.gate_proj.weight", "model.layers.3.self_attn.q_proj.weight", "model.embed_tokens.weight",
])
def test_names_that_are_not_routed_experts(name):
    assert not moe.is_routed_expert(name)


@pytest.mark.parametrize("config,spec", [
    ({"num_experts": 128, "num_experts_per_tok": 8}, moe.MoeSpec(128, 8)),  # Qwen
    ({"num_local_experts": 8, "num_experts_per_tok": 2}, moe.MoeSpec(8, 2)),  # Mixtral, gpt-oss
    ({"n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1}, moe.MoeSpec(256, 8)),  # DeepSeek
    ({"num_local_experts": 32, "experts_per_token": 4}, moe.MoeSpec(32, 4)),  # gpt-oss's original key
    ({"text_config": {"num_experts": 64, "num_experts_per_tok": 4}}, moe.MoeSpec(64, 4)),  # multimodal
    ({"hidden_size": 64}, None), ({"num_experts": 0, "num_experts_per_tok": 0}, None),
])
def test_moe_spec_reads_each_familys_keys(config, spec):
    assert moe.moe_spec(config) == spec


def test_more_experts_per_token_than_experts_is_refused(tmp_path):
    with pytest.raises(ValueError):
        moe.moe_spec({"num_experts": 4, "num_experts_per_tok": 8})
    headers["make_model"](tmp_path, "qwen3-30b-a3b", "single")
    cfg = tmp_path / "qwen3-30b-a3b" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "num_experts_per_tok": 200}))
    with pytest.raises(ModelFormatError, match="200 experts of 128"):
        read_model_info(tmp_path / "qwen3-30b-a3b").profile()


def test_which_blocks_are_moe():
    ds = {"n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 3, "moe_layer_freq": 2}
    assert [moe.is_moe_block(ds, i) for i in range(8)] == [False, False, False, False, True, False, True, False]
    qw = {"num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert [moe.is_moe_block(qw, i) for i in range(6)] == [False, True, False, False, False, True]
    assert not moe.is_moe_block({"hidden_size": 8}, 0)
    flat = moe.all_moe_config({**ds, **qw})
    assert all(moe.is_moe_block(flat, i) for i in range(8))
    assert moe.all_moe_config({"hidden_size": 8}) == {"hidden_size": 8}


names = st.sampled_from(["self_attn.q_proj.weight", "mlp.gate.weight", "mlp.shared_experts.up_proj.weight",
                         "mlp.switch_mlp.up_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.5.down_proj.weight"])


@settings(max_examples=200, deadline=None)
@given(tensors=st.lists(st.tuples(names, st.integers(0, 10**9)), max_size=12),
       e=st.integers(1, 512), data=st.data())
def test_read_bytes_counts_routed_bytes_times_k_over_e(tensors, e, data):
    k = data.draw(st.integers(1, e))
    spec = moe.MoeSpec(e, k)
    routed = sum(b for n, b in tensors if moe.is_routed_expert(n))
    dense = sum(b for n, b in tensors) - routed
    got = moe.read_bytes(tensors, spec)
    assert got == dense + routed * k // e
    assert dense <= got <= dense + routed
    assert moe.read_bytes(tensors, moe.MoeSpec(e, e)) == dense + routed  # every expert: every byte
    assert moe.read_bytes(tensors, None) == dense + routed  # a dense model reads every byte
    if k < e:
        assert got <= moe.read_bytes(tensors, moe.MoeSpec(e, k + 1))


@settings(max_examples=100, deadline=None)
@given(held=st.lists(st.integers(1, 10**9), min_size=2, max_size=8), data=st.data())
def test_the_cost_model_times_bytes_read_and_holds_every_byte(held, data):
    read = tuple(data.draw(st.integers(1, h)) for h in held)
    prof = ModelProfile("m", block_bytes=tuple(held), head_read_bytes=100, head_resident_bytes=200,
                        kv_bytes_per_block_token=0, block_read_bytes=read)
    n = len(held)
    a = data.draw(st.integers(0, n - 1))
    b = data.draw(st.integers(a + 1, n))
    dev = Device("d", memory_bytes=10**12, bandwidth_Bps=1e9, step_overhead_s=0.001)
    cost = ChainCost([dev], prof, context=1, concurrency=1, tier="cost-model")
    assert cost.stage_s(0, a, b) == pytest.approx(0.001 + (sum(read[a:b]) + 100) / 1e9)
    assert cost.resident_bytes(0, a, b) == sum(held[a:b]) + 200
    # the memory tier divides by what is held (exo's rule), not by what is read
    mem = ChainCost([dev], prof, context=1, concurrency=1, tier="memory")
    assert mem.stage_s(0, a, b) == pytest.approx(0.001 + (sum(held[a:b]) + 100) / 10**12)


def test_deepseek_v3_caches_its_latent_not_full_heads(moe_dir):
    # mlx-lm's MLA caches kv_lora_rank + qk_rope_head_dim values per token and block (bf16 here)
    assert read_model_info(moe_dir / "deepseek-v3").profile().kv_bytes_per_block_token == (512 + 64) * 2
