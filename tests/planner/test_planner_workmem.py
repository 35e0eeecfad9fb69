"""Working memory in admission (issue 12 item 3; kafilad/planner/workmem.py)."""

from __future__ import annotations

import pytest

from kafilad.planner import ChainCost, Device, ModelProfile
from kafilad.planner.records import ArchShape
from kafilad.planner.workmem import arch_from_config, steps, working_bytes, working_terms

QWEN3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 12288, "vocab_size": 151936, "num_hidden_layers": 36}


def test_shapes_from_config():
    s = arch_from_config(QWEN3_8B, 2)
    assert (s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim) == (4096, 32, 8, 128)
    assert (s.intermediate_size, s.vocab_size, s.act_bytes, s.prefill_chunk_tokens) == (12288, 151936, 2, 2048)
    # defaults: KV heads = heads, head_dim = hidden / heads; a multimodal config's text part
    s = arch_from_config({"text_config": {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96}}, 4)
    assert (s.num_key_value_heads, s.head_dim, s.vocab_size) == (4, 16, 0)
    # mixture of experts: the active experts together when wider than the dense MLP
    s = arch_from_config({**QWEN3_8B, "num_experts_per_tok": 8, "moe_intermediate_size": 2048}, 2)
    assert s.intermediate_size == 16384
    assert arch_from_config({"model_type": "x"}, 4) is None


def test_largest_steps_follow_the_heads_chunking():
    # prompt[:-1] in chunks of 2048, then the last token; then decode steps of K rows
    assert steps(4096, 1) == [(2048, 2048), (2047, 4095), (1, 4096)]
    assert steps(3000, 4) == [(2048, 2048), (951, 2999), (4, 3000)]
    assert steps(2049, 1) == [(2048, 2048), (1, 2049)]
    assert steps(100, 8) == [(99, 99), (8, 100)]
    assert steps(1, 1) == [(1, 1)]


def test_formula_terms_by_hand():
    s = ArchShape(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                  intermediate_size=16, vocab_size=10, act_bytes=4, prefill_chunk_tokens=4)
    # context 9, concurrency 2: steps (4, 8), (0 partial: 8 % 4 = 0), decode (2, 9)
    t = working_terms(s, context=9, concurrency=2, head=True)
    assert (t["tokens"], t["keys"]) == (4, 8)
    assert t["scores"] == 4 * 2 * 4 * 8
    assert t["mask"] == 2 * 4 * 8
    assert t["attention"] == 4 * 4 * (2 * 8 + 6 * 2 * 4 + 2 * 1 * 4)
    assert t["kv_growth"] == 4 * 8 * 3 * 1 * 4
    assert t["mlp"] == 4 * 4 * (2 * 16 + 3 * 8)
    assert t["logits"] == 4 * 3 * 2 * 10
    assert t["mlx"] == sum(t[k] for k in ("scores", "mask", "attention", "kv_growth", "mlp", "logits"))
    assert t["wire"] == 4 * (2 + 2) * 4 * 8
    assert t["total"] == t["mlx"] + t["wire"] == working_bytes(s, context=9, concurrency=2, head=True)
    assert working_bytes(s, context=9, concurrency=2, head=False) == t["total"] - t["logits"]
    assert working_bytes(None, context=9, concurrency=2, head=True) == 0


def test_resident_bytes_include_working_memory_once_per_member():
    s = ArchShape(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                  intermediate_size=16, vocab_size=10, act_bytes=4)
    model = ModelProfile("m", (100,) * 4, 10, 20, 3, shape=s)
    cc = ChainCost([Device("a", 10**6, 1.0), Device("b", 10**6, 1.0)], model, context=50, concurrency=2,
                   tier="cost-model")
    head_w = working_bytes(s, context=50, concurrency=2, head=True)
    other_w = working_bytes(s, context=50, concurrency=2, head=False)
    assert cc.resident_bytes(0, 0, 1) == 100 + 3 * 50 * 2 + 20 + head_w
    assert cc.resident_bytes(1, 1, 4) == 300 + 3 * 3 * 50 * 2 + other_w  # not per block
    assert (cc.working_bytes(0), cc.working_bytes(1)) == (head_w, other_w)
    assert head_w - other_w == 4 * 3 * 2 * 10


@pytest.mark.parametrize("context", [256, 2050, 3000, 4096])
def test_working_memory_grows_with_context(context):
    s = arch_from_config(QWEN3_8B, 4)
    lower = working_bytes(s, context=context - 1, concurrency=1, head=False)
    assert working_bytes(s, context=context, concurrency=1, head=False) >= lower
