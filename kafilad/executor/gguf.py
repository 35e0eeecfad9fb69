"""GGUF models (llama.cpp, Ollama) as mlx-lm model directories (issue 21 item 5).

Many groups hold their models as GGUF files (Ollama's store, llama.cpp, prima.cpp, mesh-llm).
`convert_gguf` reads one with MLX's own GGUF reader (`mx.load(path, return_metadata=True)`, which
returns Q4_0 / Q4_1 / Q8_0 tensors as MLX affine-quantised weights of group 32 with their scales
and biases) and writes the model directory the rest of Kafila serves: `config.json` (mlx-lm's
names, with its "quantization" entry; each tensor's bits are read from its shape as mlx-lm reads
them, `infer_quant_config`), `model.safetensors` in mlx-lm's tensor names, and a tokenizer built
from the file's metadata (`tokenizer.json`, `tokenizer_config.json` with the chat template,
`generation_config.json`). The host daemon converts once, into its state directory, keyed by the
file's identity (kafilad/modelref.py); members then fetch their own tensors by byte range from the
converted safetensors, as from any model directory, so one GGUF file is read whole only once, by
the host.

What the conversion undoes (llama.cpp's convert_hf_to_gguf.py):
- tensor names: `token_embd` -> `model.embed_tokens`, `blk.N.attn_q` -> `model.layers.N.self_attn.q_proj`
  (k, v, `attn_output` -> o_proj), `ffn_gate/up/down` -> `mlp.*_proj`, `attn_norm` ->
  `input_layernorm`, `ffn_norm` -> `post_attention_layernorm`, `output_norm` -> `model.norm`,
  `output` -> `lm_head` (absent: tied embeddings);
- the Q and K rope permutation (`permute(w, n_head)`: rows of each head reordered so rotary
  halves interleave): undone on rows, which applies alike to packed weights, scales and biases
  because quantisation groups run along the input dimension.

Supported: general.architecture "llama" (Llama, SmolLM2, Mistral-style GGUFs). Any other
architecture is refused with a sentence before anything is written. Tokenizers: "gpt2"
(byte-level BPE, merges) and "llama" (SentencePiece-style BPE with byte fallback).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from kafilad.errors import ModelFormatError

#: GGUF (llama.cpp) block tensor names -> mlx-lm's
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")
#: GGUF convention version written into the converted directory (bump when the output changes)
CONVERSION_VERSION = 1


def _scalar(md: dict, key: str, default=None):
    v = md.get(key, default)
    if isinstance(v, mx.array):
        v = v.item()
    return v


def unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's `permute(w, n_head)` on the rows of `w` (rows = n_head x head_dim)."""
    rows = w.shape[0]  # llama.cpp: w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_metadata(md: dict, weights: dict) -> dict:
    """The mlx-lm config.json of a llama-architecture GGUF.

    Raises:
        ModelFormatError: another architecture, or metadata missing a size.
    """
    arch = _scalar(md, "general.architecture")
    if arch != "llama":
        raise ModelFormatError(f"This GGUF file's architecture is {arch!r}; Kafila reads GGUF files of the llama "
                               "architecture (Llama, SmolLM2, Mistral-style); use the model's safetensors instead.")

    def need(key):
        v = _scalar(md, f"llama.{key}")
        if v is None:
            raise ModelFormatError(f"This GGUF file lacks llama.{key}; it cannot be served.")
        return v

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = md.get("tokenizer.ggml.tokens") or []
    cfg = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden, "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")), "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(md, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_scalar(md, "llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_scalar(md, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_scalar(md, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_scalar(md, "llama.context_length", 4096)),
        "vocab_size": int(_scalar(md, "llama.vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in weights,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    }
    for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        v = _scalar(md, name)
        if v is not None:
            cfg[key] = int(v)
    if any(k.endswith(".scales") for k in weights):
        cfg["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine"}  # each tensor's bits: its shape
    return cfg


def mlx_weights(weights: dict, cfg: dict) -> dict:
    """GGUF tensors renamed to mlx-lm's, Q and K rows un-permuted (module docstring).

    Raises:
        ModelFormatError: a tensor this architecture does not have.
    """
    out = {}
    for name, w in weights.items():
        m = _BLOCK_RE.match(name)
        if m:
            block, part, leaf = m.groups()
            if part not in _BLOCK_NAMES:
                raise ModelFormatError(f"This GGUF file holds tensor {name}, which a llama block does not have.")
            if part in ("attn_q", "attn_k"):
                w = unpermute_rows(w, cfg["num_attention_heads"] if part == "attn_q" else cfg["num_key_value_heads"])
            out[f"model.layers.{block}.{_BLOCK_NAMES[part]}.{leaf}"] = w
            continue
        m = _TOP_RE.match(name)
        if m and m.group(1) in _TOP_NAMES:
            out[f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"] = w
        elif name != "rope_freqs.weight":  # llama 3's rope scaling table; mlx-lm computes its own
            raise ModelFormatError(f"This GGUF file holds tensor {name}, which a llama model does not have.")
    return out


def tokenizer_json(md: dict) -> str:
    """A `tokenizers` tokenizer.json from the GGUF tokenizer metadata (gpt2 byte-level BPE or llama).

    Raises:
        ModelFormatError: another tokenizer model.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    kind = _scalar(md, "tokenizer.ggml.model")
    tokens = list(md.get("tokenizer.ggml.tokens") or [])
    merges = [tuple(m.split(" ", 1)) for m in (md.get("tokenizer.ggml.merges") or [])]
    types = md.get("tokenizer.ggml.token_type")
    types = np.array(types).tolist() if types is not None else [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        unk = _scalar(md, "tokenizer.ggml.unknown_token_id", 0)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[int(unk)], fuse_unk=True,
                                   byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        raise ModelFormatError(f"This GGUF file's tokenizer is {kind!r}; Kafila reads 'gpt2' and 'llama' tokenizers.")
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
    tok.add_special_tokens(special)
    return tok.to_str(pretty=False)


def convert_gguf(path: str | Path, out_dir: str | Path) -> Path:
    """Write the mlx-lm model directory of the GGUF file `path` into `out_dir` (module docstring).

    Raises:
        ModelFormatError: not a GGUF file MLX can read, another architecture or tokenizer, or a
            tensor a llama model does not have.
    """
    path, out = Path(path), Path(out_dir)
    try:
        weights, md = mx.load(str(path), format="gguf", return_metadata=True)  # Ollama blobs have no .gguf
    except (RuntimeError, ValueError, OSError) as e:
        raise ModelFormatError(f"{path} is not a GGUF file MLX can read ({' '.join(str(e).split())[:200]}).") from e
    cfg = config_from_metadata(md, weights)
    converted = mlx_weights(weights, cfg)
    tok_json = tokenizer_json(md)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), converted, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    (out / "tokenizer.json").write_text(tok_json)
    tokens = list(md.get("tokenizer.ggml.tokens") or [])

    def token(key):
        i = _scalar(md, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token("tokenizer.ggml.bos_token_id"),
               "eos_token": token("tokenizer.ggml.eos_token_id"), "unk_token": token("tokenizer.ggml.unknown_token_id"),
               "pad_token": token("tokenizer.ggml.padding_token_id"),
               "add_bos_token": bool(_scalar(md, "tokenizer.ggml.add_bos_token", False)),
               "model_max_length": cfg["max_position_embeddings"], "clean_up_tokenization_spaces": False}
    if isinstance(md.get("tokenizer.chat_template"), str):
        tok_cfg["chat_template"] = md["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tok_cfg.items() if v is not None},
                                                          indent=1))
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
    (out / "generation_config.json").write_text(json.dumps(gen))
    (out / "kafila-gguf.json").write_text(json.dumps({"source": str(path), "version": CONVERSION_VERSION}))
    return out
