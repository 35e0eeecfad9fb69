"""A deterministic synthetic model in Hugging Face layout, for the demo and the twin tests.

`synthesize_model` writes a small Llama or Qwen3 (random weights from a seeded numpy generator)
with a byte-level tokenizer, so a fresh machine with no model files can run `kafila-ctl demo`
(issue 2 item 8) and every test on ../shared/models has a twin the project makes itself
(PREAMBLE "Tests"). The same arguments always give byte-identical files.

Layout written (what `mlx_lm.load` and transformers' `AutoTokenizer` read offline):
    config.json              HF config (model_type "llama" or "qwen3")
    model.safetensors        HF tensor names, written here with sorted keys (deterministic)
    tokenizer.json           byte-level BPE without merges: ids 0-255 are bytes, 256 <s>, 257 </s>
    tokenizer_config.json    PreTrainedTokenizerFast, bos <s>, eos </s>
    generation_config.json

Weights: embeddings ~ N(0, EMBED_STD^2), linear weights ~ N(0, (LINEAR_GAIN / sqrt(fan_in))^2),
norm weights 1: each block changes the residual stream more than the embedding sets it, so the
next token depends on the context and greedy generation does not collapse to one repeated token.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

#: bump when the generated files change for the same parameters (invalidates the cache).
SYNTH_FORMAT_VERSION = 1
BOS_ID, EOS_ID = 256, 257
VOCAB_SIZE = 258
ARCHES = ("llama", "qwen3")
#: embedding std: small next to the O(sqrt(D)) block updates, so a tied output projection does
#: not just echo the input token.
EMBED_STD = 0.1
#: linear weights ~ N(0, (LINEAR_GAIN / sqrt(fan_in))^2); at 1.0 greedy text falls into 1-4 token
#: loops, at 2.0 it uses 20-35 distinct tokens in 40 (measured on seeds 0 and 7, both arches).
LINEAR_GAIN = 2.0


def synth_config(arch: str = "llama", *, num_hidden_layers: int = 6, hidden_size: int = 64,
                 intermediate_size: Optional[int] = None, num_attention_heads: int = 4,
                 num_key_value_heads: int = 2, tie_word_embeddings: Optional[bool] = None,
                 max_position_embeddings: int = 4096) -> dict:
    """The config.json of a synthetic model (see `synthesize_model` for the arguments).

    Raises:
        ValueError: unknown arch or a hidden size not divisible by the head count.
    """
    if arch not in ARCHES:
        raise ValueError(f"Unknown synthetic architecture {arch!r}; choose one of {', '.join(ARCHES)}.")
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError("hidden_size must divide by num_attention_heads, and that by num_key_value_heads.")
    head_dim = hidden_size // num_attention_heads
    if tie_word_embeddings is None:
        tie_word_embeddings = arch == "qwen3"
    cfg = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen3ForCausalLM"],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 3 * hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-06 if arch == "qwen3" else 1e-05,
        "rope_theta": 1000000.0 if arch == "qwen3" else 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": bool(tie_word_embeddings),
        "attention_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        cfg["mlp_bias"] = False
    return cfg


def synth_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a synthetic model (the layout mlx-lm's llama/qwen3 load)."""
    D, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd, H, KV = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, D)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (H * hd, D), p + "self_attn.k_proj.weight": (KV * hd, D),
            p + "self_attn.v_proj.weight": (KV * hd, D), p + "self_attn.o_proj.weight": (D, H * hd),
            p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D), p + "mlp.down_proj.weight": (D, F),
        })
        if config["model_type"] == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
    return shapes


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bit patterns (uint16)."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """Write a safetensors file deterministically: sorted names, compact JSON, 8-byte aligned header.

    tensors: name -> (safetensors dtype, shape, little-endian bytes).
    """
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def byte_level_chars() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: each byte's printable stand-in in byte-level BPE vocabularies, so
    that a vocabulary listing them in byte order has token id == byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _tokenizer_json() -> str:
    """A byte-level BPE tokenizer (no merges) built with the `tokenizers` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    byte_to_char = byte_level_chars()
    assert set(byte_to_char.values()) == set(ByteLevel.alphabet())  # 256 printable stand-ins, one per byte
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS_ID)])
    return tok.to_str(pretty=False)


def synthesize_model(out_dir: str | Path, *, arch: str = "llama", seed: int = 0, num_hidden_layers: int = 6,
                     hidden_size: int = 64, intermediate_size: Optional[int] = None,
                     num_attention_heads: int = 4, num_key_value_heads: int = 2,
                     tie_word_embeddings: Optional[bool] = None, dtype: str = "float32",
                     gain: float = LINEAR_GAIN) -> Path:
    """Write a deterministic random model of the given shape to `out_dir` (created if needed).

    Args:
        arch: "llama" (untied lm_head by default) or "qwen3" (tied by default, q/k norms).
        seed: numpy generator seed; the same arguments give byte-identical files.
        dtype: stored weight dtype, "float32" or "bfloat16".
        gain: scale of the linear weights (see LINEAR_GAIN).
    Returns:
        out_dir as a Path.
    Raises:
        ValueError: bad arch, dtype or shape.
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"Synthetic weights are float32 or bfloat16, not {dtype!r}.")
    config = synth_config(arch, num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
                          intermediate_size=intermediate_size, num_attention_heads=num_attention_heads,
                          num_key_value_heads=num_key_value_heads, tie_word_embeddings=tie_word_embeddings)
    config["torch_dtype"] = dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in synth_tensor_shapes(config).items():  # insertion order is fixed
        if name.endswith("norm.weight"):
            w = np.ones(shape, np.float32)
        elif "embed_tokens" in name:
            w = rng.standard_normal(shape, dtype=np.float32) * np.float32(EMBED_STD)
        else:
            w = rng.standard_normal(shape, dtype=np.float32) * np.float32(gain / np.sqrt(shape[-1]))
        if dtype == "bfloat16":
            tensors[name] = ("BF16", shape, _f32_to_bf16_bits(w).astype("<u2").tobytes())
        else:
            tensors[name] = ("F32", shape, w.astype("<f4").tobytes())
    write_safetensors(out / "model.safetensors", tensors)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_tokenizer_files(out, model_max_length=config["max_position_embeddings"])
    return out


def write_tokenizer_files(out: Path, *, model_max_length: int) -> None:
    """Write the byte-level tokenizer (ids 0-255 bytes, 256 <s>, 257 </s>; `_tokenizer_json`) and
    a greedy generation_config.json into the model directory `out`, as transformers and mlx-lm
    read them offline. A model using it needs a vocabulary of at least VOCAB_SIZE ids."""
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.json").write_text(_tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "add_bos_token": True, "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }, indent=2, sort_keys=True) + "\n")


#: the model `kafila-ctl demo` uses when given no --model.
DEMO_PARAMS = {"arch": "llama", "seed": 0, "num_hidden_layers": 6, "hidden_size": 64}


def default_synth_model_dir(cache_dir: Optional[str | Path] = None, **params) -> Path:
    """The demo's synthetic model, created once under the user cache dir and reused.

    The directory name carries a hash of the parameters and SYNTH_FORMAT_VERSION, so a change of
    either makes a new one. Creation writes to a temporary sibling and renames it, so concurrent
    callers (several daemons starting at once) never see a half-written model.

    Args:
        cache_dir: where to keep it; default `platformdirs.user_cache_dir("kafila")/models`.
        params: overrides of DEMO_PARAMS (any `synthesize_model` keyword).
    """
    import platformdirs

    p = {**DEMO_PARAMS, **params}
    key = hashlib.sha256(json.dumps({"v": SYNTH_FORMAT_VERSION, **p}, sort_keys=True).encode()).hexdigest()[:16]
    base = Path(cache_dir) if cache_dir else Path(platformdirs.user_cache_dir("kafila")) / "models"
    target = base / f"synth-{p['arch']}-{key}"
    if (target / "tokenizer_config.json").exists():
        return target
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=base))
    try:
        synthesize_model(tmp, **p)
        os.replace(tmp, target)
    except OSError:
        if not (target / "tokenizer_config.json").exists():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(model_dir: str | Path):
    """The serving tokenizer of a local model dir (`encode`, `decode`, `eos_token_ids` with every
    id config.json and generation_config.json declare, `continuation_detokenizer`); see
    kafilad/executor/tokenizer.py. Reads only local files."""
    from kafilad.executor.tokenizer import load_tokenizer as _load

    return _load(model_dir)


def synthesize_mlx_model(out_dir: str | Path, config: dict, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a random model of any mlx-lm architecture: config.json and model.safetensors only
    (no tokenizer), for timing stages at a real architecture's shapes (scripts/validate_cost_model.py,
    issue 21 item 4).

    The model is the architecture's own mlx-lm class built from its own `ModelArgs` (`config`) with
    the class's random initialisation (seeded by `seed`), its weights saved under mlx-lm's parameter
    names (experts already stacked, as `sanitize` leaves them), so `load_stage_from_dir` loads it as
    it loads any checkpoint. Routers of mixture-of-experts blocks get random weights
    (kafilad.executor.probe.spread_routers; mlx-lm initialises some to zeros), so tokens spread over
    the experts as a trained router spreads them.

    Args:
        config: a config.json mlx-lm can build (its `model_type` names the class).
        dtype: the stored float dtype ("float32", "bfloat16", "float16").
    Returns:
        out_dir as a Path.
    Raises:
        ValueError: a model_type mlx-lm lacks.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from kafilad.executor.probe import spread_routers
    from kafilad.executor.stage import mx_dtype
    from kafilad.planner.moe import moe_spec

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx_dtype(dtype))
    spec = moe_spec(config)
    if spec is not None:
        spread_routers(model, spec.num_experts, seed=seed)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2, sort_keys=True) + "\n")
    return out
