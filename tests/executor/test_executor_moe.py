"""Mixture-of-experts timing (issue 21 item 4): the probe's blocks, routing and bytes agree with the
planner's count and with mlx-lm's own MoE classes. No timing assertions."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.utils import _get_classes, load_model

from kafilad.executor.probe import measure_stage, spread_routers, stage_read_bytes, token_inputs
from kafilad.executor.stage import build_random_stage, load_stage_from_dir
from kafilad.executor.synth import synthesize_mlx_model
from kafilad.modelinfo import read_model_info
from kafilad.planner import moe

_ATTN = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=258,
             max_position_embeddings=4096, tie_word_embeddings=False)
CONFIGS = {
    "qwen3_moe": dict(model_type="qwen3_moe", num_hidden_layers=4, intermediate_size=256, num_experts=16,
                      num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3], moe_intermediate_size=64,
                      norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6, **_ATTN),
    "glm4_moe": dict(model_type="glm4_moe", num_hidden_layers=3, intermediate_size=256, moe_intermediate_size=64,
                     n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
                     norm_topk_prob=True, n_group=1, topk_group=1, routed_scaling_factor=1.0, rms_norm_eps=1e-5,
                     rope_theta=1e6, rope_scaling=None, use_qk_norm=False, attention_bias=True,
                     partial_rotary_factor=0.5, **_ATTN),
    "deepseek_v3": dict(model_type="deepseek_v3", num_hidden_layers=4, intermediate_size=256, moe_intermediate_size=64,
                        n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=2,
                        moe_layer_freq=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=32,
                        qk_nope_head_dim=32, n_group=1, topk_group=1, **_ATTN),
    "gpt_oss": dict(model_type="gpt_oss", num_hidden_layers=2, num_local_experts=16, num_experts_per_tok=2,
                    intermediate_size=64, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                    rope_theta=150000, **_ATTN),
    "mixtral": dict(model_type="mixtral", num_hidden_layers=2, intermediate_size=64, num_local_experts=8,
                    num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6, **_ATTN),
}


def _mlp(layer):
    return getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_which_blocks_are_moe_agrees_with_mlx_lm(arch):
    cfg = CONFIGS[arch]
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    routed = [any(moe.is_routed_expert(n) for n, _ in _flat(_mlp(layer))) for layer in model.layers]
    assert routed == [moe.is_moe_block(cfg, i) for i in range(cfg["num_hidden_layers"])]
    flat = moe.all_moe_config(cfg)
    model = model_class(args_class.from_dict(flat))
    assert all(any(moe.is_routed_expert(n) for n, _ in _flat(_mlp(layer))) for layer in model.layers)


def _flat(module):
    from mlx.utils import tree_flatten

    return [(f"mlp.{n}", v) for n, v in tree_flatten(module.parameters())]


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "gpt_oss", "mixtral"])
def test_the_probes_bytes_are_the_planners_bytes_read(tmp_path, arch):
    cfg = CONFIGS[arch]
    d = synthesize_mlx_model(tmp_path, cfg, seed=3)
    info = read_model_info(d)
    prof = info.profile(float_dtype_bytes=4)
    assert prof.block_read_bytes and sum(prof.read_bytes) < sum(prof.block_bytes)
    for i in range(cfg["num_hidden_layers"]):
        stage = load_stage_from_dir(d, i, i + 1, False)
        assert stage_read_bytes(stage.model, info.moe) == prof.read_bytes[i]
        assert stage.nbytes() == prof.block_bytes[i]


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "mixtral"])
def test_a_synthesised_moe_model_loads_in_stages_as_mlx_lm_loads_it(tmp_path, arch):
    cfg = CONFIGS[arch]
    d = synthesize_mlx_model(tmp_path, cfg, seed=5)
    whole, _ = load_model(d)
    ids = [1, 7, 3, 200, 9]
    want = whole(mx.array(ids)[None])[:, -1, :]
    n = cfg["num_hidden_layers"]
    head = load_stage_from_dir(d, 0, 1, True)
    rest = load_stage_from_dir(d, 1, n, False)
    h = rest.run_blocks(head.run_tokens(ids, head.make_cache()), rest.make_cache())
    assert mx.allclose(head.logits(h), want, atol=1e-4).item()


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_spread_routers_sends_tokens_to_many_experts(arch):
    cfg = moe.all_moe_config(CONFIGS[arch])
    stage = build_random_stage(cfg, 1)
    gate = stage.layers[0].mlp.gate
    assert not mx.any(gate.weight).item()  # mlx-lm's MoEGate starts at zeros: every token, the same experts
    assert spread_routers(stage.model, 16) == 1
    assert mx.any(gate.weight).item()
    inds, _ = gate(mx.concatenate(token_inputs(cfg["hidden_size"], mx.float32)))
    used = set(inds.reshape(-1).tolist())
    assert len(used) >= 12  # 64 tokens x k over 16 experts: a router's spread, not the same few


def test_token_inputs_are_distinct_and_repeatable():
    a = token_inputs(32, mx.float32, count=8)
    b = token_inputs(32, mx.float32, count=8)
    assert all(mx.array_equal(x, y).item() for x, y in zip(a, b))
    assert len({tuple(x.reshape(-1).tolist()) for x in a}) == 8
    assert a[0].shape == (1, 1, 32)


@pytest.mark.parametrize("arch", ["glm4_moe", "gpt_oss"])
def test_the_stage_probe_times_moe_blocks(arch):
    t = measure_stage(CONFIGS[arch], batch_rows=4, window_s=0.05)
    assert 1e6 < t.bandwidth_Bps < 1e13 and t.step_overhead_s >= 0.0
    assert 0.0 <= t.batch_row_cost <= 1.0
