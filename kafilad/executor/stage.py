"""One pipeline stage: a contiguous block range [start, end) of a model, run by mlx-lm's own code (DESIGN §6).

mlx-lm's own architecture class defines the model (`mlx_lm.models.<model_type>.Model`), and a
stage runs that class's own `__call__` (issue 21 item 1): its embedding and scales, its masks and
cache kinds per block, its final norm and output with multipliers, soft-caps and tied weights.
Nothing architecture-specific is re-implemented here. A stage keeps the whole model except what
other stages hold: other stages' blocks become parameterless placeholders in the model's
`layers` list (as mlx-lm's own models/pipeline.py keeps the list's numbering with None), and a
stage that is not the head has placeholders for the embedding, final norm and output projection.
Each pass feeds the arriving hidden state to the stage's first block and ends the model's forward
after its last block (see `Stage`). Checkpoint keys keep their block numbers, the class's
`sanitize` runs on them as mlx_lm.load runs it, quantisation follows the config (with mlx-lm's
per-module overrides), and loading is `strict=True`, so a missing or surplus tensor is an error,
never a silent random weight.

Shapes: hidden states are (B, L, D) float arrays (B rows, L tokens, D = hidden_size); logits are
(B, V).

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

import copy
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.utils import _get_classes, infer_quant_config

from kafilad.errors import ModelFormatError
from kafilad.modelinfo import FLOAT_DTYPES, TensorInfo, block_of, read_model_info

#: safetensors dtype -> numpy dtype of the stored bytes (little-endian). BF16 is read as uint16.
_NP_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}


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


class _StageDone(Exception):
    """Raised by the wrapper of a stage's last block to end the model's forward there; carries
    that block's output (the rest of the model's `__call__` belongs to later stages)."""

    def __init__(self, out: Any):
        super().__init__("stage done")
        self.out = out


def _first_array(out: Any) -> mx.array:
    """The hidden state in a block's output: the output itself, or its first element when the
    block returns a tuple (Gemma 4's blocks return (h, shared_kv, offset))."""
    return out[0] if isinstance(out, tuple) else out


def _scalar_attrs(module: nn.Module) -> dict[str, Any]:
    """A block's plain attributes (bools, ints, floats, strings, None) that a model's `__call__`
    may read from its blocks (`use_sliding`, `is_linear`, `layer_type`, `block_type`, ...),
    including properties of its class."""
    out = {k: v for k, v in vars(module).items()
           if not k.startswith("_") and (v is None or isinstance(v, (bool, int, float, str)))}
    for name in dir(type(module)):
        if name.startswith("_") or name in out or not isinstance(getattr(type(module), name, None), property):
            continue
        try:
            v = getattr(module, name)
        except Exception:  # noqa: BLE001 - a property that needs state the block lacks: not copied
            continue
        if v is None or isinstance(v, (bool, int, float, str)):
            out[name] = v
    return out


class _Skip(nn.Module):
    """Stands in the model's `layers` list for a block another stage holds: no parameters, the
    original block's plain attributes (so the model's own `__call__` still reads `use_sliding`,
    `is_linear`, ... and builds the right masks), and its input passed through unchanged in the
    block's output structure (`arity` elements when the block returns a tuple)."""

    def __init__(self, like: nn.Module, arity: int = 1):
        super().__init__()
        object.__setattr__(self, "_attrs", _scalar_attrs(like))
        object.__setattr__(self, "_arity", arity)
        object.__setattr__(self, "_inject", None)

    def fed(self, h: mx.array) -> "_Skip":
        """A copy that outputs h whatever its input: the output of the model's last block, for
        `Stage.logits`."""
        out = copy.copy(self)
        object.__setattr__(out, "_inject", h)
        return out

    def __getattr__(self, name: str):
        attrs = self.__dict__.get("_attrs")
        if attrs is not None and name in attrs:
            return attrs[name]
        return super().__getattr__(name)

    def __call__(self, x, *args, **kwargs):
        h = x if self._inject is None else self._inject
        return h if self._arity == 1 else (h,) + (None,) * (self._arity - 1)


class _Run:
    """A held block for one forward pass: optionally replaces its input with the hidden state
    that arrived from the previous stage, hands its output to MLX's evaluation at once (so MLX
    computes block i while Python builds block i+1, as mlx-lm's generate_step overlaps steps),
    and optionally ends the forward after it (`_StageDone`). Reads of other attributes go to the
    block itself."""

    def __init__(self, block: nn.Module, inject: Optional[mx.array] = None, last: bool = False):
        self._block = block
        self._inject = inject
        self._last = last

    def __getattr__(self, name: str):
        return getattr(self._block, name)

    def __call__(self, x, *args, **kwargs):
        out = self._block(x if self._inject is None else self._inject, *args, **kwargs)
        mx.async_eval(_first_array(out))
        if self._last:
            raise _StageDone(out)
        return out


class _Absent(nn.Module):
    """Stands, on a stage that is not the head, for a module outside the blocks that holds
    weights (the embedding, the final norm, the output projection): no parameters. Called on
    token ids it returns zeros of the embedding's shape (B, L, dims): the model's own `__call__`
    needs a hidden state of the right shape to build its masks, and the stage replaces it with
    the arriving activations before the first block, so the zeros are never computed."""

    def __init__(self, dims: int):
        super().__init__()
        object.__setattr__(self, "_dims", dims)
        object.__setattr__(self, "_dtype", mx.float32)

    def __call__(self, x, *args, **kwargs):
        if mx.issubdtype(x.dtype, mx.integer):  # in the stage's dtype, as the embedding's output would be
            return mx.zeros((*x.shape, self._dims), dtype=self._dtype)
        return x


def _layer_owner(model: nn.Module) -> nn.Module:
    """The module whose `layers` list holds the transformer blocks (`model.model` for most of
    mlx-lm, `model.language_model.model` for multimodal checkpoints, `model.backbone` for
    Nemotron-H), found breadth first.

    Raises:
        ModelFormatError: no module holds a `layers` list.
    """
    queue = [model]
    while queue:
        m = queue.pop(0)
        if isinstance(m.get("layers"), list) and m["layers"] and all(isinstance(x, nn.Module) for x in m["layers"]):
            return m
        queue.extend(v for v in m.values() if isinstance(v, nn.Module))
    raise ModelFormatError(f"mlx-lm model class {type(model).__name__} has no `layers` list a stage can divide.")


def _weight_leaves(model: nn.Module, skip: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, module) for every module outside `skip` (the blocks' list owner's
    `layers`) that holds arrays itself: the parts a non-head stage does not hold."""
    out = []

    def walk(m: nn.Module) -> None:
        for name, v in m.items():
            if m is skip and name == "layers":
                continue
            if isinstance(v, nn.Module):
                if any(isinstance(x, mx.array) and not k.startswith("_") for k, x in v.items()):
                    out.append((m, name, v))
                else:
                    walk(v)
    walk(model)
    return out


def _cache_kind(c: Any) -> tuple:
    """What makes two mlx-lm caches interchangeable for building masks: class and settings
    (window, kept tokens, state slots), not contents."""
    attrs = []
    for k, v in sorted(vars(c).items()):
        if k.startswith("_") or k in ("offset", "keys", "values"):
            continue
        if v is None or isinstance(v, (bool, int, float, str)):
            attrs.append((k, v))
        elif isinstance(v, list):
            attrs.append((k, len(v)))
    return (type(c).__name__, tuple(attrs))


def _hidden_size(model: nn.Module, config: dict) -> int:
    """The width D of the hidden state: the config's hidden_size, else the token embedding's width
    (its weight is lazily initialised at this point, so reading its shape computes nothing)."""
    size = (config.get("text_config") or config).get("hidden_size")
    if size:
        return int(size)
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return int(m.weight.shape[1])
    raise ModelFormatError("The model's config names no hidden_size and its class has no token embedding.")


class Stage:
    """A built, loaded stage: blocks [start, end) of a model, run by the model's own mlx-lm code.

    The model is mlx-lm's own architecture class, whole except for what other stages hold: its
    `layers` list keeps every position (so each block keeps its checkpoint name and index, and a
    model's `__call__` that builds masks or picks a cache by block index still finds them), with
    `_Skip` placeholders where other stages' blocks were; a stage that is not the head also holds
    `_Absent` placeholders for the embedding, the final norm and the output projection. Every
    pass calls the model's own `__call__`, so its embedding scales, masks per block kind, cache
    kinds, multipliers, soft-caps and tied outputs are mlx-lm's, never re-implemented here:

    - `run_tokens(ids, cache)` (head): the forward from token ids, ended after the stage's last
      block;
    - `run_blocks(h, cache)`: the forward with h (the previous stage's output) replacing the
      input of the stage's first block, ended after its last block;
    - `logits(h)` (head): the forward with h as the output of the model's last block, so only
      what the model does after its blocks (final norm, output projection, logit scaling and
      soft-capping) runs.

    Caches: `make_cache()` gives this stage's caches, one per held block (mlx-lm's own kinds,
    from the model's own `make_cache`). During a pass, a block position held elsewhere is given
    a held cache of the same kind, so the model's mask and offset reads see this stage's state.

    Attributes:
        start, end: the block range [start, end) of the whole model this stage holds.
        head: whether it holds the embedding, final norm and output projection (then start == 0).
        model: the mlx-lm `Model`.
        config: the model's config.json.
        dtype: the float dtype this stage computes in.
    """

    def __init__(self, model: nn.Module, config: dict, start: int, end: int, head: bool, *,
                 blocks: list[nn.Module], skips: list[_Skip], cache_templates: list, hidden_size: int):
        self.model = model
        self.config = config
        self.start = start
        self.end = end
        self.head = head
        self._owner = _layer_owner(model)
        self._blocks = blocks  # held blocks, block start + i at index i
        self._n_run = len(blocks)  # blocks a pass runs (a prefix: the probe times fewer)
        self._skips = skips  # one per model position
        self._templates = cache_templates  # the model's own make_cache(), fresh
        self.hidden_size = hidden_size
        #: indices into the model's cache list that this stage's blocks use, in order (a model's
        #: list need not follow block positions: Nemotron-H's skips its MLP blocks, Gemma 4's
        #: ends before its KV-shared blocks)
        self._held = self._held_cache_indices()
        kinds = [_cache_kind(c) for c in cache_templates]
        held_kind = {}
        for p, k in enumerate(self._held):
            held_kind.setdefault(kinds[k], p)
        #: cache index -> position in this stage's cache list standing in for it (None: a spare)
        self._stand_in = [held_kind.get(kind) for kind in kinds]
        for p, k in enumerate(self._held):
            self._stand_in[k] = p
        self._spares: list = [None] * len(cache_templates)
        self.dtype = _float_dtype(model)
        for m in model.modules():
            if isinstance(m, _Absent):  # a model may take dtypes from its embedding (Ministral 3's attention scale)
                object.__setattr__(m, "_dtype", self.dtype)

    @property
    def prefix_cacheable(self) -> bool:
        """Whether every cache the model makes is mlx-lm's plain KVCache, which a prompt cache can cut
        back to any prefix (kafilad/executor/prefix.py); the same answer on every stage of a ring."""
        return bool(self._templates) and all(type(c) is KVCache for c in self._templates)

    @property
    def layers(self) -> list[nn.Module]:
        """The blocks a pass runs: this stage's held blocks (a prefix of them after a set)."""
        return self._blocks[:self._n_run]

    @layers.setter
    def layers(self, blocks: list[nn.Module]) -> None:
        """Run only a prefix of the held blocks (the probe times 1 and 2 blocks of a stage)."""
        if list(blocks) != self._blocks[:len(blocks)] or not blocks:
            raise ValueError("A stage runs a non-empty prefix of its own blocks.")
        self._n_run = len(blocks)

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

    def _held_cache_indices(self) -> list[int]:
        """Which entries of the model's cache list this stage's blocks are given, read from one
        pass of the model's own `__call__` in which every block position records the cache it
        receives (nothing runs: every position is a placeholder)."""
        seen: dict[int, Optional[int]] = {}
        index_of = {id(c): k for k, c in enumerate(self._templates)}
        owner = self._owner

        def recorder(i: int):
            skip = self._skips[i]

            class _Recorder:
                def __getattr__(self, name):
                    return getattr(skip, name)

                def __call__(self, x, *args, **kwargs):
                    seen[i] = next((index_of[id(v)] for v in (*args, *kwargs.values()) if id(v) in index_of), None)
                    if i == last:  # what follows the blocks is not needed here
                        raise _StageDone(None)
                    return skip(x)
            return _Recorder()

        last = len(self._skips) - 1
        kept = owner["layers"]
        owner["layers"] = [recorder(i) for i in range(len(self._skips))]
        try:
            self.model(mx.zeros((1, 1), dtype=mx.int32), cache=list(self._templates))
        except _StageDone:
            pass
        finally:
            owner["layers"] = kept
        return [k for i in range(self.start, self.end) if (k := seen.get(i)) is not None]

    def make_cache(self) -> list:
        """Fresh caches for this stage's blocks: mlx-lm's own kinds (the model's `make_cache`),
        one per held block that keeps one, in block order (a block without a cache, as
        Nemotron-H's MLP blocks and Gemma 4's KV-shared blocks, has none)."""
        return [copy.deepcopy(self._templates[k]) for k in self._held]

    def _full_cache(self, cache: Optional[list]) -> Optional[list]:
        """The model-wide cache list for one pass: this stage's caches where its blocks look, a
        held cache of the same kind (or a spare of that kind, at the same offset) elsewhere, so
        the model's own mask and offset reads see this stage's state."""
        if cache is None:
            return None
        offset = next((c.offset for c in cache if hasattr(c, "offset")), None)
        full = []
        for k, p in enumerate(self._stand_in):
            if p is not None and p < len(cache):
                full.append(cache[p])
                continue
            spare = self._spares[k]
            if spare is None:
                spare = self._spares[k] = copy.deepcopy(self._templates[k])
            if offset is not None and hasattr(spare, "offset"):
                spare.offset = offset
            full.append(spare)
        return full

    def _forward(self, inputs: mx.array, cache: Optional[list], calls: list) -> Any:
        """Call the model's own `__call__` on `inputs` with its blocks list replaced by `calls`
        for this pass. Returns the `_StageDone` output, or the model's output if none ended it."""
        owner = self._owner
        kept = owner["layers"]
        owner["layers"] = calls
        try:
            return self.model(inputs, cache=self._full_cache(cache))
        except _StageDone as done:
            return done.out
        finally:
            owner["layers"] = kept

    def _calls(self, inject: Optional[mx.array]) -> list:
        """The blocks list of a pass through this stage's blocks (the first one fed `inject`
        when given, the last one ending the pass)."""
        calls = list(self._skips)
        n = self._n_run
        for i, block in enumerate(self._blocks[:n]):
            calls[self.start + i] = _Run(block, inject if i == 0 else None, last=i == n - 1)
        return calls

    def run_tokens(self, ids: list[int] | mx.array, cache: Optional[list]) -> mx.array:
        """Head: the model's forward from token ids through this stage's blocks, updating `cache`.

        ids: L token ids, or an integer array (L,) or (B, L) of them (possibly lazy, e.g. a
        sampler's output, so sampling and the next step are one graph). Returns (B, L, D) in
        the stage's dtype; call mx.eval.
        Raises:
            ModelFormatError: not the head.
        """
        self._need_head("run from token ids")
        if isinstance(ids, mx.array):
            x = ids.astype(mx.int32)
            x = x.reshape(1, -1) if x.ndim < 2 else x
        else:
            x = mx.array(ids, dtype=mx.int32)[None]
        return self.cast_in(_first_array(self._forward(x, cache, self._calls(None))))

    def run_blocks(self, h: mx.array, cache: Optional[list]) -> mx.array:
        """Run this stage's blocks on hidden states h (B, L, D) from the previous stage, updating
        `cache` (this stage's caches, `make_cache`).

        The model's own forward runs with h in place of its first block's input, so masks,
        offsets and per-block kinds are the model's own and the result is bit-identical to the
        same blocks inside the whole model. h is first cast to the stage's dtype (`cast_in`).
        Returns (B, L, D) in the stage's dtype; call mx.eval.
        """
        h = self.cast_in(h)
        dummy = mx.zeros(h.shape[:2], dtype=mx.int32)
        return _first_array(self._forward(dummy, cache, self._calls(h)))

    def logits(self, h: mx.array, *, all_positions: bool = False) -> mx.array:
        """What the model does after its blocks (final norm, output projection with its
        multipliers, soft-caps or tied embedding), on the last position of h (B, L, D), cast to
        the stage's dtype first. Returns (B, V); with `all_positions`, every position's: (B, L, V)
        (a speculative pass's verification, kafilad/proto/speculation.py). Head only."""
        self._need_head("compute logits")
        last = self.cast_in(h if all_positions else h[:, -1:, :])
        calls = list(self._skips)
        calls[-1] = self._skips[-1].fed(last)
        out = self._forward(mx.zeros(last.shape[:2], dtype=mx.int32), None, calls)
        return out if all_positions else out[:, -1, :]

    @property
    def speculation_refusal(self) -> Optional[str]:
        """Why a speculative pass cannot run on this model, or None: its extra positions must be
        trimmed back out of every cache the model makes (mlx-lm's `can_trim_prompt_cache`), and a
        RotatingKVCache stops being trimmable once past its window. The same answer on every stage."""
        from mlx_lm.models.cache import RotatingKVCache, can_trim_prompt_cache
        bad = sorted({type(c).__name__ for c in self._templates
                      if isinstance(c, RotatingKVCache) or not can_trim_prompt_cache([c])})
        if bad:
            return (f"this model's {', '.join(bad)} caches cannot be trimmed back after a rejected draft, "
                    "so it decodes one token per pass")
        return None

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
    """Quantise the modules whose checkpoint carries `.scales`, as mlx_lm.utils.load_model does
    (per-module overrides in the config's "quantization" entry, keyed by the module's path)."""
    q = config.get("quantization") or config.get("quantization_config")
    if not q or "bits" not in q:
        return
    per_layer = config.get("quantization", {})

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized"):  # also the placeholders of parts other stages hold
            return False
        if path in per_layer and isinstance(per_layer[path], dict):
            return per_layer[path]
        if f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(model, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"),
                class_predicate=predicate)


def _block_arity(block: nn.Module, hidden_size: int) -> int:
    """How many values the block's `__call__` returns (1 for an array; Gemma 4's return a
    3-tuple), read from a lazy call on one zero token that is never evaluated."""
    try:
        out = block(mx.zeros((1, 1, hidden_size)), None, None)
    except Exception:  # noqa: BLE001 - a block that cannot run alone (it needs a shared cache): an array
        return 1
    return len(out) if isinstance(out, tuple) else 1


def _set_arity(skips: list[_Skip], block: nn.Module, hidden_size: int) -> None:
    """Give every placeholder the output structure of the model's blocks (`_block_arity`)."""
    arity = _block_arity(block, hidden_size)
    for s in skips:
        object.__setattr__(s, "_arity", arity)


def _divided_model(config: dict, start: int, end: int, head: bool):
    """mlx-lm's model for `config` with only blocks [start, end) (and the head's parts if
    `head`) left to load. Returns (model, held blocks, skips, cache templates, hidden size).

    Nothing is computed: mlx-lm initialises parameters lazily, and the parts dropped here are
    never evaluated.
    Raises:
        ModelFormatError: bad range, or an architecture mlx-lm lacks.
    """
    n_layers = int((config.get("text_config") or config).get("num_hidden_layers") or config["num_hidden_layers"])
    if not 0 <= start < end <= n_layers:
        raise ModelFormatError(f"Block range [{start}, {end}) is not within the model's {n_layers} blocks.")
    if head and start != 0:
        raise ModelFormatError(f"The head holds the first blocks; [{start}, {end}) does not start at block 0.")
    try:
        model_class, args_class = _get_classes(config)
    except ValueError as e:
        raise ModelFormatError(f"mlx-lm does not support model_type {config.get('model_type')!r}: {e}") from e
    model = model_class(args_class.from_dict(config))
    owner = _layer_owner(model)
    layers = list(owner["layers"])
    if len(layers) != n_layers:
        raise ModelFormatError(f"mlx-lm's {config.get('model_type')} model has {len(layers)} blocks where the "
                               f"config says {n_layers}.")
    hidden_size = _hidden_size(model, config)
    templates = make_prompt_cache(model)
    blocks = layers[start:end]
    skips = [_Skip(layer) for layer in layers]
    owner["layers"] = [blocks[i - start] if start <= i < end else skips[i] for i in range(n_layers)]
    if not head:
        for parent, name, module in _weight_leaves(model, owner):
            dims = int(module.weight.shape[-1]) if isinstance(module, nn.Embedding) else hidden_size
            parent[name] = _Absent(dims)
    return model, blocks, skips, templates, hidden_size


def _sanitized(model: nn.Module, weights: dict[str, mx.array], checkpoint: Optional[list], start: int, end: int,
               head: bool) -> dict[str, mx.array]:
    """This stage's tensors after the model's own `sanitize`, run as mlx_lm.load runs it: over
    the whole checkpoint. The tensors other stages hold are lazy zeros of their shapes (never
    computed), since mlx-lm's sanitize functions decide by what the checkpoint holds (Mixtral
    stacks experts when block 0 has unstacked ones; Qwen3.5 and Qwen3-Next shift norms by one when
    any conv1d weight is in Hugging Face's layout). Of the result, the stage keeps its blocks'
    parameters, and the head's parts on the head."""
    if not hasattr(model, "sanitize"):
        return weights
    if not checkpoint:
        return model.sanitize(dict(weights))
    full = dict(weights)
    for name, dtype, shape in checkpoint:
        if name not in full:
            full[name] = mx.zeros(tuple(shape), dtype=_PLACEHOLDER_DTYPES.get(dtype, mx.uint8))
    out = model.sanitize(full)

    def held(key: str) -> bool:
        b = block_of(key)
        return head if b is None else start <= b < end
    return {k: v for k, v in out.items() if held(k)}


#: safetensors dtype -> the MLX dtype of a stand-in for a tensor another stage holds (F8: bytes)
_PLACEHOLDER_DTYPES = {"F64": mx.float32, "F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16,
                       "I64": mx.int64, "I32": mx.int32, "I16": mx.int16, "I8": mx.int8, "U64": mx.uint64,
                       "U32": mx.uint32, "U16": mx.uint16, "U8": mx.uint8, "BOOL": mx.bool_}


def build_stage(config: dict, start: int, end: int, head: bool, weights: dict[str, mx.array], *,
                checkpoint: Optional[list] = None) -> Stage:
    """Build the stage holding blocks [start, end) (plus head parts if `head`) and load `weights`.

    Args:
        config: the model's config.json.
        start, end: block range, 0 <= start < end <= num_hidden_layers.
        head: also hold the embedding, final norm and lm_head (DESIGN §2); then start is 0.
        weights: exactly this stage's tensors, keyed by checkpoint names (`model.layers.7...`):
            the model's own `sanitize` maps them to its module names, as mlx_lm.load does.
        checkpoint: every tensor of the checkpoint as [name, safetensors dtype, shape]
            (`ModelInfo.checkpoint_shapes`, the `plan` frame's "checkpoint"), so `sanitize` sees
            the whole checkpoint (`_sanitized`); None: it sees this stage's tensors only.
    Raises:
        ModelFormatError: bad range, unsupported architecture, or tensors that do not match the
            stage (missing or surplus), naming them.
    """
    model, blocks, skips, templates, hidden = _divided_model(config, start, end, head)
    weights = _sanitized(model, dict(weights), checkpoint, start, end, head)
    _quantize(model, config, weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        msg = " ".join(str(e).split())
        raise ModelFormatError(f"Weights for stage [{start}, {end}) head={head} do not fit the model: {msg}") from e
    model.eval()
    mx.eval(model.parameters())
    _set_arity(skips, blocks[0], hidden)
    return Stage(model, config, start, end, head, blocks=blocks, skips=skips, cache_templates=templates,
                 hidden_size=hidden)


def build_random_stage(config: dict, n_blocks: int, *, dtype: Optional[str] = "float32") -> Stage:
    """A non-head stage of blocks [0, n_blocks) with the mlx-lm class's own random initialisation.

    Same architecture, shapes, dtype and quantisation as the real model, so its timing stands for
    the real blocks' (probe.measure_stage_Bps). Not for inference.
    """
    model, blocks, skips, templates, hidden = _divided_model(config, 0, n_blocks, False)
    if dtype is not None:
        model.set_dtype(mx_dtype(dtype))
    q = config.get("quantization")
    if isinstance(q, dict) and "bits" in q:
        nn.quantize(model, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"))
    model.eval()
    mx.eval(model.parameters())
    _set_arity(skips, blocks[0], hidden)
    return Stage(model, config, 0, n_blocks, False, blocks=blocks, skips=skips, cache_templates=templates,
                 hidden_size=hidden)


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
    return build_stage(info.config, start, end, head, weights, checkpoint=info.checkpoint_shapes())
