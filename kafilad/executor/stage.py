"""One pipeline stage: a contiguous block range [start, end) of a model, built from mlx-lm (DESIGN §6).

mlx-lm's own architecture class defines the model (`mlx_lm.models.<model_type>.Model`). A stage
instantiates it, prunes `model.layers` to [start, end), drops the embedding, final norm and
lm_head unless it is the head, renames the checkpoint keys `model.layers.{i}.` to
`model.layers.{i-start}.`, runs the class's `sanitize`, quantises if the config says so and loads
with `strict=True`, so a missing or surplus tensor is an error, never a silent random weight.

Shapes: hidden states are (B, L, D) float arrays (B = 1 per request, L tokens, D = hidden_size);
logits are (B, V).

Precision (issue 12 item 4, kafilad/planner/precision.py): a stage holds its float weights in
one dtype, the one the plan gave it: float32 on CPU members when it fits (DESIGN §6: MLX's bf16
CPU kernels are slow and the optimised BLAS only speeds up f32), the checkpoint's own on Metal and
CUDA; dtype=None keeps the stored dtype. `Stage.dtype` is that dtype, and a stage casts incoming
hidden states to it before its blocks and its output projection (`Stage.cast_in`), so stages of
different dtypes can follow each other on a ring: activations cross the wire in the sender's
dtype (proto_spec 02 §4.2) and are cast on entry. A cast from float32 to float32 is none, so an
all-f32 ring stays bit-identical to single-process mlx-lm.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes, infer_quant_config

from kafilad.errors import ModelFormatError
from kafilad.modelinfo import FLOAT_DTYPES, TensorInfo, read_model_info

#: safetensors dtype -> numpy dtype of the stored bytes (little-endian). BF16 is read as uint16.
_NP_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
_LAYER_KEY = re.compile(r"^(.*?\blayers\.)(\d+)(\..*)$")
_LAYER_IN_TEXT = re.compile(r"\blayers\.(\d+)\.")


def mx_dtype(name: str) -> mx.Dtype:
    """The MLX dtype called `name` ("float32", "bfloat16", "float16").

    Raises:
        ModelFormatError: unknown name.
    """
    dt = getattr(mx, name, None)
    if not isinstance(dt, mx.Dtype):
        raise ModelFormatError(f"Unknown activation dtype {name!r}; use float32, bfloat16 or float16.")
    return dt


def tensor_from_bytes(info: TensorInfo, data: bytes, *, dtype: Optional[str] = "float32") -> mx.array:
    """Build an MLX array from a tensor's raw safetensors bytes (DESIGN §6 byte-range fetch).

    Args:
        info: the tensor's header entry (dtype, shape, nbytes).
        data: exactly `info.nbytes` little-endian bytes.
        dtype: cast floating tensors to this MLX dtype name; None keeps the stored dtype.
            Integer tensors (packed quantised weights, U32) are never cast.
    Returns:
        An array of shape `info.shape`.
    Raises:
        ModelFormatError: wrong byte count or a dtype MLX cannot hold (F8).
    """
    if len(data) != info.nbytes:
        raise ModelFormatError(
            f"Tensor {info.name} should be {info.nbytes} bytes but {len(data)} arrived; the shard is corrupt or truncated.")
    np_dtype = _NP_DTYPES.get(info.dtype)
    if np_dtype is None:
        raise ModelFormatError(f"Tensor {info.name} has dtype {info.dtype}, which the executor cannot load.")
    arr = np.frombuffer(data, dtype=np.dtype(np_dtype).newbyteorder("<")).reshape(info.shape)
    out = mx.array(arr)
    if info.dtype == "BF16":
        out = out.view(mx.bfloat16)
    if dtype is not None and info.dtype in FLOAT_DTYPES:
        out = out.astype(mx_dtype(dtype))
    return out


def rename_for_stage(weights: dict[str, Any], start: int) -> dict[str, Any]:
    """Renumber block keys `...layers.{i}.rest` to `...layers.{i-start}.rest`.

    Raises:
        ModelFormatError: a block index below `start` (the caller passed another stage's tensors).
    """
    out = {}
    for key, value in weights.items():
        m = _LAYER_KEY.match(key)
        if m:
            i = int(m.group(2)) - start
            if i < 0:
                raise ModelFormatError(f"Tensor {key} belongs to a block before this stage's first block {start}.")
            key = f"{m.group(1)}{i}{m.group(3)}"
        out[key] = value
    return out


def _inner(model: nn.Module) -> nn.Module:
    """The module that owns `layers`, `embed_tokens` and `norm` (`model.model` in mlx-lm)."""
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module) and "layers" in inner:
        return inner
    if "layers" in model:
        return model
    raise ModelFormatError(f"mlx-lm model class {type(model).__name__} has no `layers` list a stage can prune.")


class Stage:
    """A built, loaded stage. Use `build_stage` or `load_stage_from_dir` to make one.

    Attributes:
        start, end: the block range [start, end) of the whole model this stage holds.
        head: whether it holds the embedding, final norm and output projection.
        model: the pruned mlx-lm `Model` (its `layers` are this stage's blocks, renumbered from 0).
        config: the model's config.json.
    """

    def __init__(self, model: nn.Module, config: dict, start: int, end: int, head: bool):
        self.model = model
        self.config = config
        self.start = start
        self.end = end
        self.head = head
        self._inner = _inner(model)
        self.layers = list(self._inner.layers)
        self._sliding_window = getattr(self._inner, "sliding_window", None) or config.get("sliding_window")
        #: the float dtype this stage computes in (its float parameters' dtype, the most bytes of them)
        self.dtype = _float_dtype(model)

    @property
    def dtype_name(self) -> str:
        """`dtype` as its wire name: "float32", "bfloat16" or "float16" (proto_spec 02 §4.1)."""
        return str(self.dtype).rsplit(".", 1)[-1]

    def cast_in(self, h: mx.array) -> mx.array:
        """h in this stage's dtype (the array itself when it already is; lazily otherwise)."""
        return h if h.dtype == self.dtype else h.astype(self.dtype)

    @property
    def n_blocks(self) -> int:
        return self.end - self.start

    def nbytes(self) -> int:
        """Bytes of parameters this stage holds in memory."""
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    def make_cache(self) -> list:
        """A fresh KV cache per block of this stage (mlx-lm's own cache classes)."""
        return make_prompt_cache(self.model)

    def embed(self, ids: list[int] | mx.array) -> mx.array:
        """Token embedding. ids: L token ids, or an integer array of them (possibly lazy, e.g. a
        sampler's output, so that sampling and the next embedding are one graph). Returns (1, L, D).
        Head only."""
        self._need_head("embed")
        if isinstance(ids, mx.array):
            return self._inner.embed_tokens(ids.astype(mx.int32).reshape(1, -1))
        return self._inner.embed_tokens(mx.array(ids, dtype=mx.int32)[None])

    def run_blocks(self, h: mx.array, cache: Optional[list]) -> mx.array:
        """Run this stage's blocks on hidden states h (B, L, D), updating `cache` (one per block).

        The attention masks are made as mlx-lm's model makes them (`create_attention_mask` from
        the first full-attention block's cache; sliding-window blocks get a windowed mask), so
        the result is bit-identical to the same blocks inside the whole model. h is first cast to
        the stage's dtype (`cast_in`). Returns (B, L, D) in the stage's dtype; call mx.eval.

        Each block's output is handed to MLX's evaluation (`mx.async_eval`) as soon as its graph is
        built, so MLX computes block i while Python builds block i+1 (as mlx-lm's generate_step
        overlaps a step's graph with the previous step's evaluation): the same operations, so the
        same bits, and about 0.7 ms less per step on this VM for 8 blocks of hidden 512 (issue 12).
        """
        h = self.cast_in(h)
        if cache is None:
            cache = [None] * len(self.layers)
        full_mask = swa_mask = None
        full_done = swa_done = False
        for layer, c in zip(self.layers, cache):
            if getattr(layer, "use_sliding", False):
                if not swa_done:
                    swa_mask = create_attention_mask(h, c, window_size=self._sliding_window)
                    swa_done = True
                mask = swa_mask
            else:
                if not full_done:
                    full_mask = create_attention_mask(h, c)
                    full_done = True
                mask = full_mask
            h = layer(h, mask, c)
            mx.async_eval(h)
        return h

    def logits(self, h: mx.array) -> mx.array:
        """Final norm and output projection of the last position. h: (B, L, D), cast to the stage's
        dtype first. Returns (B, V) in the stage's dtype."""
        self._need_head("logits")
        x = self._inner.norm(self.cast_in(h[:, -1:, :]))
        if "lm_head" in self.model:
            out = self.model.lm_head(x)
        else:
            out = self._inner.embed_tokens.as_linear(x)
        return out[:, -1, :]

    def _need_head(self, what: str) -> None:
        if not self.head:
            raise ModelFormatError(f"Stage [{self.start}, {self.end}) is not the head and cannot {what}.")


def _float_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of most bytes of `model`'s floating-point parameters (float32 when it has none)."""
    from mlx.utils import tree_flatten

    by_dtype: dict = {}
    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            by_dtype[v.dtype] = by_dtype.get(v.dtype, 0) + v.nbytes
    if not by_dtype:
        return mx.float32
    return max(by_dtype, key=lambda d: (by_dtype[d], d.size))


def _quantize(model: nn.Module, config: dict, weights: dict) -> None:
    """Quantise the modules whose checkpoint carries `.scales`, as mlx_lm.utils.load_model does."""
    q = config.get("quantization") or config.get("quantization_config")
    if not q or "bits" not in q:
        return
    per_layer = config.get("quantization", {})

    def predicate(path: str, module: nn.Module):
        if path in per_layer and isinstance(per_layer[path], dict):
            return per_layer[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(model, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"),
                class_predicate=predicate)


def build_stage(config: dict, start: int, end: int, head: bool, weights: dict[str, mx.array]) -> Stage:
    """Build the stage holding blocks [start, end) (plus head parts if `head`) and load `weights`.

    Args:
        config: the model's config.json.
        start, end: block range, 0 <= start < end <= num_hidden_layers.
        head: also hold the embedding, final norm and lm_head (DESIGN §2).
        weights: exactly this stage's tensors, keyed by checkpoint names (`model.layers.7...`).
    Raises:
        ModelFormatError: bad range, unsupported architecture, or tensors that do not match the
            pruned model (missing or surplus), naming them.
    """
    n_layers = int(config["num_hidden_layers"])
    if not 0 <= start < end <= n_layers:
        raise ModelFormatError(f"Block range [{start}, {end}) is not within the model's {n_layers} blocks.")
    try:
        model_class, args_class = _get_classes(config)
    except ValueError as e:
        raise ModelFormatError(f"mlx-lm does not support model_type {config.get('model_type')!r}: {e}") from e
    model = model_class(args_class.from_dict(config))
    inner = _inner(model)
    inner.layers = inner.layers[start:end]
    if not head:
        for owner, name in ((inner, "embed_tokens"), (inner, "norm"), (model, "lm_head")):
            if name in owner:
                delattr(owner, name)
    weights = rename_for_stage(dict(weights), start)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    _quantize(model, config, weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:  # name tensors by checkpoint block index again, on one line
        msg = _LAYER_IN_TEXT.sub(lambda m: f"layers.{int(m.group(1)) + start}.", " ".join(str(e).split()))
        raise ModelFormatError(f"Weights for stage [{start}, {end}) head={head} do not fit the model: {msg}") from e
    model.eval()
    mx.eval(model.parameters())
    return Stage(model, config, start, end, head)


def build_random_stage(config: dict, n_blocks: int, *, dtype: Optional[str] = "float32") -> Stage:
    """A non-head stage of blocks [0, n_blocks) with the mlx-lm class's own random initialisation.

    Same architecture, shapes, dtype and quantisation as the real model, so its timing stands for
    the real blocks' (probe.measure_stage_Bps). Not for inference.
    """
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    inner = _inner(model)
    inner.layers = inner.layers[:n_blocks]
    for owner, name in ((inner, "embed_tokens"), (inner, "norm"), (model, "lm_head")):
        if name in owner:
            delattr(owner, name)
    if dtype is not None:
        model.set_dtype(mx_dtype(dtype))
    q = config.get("quantization")
    if isinstance(q, dict) and "bits" in q:
        nn.quantize(model, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"))
    model.eval()
    mx.eval(model.parameters())
    return Stage(model, config, 0, n_blocks, False)


def read_tensor_bytes(model_dir: Path, info: TensorInfo) -> bytes:
    """Read one tensor's bytes from its safetensors file by offset (no other tensor is read).

    Raises:
        ModelFormatError: the file is shorter than the header says.
    """
    with open(Path(model_dir) / info.file, "rb") as f:
        f.seek(info.offset_bytes)
        data = f.read(info.nbytes)
    if len(data) != info.nbytes:
        raise ModelFormatError(f"{info.file} is truncated: tensor {info.name} needs {info.nbytes} bytes at offset {info.offset_bytes}.")
    return data


def load_stage_from_dir(model_dir: str | Path, start: int, end: int, head: bool, *,
                        dtype: Optional[str] = "float32") -> Stage:
    """Build a stage from a local model directory, reading only its own tensors by byte range.

    Args:
        model_dir: Hugging Face layout (config.json, *.safetensors).
        start, end, head: as in `build_stage`.
        dtype: float weights are cast to this (DESIGN §6); None keeps the stored dtype.
    Raises:
        ModelFormatError: as `read_model_info` and `build_stage`.
    """
    info = read_model_info(model_dir)
    weights = {t.name: tensor_from_bytes(t, read_tensor_bytes(info.model_dir, t), dtype=dtype)
               for t in info.stage_tensors(start, end, head)}
    return build_stage(info.config, start, end, head, weights)
