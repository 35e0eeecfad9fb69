"""The architecture matrix: tiny random models of every architecture a group would pool (issue 21 item 2).

`ARCHS` lists the mlx-lm architectures Kafila serves, each with the config of a tiny model
(hidden 64, 6 blocks, vocab 512) written from the architecture's own `ModelArgs`: the families
of Llama, Mistral, Qwen2/3, Qwen3 MoE, Qwen3-Next and Qwen3.5 (hybrid linear attention), Gemma 3
and 4, gpt-oss, DeepSeek-V3/R1 and Kimi K2 (MLA + MoE), GLM-4.5, Phi-3, Granite, Mixtral, OLMo 2,
SmolLM3, LFM2, Nemotron-H and Llama 4. Sliding windows are 8 tokens, so a 24-token prompt is
longer than every window. `synthesize_arch` writes one as an mlx-lm model directory
(config.json, model.safetensors in mlx-lm's own tensor names, the synthetic models' byte-level
tokenizer, kafilad/executor/synth.py, so daemons can serve it) in a precision: float32, bfloat16,
or quantised (4-bit or 8-bit affine, group 32; mxfp4 where the family ships it).

Weights: mlx-lm's own initialisation (seeded), then every block's matrices scaled by
`BLOCK_GAIN`, so each block moves the residual stream enough that greedy tokens depend on every
block (a split at the wrong boundary, or a block run with a wrong mask, changes them).

Used by tests/executor/test_arch_matrix.py and scripts/arch_matrix.py (the table in
docs/architectures.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import _get_classes, quantize_model, save_model

from kafilad.executor.synth import BOS_ID, EOS_ID, write_tokenizer_files

#: every block's 2-D weights are multiplied by this after mlx-lm's initialisation
BLOCK_GAIN = 2.0
VOCAB = 512
#: precisions a matrix case can take
PRECISIONS = ("float32", "bfloat16", "q4", "q8", "mxfp4")

_BASE = {"hidden_size": 64, "num_hidden_layers": 6, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "max_position_embeddings": 4096,
         "tie_word_embeddings": False, "rope_theta": 10000.0, "head_dim": 16}

_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}


def _cfg(model_type: str, **kw) -> dict:
    return {"model_type": model_type, **_BASE, **kw}


_QWEN35_TEXT = {**_BASE, "model_type": "qwen3_5_text", "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                "full_attention_interval": 3, "tie_word_embeddings": False,
                "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.5}}

#: name -> config of its tiny model (mlx-lm `model_type` and the fields its ModelArgs reads)
ARCHS: dict[str, dict] = {
    "llama": _cfg("llama"),
    "ministral3": _cfg("ministral3", layer_types=["sliding_attention", "full_attention"] * 3, sliding_window=8,
                       rope_parameters={"rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                                        "original_max_position_embeddings": 16, "type": "default"}),
    "mistral3": {"model_type": "mistral3",
                 "text_config": _cfg("ministral3", layer_types=["full_attention"] * 6,
                                     rope_parameters={"rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                                                      "original_max_position_embeddings": 16, "type": "default"})},
    "qwen2": _cfg("qwen2", tie_word_embeddings=True),
    "qwen3": _cfg("qwen3", tie_word_embeddings=True),
    "qwen3_moe": _cfg("qwen3_moe", **_MOE, decoder_sparse_step=1, mlp_only_layers=[1]),
    "qwen3_next": _cfg("qwen3_next", **_MOE, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                       decoder_sparse_step=1, shared_expert_intermediate_size=32, mlp_only_layers=[],
                       partial_rotary_factor=0.5, full_attention_interval=3),
    "qwen3_5": {"model_type": "qwen3_5", "text_config": _QWEN35_TEXT},
    "qwen3_5_moe": {"model_type": "qwen3_5_moe",
                    "text_config": {**_QWEN35_TEXT, "model_type": "qwen3_5_moe_text", **_MOE,
                                    "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1}},
    "gemma3_text": _cfg("gemma3_text", num_key_value_heads=1, query_pre_attn_scalar=16, sliding_window=8,
                        sliding_window_pattern=3, rope_local_base_freq=10000.0),
    "gemma4_text": _cfg("gemma4_text", num_key_value_heads=1, global_head_dim=32, sliding_window=8,
                        sliding_window_pattern=3, num_kv_shared_layers=0, hidden_size_per_layer_input=0,
                        use_double_wide_mlp=False, final_logit_softcapping=30.0, tie_word_embeddings=True),
    "gpt_oss": _cfg("gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"] * 3),
    "deepseek_v3": _cfg("deepseek_v3", num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
                        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
                        q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=1,
                        topk_group=1, routed_scaling_factor=2.5),
    "glm4_moe": _cfg("glm4_moe", moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                     num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
                     routed_scaling_factor=2.5, rope_scaling=None, use_qk_norm=True, attention_bias=False,
                     partial_rotary_factor=0.5),
    "phi3": _cfg("phi3"),
    "granite": _cfg("granite", logits_scaling=4.0, attention_multiplier=0.1, embedding_multiplier=3.0,
                    residual_multiplier=0.5, attention_bias=False, mlp_bias=False),
    "mixtral": _cfg("mixtral", num_local_experts=4, num_experts_per_tok=2),
    "olmo2": _cfg("olmo2"),
    "smollm3": _cfg("smollm3", no_rope_layer_interval=3),
    "lfm2": _cfg("lfm2", norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64, block_ff_dim=128,
                 block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                 full_attn_idxs=[1, 4]),
    "nemotron_h": _cfg("nemotron_h", hybrid_override_pattern=list("M*-M*-"), attention_bias=False,
                       mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16,
                       conv_kernel=4, n_groups=2, mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False,
                       use_conv_bias=True),
    "llama4_text": _cfg("llama4_text", intermediate_size_mlp=128, no_rope_layers=[1, 1, 1, 0, 1, 1],
                        use_qk_norm=True, attention_chunk_size=8, num_local_experts=2, num_experts_per_tok=1,
                        interleave_moe_layer_step=2),
}

#: Gemma 4 variants that mlx-lm's code cannot divide (kafilad.modelinfo.unsplittable_reason):
#: served whole by one member, refused for more
UNSPLITTABLE: dict[str, dict] = {
    "gemma4_text per-layer inputs": {**ARCHS["gemma4_text"], "hidden_size_per_layer_input": 16,
                                     "vocab_size_per_layer_input": VOCAB},
    "gemma4_text KV sharing": {**ARCHS["gemma4_text"], "num_kv_shared_layers": 2},
}

#: families that ship mxfp4 checkpoints (gpt-oss)
MXFP4_ARCHS = ("gpt_oss",)
#: architectures whose routed experts run through MLX's gather_mm, which MLX's CPU backend runs in
#: float32 only ("[GatherMM::eval] Currently only supports float32"): single-process mlx-lm cannot
#: run them in bfloat16 on a CPU either, and Kafila's CPU members hold float32 (DESIGN §6)
GATHER_MM_ARCHS = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "gpt_oss", "deepseek_v3", "glm4_moe", "mixtral")


#: seeds whose tiny model answers a 40-token prompt with at least 5 distinct greedy tokens in every
#: precision (Gemma 4's soft-capped tied output collapses to one repeated token for some seeds)
_SEEDS = {"gemma4_text": 1}


def seed_for(arch: str) -> int:
    """The matrix's seed for `arch`."""
    return _SEEDS.get(arch, sum(map(ord, arch)))


def precisions_for(arch: str) -> tuple[str, ...]:
    """The precisions the matrix runs `arch` in."""
    return ("float32", "bfloat16", "q4", "q8") + (("mxfp4",) if arch in MXFP4_ARCHS else ())


def build_model(config: dict, seed: int = 0) -> nn.Module:
    """mlx-lm's model for `config`, initialised by its own code from `seed`, blocks scaled by
    `BLOCK_GAIN` (module docstring)."""
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))

    def scale(path: str, v: mx.array) -> mx.array:
        if ".layers." in f".{path}" and v.ndim >= 2 and mx.issubdtype(v.dtype, mx.floating):
            return v * BLOCK_GAIN
        return v

    model.update(tree_map_with_path(scale, model.parameters()))
    mx.eval(model.parameters())
    return model


def synthesize_arch(out_dir: str | Path, arch: str, precision: str = "float32", seed: int = 0,
                    config: Optional[dict] = None) -> Path:
    """Write the tiny `arch` model in `precision` as an mlx-lm model directory; return it.

    Args:
        arch: a key of ARCHS (its config), or any name when `config` is given.
        precision: one of PRECISIONS; q4 / q8 / mxfp4 quantise with mlx-lm's `quantize_model`
            (group 32 affine; mxfp4 group 32).
    Raises:
        ValueError: unknown arch or precision.
    """
    if config is None:
        if arch not in ARCHS:
            raise ValueError(f"Unknown architecture {arch!r}; the matrix has {', '.join(ARCHS)}.")
        config = json.loads(json.dumps(ARCHS[arch]))
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(config, seed)
    if precision == "bfloat16":
        model.set_dtype(mx.bfloat16)
    elif precision in ("q4", "q8", "mxfp4"):
        bits, mode = {"q4": (4, "affine"), "q8": (8, "affine"), "mxfp4": (4, "mxfp4")}[precision]
        model, config = quantize_model(model, config, 32, bits, mode=mode)
    config = {**config, "torch_dtype": "bfloat16" if precision == "bfloat16" else "float32",
              "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
    save_model(out, model, donate_model=False)
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    write_tokenizer_files(out, model_max_length=int((config.get("text_config") or config)["max_position_embeddings"]))
    return out


def param_count(model: nn.Module) -> int:
    """Parameters (elements) of a model, for the docs table."""
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def reference_tokens(model_dir: str | Path, prompt: list[int], max_tokens: int, *,
                     prefill_step_size: int = 2048) -> list[int]:
    """Greedy tokens of single-process mlx-lm (`mlx_lm.utils.load_model` and
    `mlx_lm.generate.generate_step`, its own loop) after `prompt`: the matrix's reference."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    out = []
    for tok, _ in generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=max_tokens,
                                prefill_step_size=prefill_step_size):
        out.append(int(tok))
    return out


def ring_tokens(model_dir: str | Path, bounds: list[tuple[int, int]], prompt: list[int], max_tokens: int, *,
                prefill_step_size: int = 2048) -> list[int]:
    """Greedy tokens of stages [a, b) in `bounds` (head first) chained in this process, each hop
    through the wire format (kafilad.executor.runner.generate_local), weights in the stored dtype."""
    from kafilad.executor.runner import StageRunner, generate_local
    from kafilad.executor.stage import load_stage_from_dir

    runners = [StageRunner(load_stage_from_dir(model_dir, a, b, i == 0, dtype=None)) for i, (a, b) in enumerate(bounds)]
    return generate_local(runners, prompt, max_tokens, prefill_step_size=prefill_step_size)


def ring_batch_tokens(model_dir: str | Path, bounds: list[tuple[int, int]], prompts: list[list[int]],
                      max_tokens: int, *, prefill_step_size: int = 2048) -> list[list[int]]:
    """Greedy tokens of several requests through chained stages, as the node runs them: each
    prompt prefilled alone (its first token sampled alone), then every request decoded in one
    batch per step (`StageRunner.head_embed_and_run_batch`, `run_batch`, `head_sample_batch`:
    mlx-lm's batch caches). Returns one token list per prompt."""
    from kafilad.executor.runner import StageRunner, array_from_wire, array_to_wire, prefill_chunks
    from kafilad.executor.stage import load_stage_from_dir

    runners = [StageRunner(load_stage_from_dir(model_dir, a, b, i == 0, dtype=None)) for i, (a, b) in enumerate(bounds)]
    head = runners[0]
    hop = lambda a: array_from_wire(array_to_wire(a))  # noqa: E731
    rids = [f"r{i}" for i in range(len(prompts))]
    out = []
    for rid, prompt in zip(rids, prompts):
        for chunk in prefill_chunks(prompt, prefill_step_size):
            h = head.head_embed_and_run(rid, chunk)
            for r in runners[1:]:
                h = r.run(rid, hop(h))
        out.append([head.head_sample(rid, hop(h))])
    while len(out[0]) < max_tokens:
        h = head.head_embed_and_run_batch(rids, [o[-1] for o in out])
        for r in runners[1:]:
            h = r.run_batch(rids, hop(h))
        for o, t in zip(out, head.head_sample_batch(rids, hop(h))):
            o.append(t)
    for r in runners:
        for rid in rids:
            r.drop(rid)
    return out
