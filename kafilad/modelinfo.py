"""Read a model directory's config.json and safetensors headers, never the tensor data.

A safetensors file is (https://huggingface.co/docs/safetensors, "Format"):

```
 0        8                    8+N                                  EOF
 +--------+--------------------+-------------------------------------+
 | N u64le| JSON header, N bytes| tensor data (offsets relative here) |
 +--------+--------------------+-------------------------------------+
 header: {name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}
```

Sharded checkpoints list files in `model.safetensors.index.json` (`weight_map`: name -> file).
The tensor data may be absent or a sparse hole: only headers are read here. Used by the planner
CLI (block and head byte counts, DESIGN §5.1), the host (byte ranges to serve, DESIGN §6) and the
executor (which tensors a stage loads).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Optional

import attrs

from kafilad.errors import ModelFormatError
from kafilad.planner import moe
from kafilad.planner.precision import DTYPE_BYTES as STAGE_DTYPE_BYTES
from kafilad.planner.records import ModelProfile
from kafilad.planner.workmem import arch_from_config

#: bytes per element of each safetensors dtype.
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
#: safetensors float dtype -> the MLX dtype a stage holds it in when kept as stored (F64 and the
#: F8 formats have no MLX stage dtype: float32 and bfloat16 stand for them).
STAGE_DTYPE_OF = {"F64": "float32", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                  "F8_E4M3": "bfloat16", "F8_E5M2": "bfloat16"}
MAX_HEADER_BYTES = 100 * 1024 * 1024
_BLOCK_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_HEAD_MARKERS = ("embed_tokens", "lm_head", "norm.weight", "norm.bias", "wte", "output.weight")


@attrs.frozen
class TensorInfo:
    """One tensor's place on disk.

    Attributes:
        name: checkpoint key, e.g. "model.layers.3.mlp.up_proj.weight".
        file: file name relative to the model directory.
        dtype: safetensors dtype string ("F32", "BF16", "U32", ...).
        shape: tensor shape.
        offset_bytes: absolute offset of the data in `file`.
        nbytes: stored size in bytes.
        block: transformer block index, or None for head parts.
    """

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int
    nbytes: int
    block: Optional[int]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def held_bytes(self, float_dtype_bytes: Optional[int]) -> int:
        """Bytes this tensor occupies once loaded; floats are cast to `float_dtype_bytes` if given."""
        if float_dtype_bytes is not None and self.dtype in FLOAT_DTYPES:
            return self.numel * float_dtype_bytes
        return self.nbytes


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """Read one safetensors header.

    Returns:
        (header dict without "__metadata__", data_start_bytes).
    Raises:
        ModelFormatError: truncated file, oversized or malformed header.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ModelFormatError(f"{path} is not a safetensors file: shorter than 8 bytes.")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise ModelFormatError(f"{path}: safetensors header of {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit.")
            body = f.read(n)
    except OSError as e:
        raise ModelFormatError(f"Cannot read {path}: {e.strerror}.") from e
    if len(body) != n:
        raise ModelFormatError(f"{path}: safetensors header is truncated ({len(body)} of {n} bytes).")
    try:
        header = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: safetensors header is not valid JSON ({e}).") from e
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: safetensors header is not a JSON object.")
    header.pop("__metadata__", None)
    return header, 8 + n


@attrs.frozen
class ModelInfo:
    """A model directory's config and tensor table (headers only).

    Attributes:
        model_dir: the directory.
        config: parsed config.json.
        tensors: name -> TensorInfo, in checkpoint order.
    """

    model_dir: Path
    config: dict
    tensors: dict

    @property
    def model_id(self) -> str:
        return self.model_dir.name

    @property
    def num_hidden_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def head_dim(self) -> int:
        c = self.config
        return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])

    @property
    def num_key_value_heads(self) -> int:
        c = self.config
        return int(c.get("num_key_value_heads") or c["num_attention_heads"])

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False)) or not any(
            "lm_head" in n for n in self.tensors)

    @property
    def moe(self) -> Optional[moe.MoeSpec]:
        """E and k of a mixture-of-experts model (kafilad.planner.moe), None for a dense one.

        Raises:
            ModelFormatError: a config that routes each token to more experts than there are.
        """
        try:
            return moe.moe_spec(self.config)
        except ValueError as e:
            raise ModelFormatError(f"{self.model_dir / 'config.json'}: {e}") from e

    def block_tensors(self, block: int) -> list[TensorInfo]:
        """Tensors of transformer block `block` (0-based)."""
        return [t for t in self.tensors.values() if t.block == block]

    def head_tensors(self) -> list[TensorInfo]:
        """Tensors that are not in any block: embedding, final norm, lm_head."""
        return [t for t in self.tensors.values() if t.block is None]

    def checkpoint_shapes(self) -> list[list]:
        """Every tensor of the checkpoint as [name, safetensors dtype, shape]: what a stage's
        mlx-lm `sanitize` must see beside its own tensors (kafilad/executor/stage.py
        `build_stage`; the `plan` frame's "checkpoint", proto_spec 05 §2)."""
        return [[t.name, t.dtype, list(t.shape)] for t in self.tensors.values()]

    def stage_tensors(self, start: int, end: int, head: bool) -> list[TensorInfo]:
        """Tensors a stage holding blocks [start, end) (plus head parts if `head`) loads."""
        out = [t for t in self.tensors.values() if t.block is not None and start <= t.block < end]
        if head:
            out += self.head_tensors()
        return out

    @property
    def float_dtype(self) -> str:
        """The checkpoint's float dtype as a stage dtype ("bfloat16", "float16", "float32"): the
        stored float dtype of the most bytes of block weights (of all tensors when there are no
        blocks), "float32" when there are no float tensors. Members on Metal and CUDA hold it
        (kafilad.planner.precision)."""
        by_dtype: dict[str, int] = {}
        tensors = [t for t in self.tensors.values() if t.block is not None] or list(self.tensors.values())
        for t in tensors:
            if t.dtype in FLOAT_DTYPES:
                by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
        if not by_dtype:
            return "float32"
        stored = max(sorted(by_dtype), key=lambda k: by_dtype[k])
        return STAGE_DTYPE_OF[stored]

    def profiles(self, dtypes) -> dict[str, ModelProfile]:
        """{dtype: profile()} with floats held in each of `dtypes` (stage dtype names), the KV
        cache and working memory in it too: the planner's per-device view (kafilad.planner.precision).

        Raises:
            ModelFormatError: a name that is not a stage dtype.
        """
        out = {}
        for dt in dtypes:
            if dt not in STAGE_DTYPE_BYTES:
                raise ModelFormatError(f"A stage holds float32, bfloat16 or float16, not {dt!r}.")
            out[dt] = self.profile(float_dtype_bytes=STAGE_DTYPE_BYTES[dt])
        return out

    def profile(self, float_dtype_bytes: Optional[int] = None, kv_dtype_bytes: Optional[int] = None) -> ModelProfile:
        """Byte profile for the planner (DESIGN §5.1).

        Block bytes count every tensor of a block; the bytes a token reads of a mixture-of-experts
        block (`block_read_bytes`) and its FLOPs count its routed experts times experts per token
        / experts (kafilad.planner.moe).

        Args:
            float_dtype_bytes: bytes per element the executor holds floats in (4 for f32), or None
                to count bytes as stored.
            kv_dtype_bytes: bytes per KV element; defaults to float_dtype_bytes, else the stored
                dtype of the first block's weights.
        """
        L = self.num_hidden_layers
        block_bytes = [0] * L
        block_params = [0] * L
        held: list[list[tuple[str, int]]] = [[] for _ in range(L)]
        params: list[list[tuple[str, int]]] = [[] for _ in range(L)]
        for t in self.tensors.values():
            if t.block is not None and t.block < L:
                nb = t.held_bytes(float_dtype_bytes)
                block_bytes[t.block] += nb
                held[t.block].append((t.name, nb))
                params[t.block].append((t.name, t.numel))
        spec = self.moe
        block_read = [moe.read_bytes(ts, spec) for ts in held]
        block_params = [moe.read_bytes(ps, spec) for ps in params]  # active weights: 2 FLOP each
        embed = [t for t in self.head_tensors() if "embed" in t.name or t.name.endswith("wte.weight")]
        lm_head = [t for t in self.head_tensors() if "lm_head" in t.name]
        norm = [t for t in self.head_tensors() if t not in embed and t not in lm_head]
        size = lambda ts: sum(t.held_bytes(float_dtype_bytes) for t in ts)  # noqa: E731
        out_proj = lm_head if lm_head else embed  # tied: the embedding matrix is the output projection
        head_read = size(out_proj) + size(norm)
        head_resident = size(embed) + size(lm_head) + size(norm)
        if kv_dtype_bytes is None:
            if float_dtype_bytes is not None:
                kv_dtype_bytes = float_dtype_bytes
            else:
                first = [t for t in self.block_tensors(0) if t.dtype in FLOAT_DTYPES]
                kv_dtype_bytes = DTYPE_BYTES[first[0].dtype] if first else 2
        if self.config.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3, Kimi K2): mlx-lm
            # caches the compressed latent and the rope key, one of each per token (deepseek_v3.py)
            kv = (int(self.config["kv_lora_rank"]) + int(self.config.get("qk_rope_head_dim") or 0)) * kv_dtype_bytes
        else:
            kv = 2 * self.num_key_value_heads * self.head_dim * kv_dtype_bytes
        head_params = sum(t.numel for t in out_proj)
        return ModelProfile(
            model_id=self.model_id,
            block_bytes=tuple(block_bytes),
            head_read_bytes=head_read,
            head_resident_bytes=head_resident,
            kv_bytes_per_block_token=kv,
            block_flops_per_token=tuple(2.0 * p for p in block_params),
            head_flops_per_token=2.0 * head_params,
            shape=arch_from_config(self.config, kv_dtype_bytes),
            block_read_bytes=tuple(block_read) if block_read != block_bytes else (),
        )


def unsplittable_reason(config: dict) -> Optional[str]:
    """Why mlx-lm's own code for this model cannot be divided into stages, or None when it can.

    Stages run each architecture's own mlx-lm forward (kafilad/executor/stage.py) and pass one
    hidden state (B, L, D) from stage to stage (proto_spec 02 §4.2). An architecture whose blocks
    also read something made outside the blocks from the token ids, or another block's KV
    cache, cannot be divided at a block boundary that way:

    - Gemma 4 (and 3n) per-layer inputs: with `hidden_size_per_layer_input` > 0 every block reads
      its slice of per-layer token embeddings that the model computes before the first block;
    - Gemma 4 KV sharing: with `num_kv_shared_layers` > 0 the last blocks reuse earlier blocks'
      keys and values within one forward pass.

    Such a model is served by one member (`--members 1`). Pure: reads the config only (text
    fields at the top, as `read_model_info` flattens them).
    """
    model_type = str(config.get("model_type", ""))
    if not model_type.startswith(("gemma4", "gemma3n")):
        return None
    if int(config.get("hidden_size_per_layer_input") or 0) > 0:
        return (f"its blocks read per-layer token embeddings ({model_type} hidden_size_per_layer_input="
                f"{config['hidden_size_per_layer_input']}) that the model computes from the token ids before "
                f"its first block, so no block boundary can divide it")
    if int(config.get("num_kv_shared_layers") or 0) > 0:
        return (f"its last {config['num_kv_shared_layers']} blocks reuse the keys and values of earlier blocks "
                f"within one pass ({model_type} num_kv_shared_layers), which do not cross from one stage to the next")
    return None


def block_of(name: str) -> Optional[int]:
    """The block index in a tensor or parameter name (`...layers.N....`), or None for the head's
    parts (embedding, final norm, output) and anything else outside the blocks."""
    m = _BLOCK_RE.search(name)
    return int(m.group(1)) if m else None


def read_model_info(model_dir: str | Path) -> ModelInfo:
    """Read config.json and every safetensors header of a model directory.

    Accepts a single `model.safetensors`, several `*.safetensors`, or a sharded layout with
    `model.safetensors.index.json`.

    Raises:
        ModelFormatError: missing config or weights, malformed headers, tensors past end of data.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelFormatError(f"{model_dir} is not a directory; give the model directory "
                               f"(the one holding config.json and *.safetensors).")
    cfg_path = model_dir / "config.json"
    try:
        config = json.loads(cfg_path.read_text())
    except FileNotFoundError as e:
        raise ModelFormatError(f"{model_dir} has no config.json; is it a model directory?") from e
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{cfg_path} is not valid JSON ({e}).") from e
    if "text_config" in config and "num_hidden_layers" not in config:
        # a multimodal checkpoint (Gemma 3, Mistral 3, Qwen3.5): the text model's sizes at the top
        # for the planner, while model_type stays the checkpoint's own, whose mlx-lm class reads
        # text_config and maps the `language_model.`-prefixed tensors (its sanitize)
        config = {**config, **config["text_config"], "model_type": config["model_type"]}
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
        if key not in config:
            raise ModelFormatError(f"{cfg_path} lacks '{key}'.")
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelFormatError(f"{index} is malformed: {e}.") from e
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{model_dir} holds no *.safetensors weights.")
    tensors: dict[str, TensorInfo] = {}
    for fname in files:
        header, data_start = read_safetensors_header(model_dir / fname)
        for name, meta in header.items():
            try:
                dtype = meta["dtype"]
                shape = tuple(int(s) for s in meta["shape"])
                begin, end = (int(x) for x in meta["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise ModelFormatError(f"{fname}: tensor {name!r} has a malformed header entry.") from e
            if dtype not in DTYPE_BYTES or end < begin:
                raise ModelFormatError(f"{fname}: tensor {name!r} has dtype {dtype!r} or offsets {begin}..{end} we cannot read.")
            tensors[name] = TensorInfo(name, fname, dtype, shape, data_start + begin, end - begin, block_of(name))
    return ModelInfo(model_dir=model_dir, config=config, tensors=tensors)
