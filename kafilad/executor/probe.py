"""Measure what this member can give the model: memory and effective bandwidth (DESIGN §5.1).

- `available_memory_bytes`: on Apple silicon the Metal recommended working-set size; elsewhere
  min(MemAvailable from /proc/meminfo, the tightest cgroup (v1 or v2) limit − usage on this
  process's cgroup path), minus a reserve for the runtime.
- `measure_bandwidth_Bps`: an MLX matrix-vector product in the model's dtype (x @ W.T, the op a
  decode step's Linear layers run at batch 1), bytes of W / median time. A plain `mx.sum` probe
  reads about half of what real decode achieves on CPU; the matrix-vector probe predicted stage
  time within ~20% here (DESIGN §5.1).
- `measure_stage`: times blocks of the session's architecture and shape at batch 1 (one
  block, then two; random weights, so only config.json is needed; window means, DESIGN §9) and
  splits the time into a fixed per-step overhead and an effective bytes/s (DESIGN §5.1 "Best"; medians
  of paired rounds, more rounds while a time-sliced CPU scatters them);
  in the same rounds it times a 4-row batched decode step (mlx-lm batch caches, as the runner's
  `run_batch`) against the one-row step for rho, `batch_row_cost` (issue 12; docs/planner.md
  "Throughput"). `measure_stage_Bps` is its batch-1 part.
- `measure_capability`: the report a member sends the host (issue 2 item 5), with the dtype its
  backend runs fastest with and the one it may fall back to (issue 12 item 4): Metal and CUDA
  the checkpoint's float dtype, CPU float32 and, for a narrower checkpoint, that as the fallback
  when an f32 stage does not fit (the planner decides per stage: kafilad/planner/precision.py).
  The bandwidth is measured in the reported dtype.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Optional

import attrs
import mlx.core as mx

from kafilad.planner import moe
from kafilad.planner.precision import DEFAULT_DTYPE, backend_dtypes
from kafilad.planner.throughput import batch_row_cost_of

#: memory kept back for the Python runtime, MLX's allocator slack and transfer buffers (bytes).
DEFAULT_RESERVE_BYTES = 256 * 1024 * 1024
#: size of the probe matrix: larger than the last-level caches of consumer CPUs (32 MiB here).
DEFAULT_PROBE_BYTES = 64 * 1024 * 1024
#: shortest timed window per block count in `measure_stage_Bps` (25 periods of a 10 ms CFS quota).
DEFAULT_STAGE_WINDOW_S = 0.25
#: rows of the batched decode step the capability probe times for rho (issue 12; a small decode batch)
DEFAULT_BATCH_ROWS = 4
#: the batched step's timed window, as a fraction of DEFAULT_STAGE_WINDOW_S: chunks as long as the one-row
#: ones (at 0.3, 15 ms chunks under a 10 ms CFS period read rho anywhere in 0.01-0.12, docs/cost-model.md)
DEFAULT_BATCH_WINDOW_FRACTION = 1.0
#: `measure_stage` runs further rounds while a chunk mean's relative standard error is above this
DEFAULT_STABLE_WITHIN = 0.02
#: ... up to this many rounds in all (5 base rounds: at most 3x the base window)
DEFAULT_MAX_ROUNDS = 15
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _meminfo_available_bytes() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _cgroup_dirs() -> list[tuple[Path, str, str]]:
    """(directory, limit file, usage file) for this process's memory cgroup and its ancestors."""
    out = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2 unified hierarchy
            base, limit, usage = _CGROUP_ROOT, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit, usage = _CGROUP_ROOT / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        d = base / rel.lstrip("/")
        while True:
            out.append((d, limit, usage))
            if d == base or base not in d.parents:
                break
            d = d.parent
    return out


def cgroup_headroom_bytes() -> Optional[int]:
    """min over this process's memory cgroups (and their ancestors) of limit − usage, or None."""
    best = None
    for d, limit_file, usage_file in _cgroup_dirs():
        limit = _read_int(d / limit_file)
        usage = _read_int(d / usage_file)
        if limit is None or usage is None or limit >= 1 << 60:  # v1 "unlimited" is ~2^63
            continue
        room = max(0, limit - usage)
        best = room if best is None else min(best, room)
    return best


def available_memory_bytes(reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> int:
    """Bytes this member can give the model (weights + KV cache), DESIGN §5.1 `memory_bytes`.

    When MLX's device reports a `max_recommended_working_set_size` (Metal): that less what MLX
    already holds. Otherwise: min(MemAvailable, cgroup limit − usage); on CUDA this is host RAM,
    not free VRAM (MLX exposes no free-VRAM figure we rely on yet). Then minus `reserve_bytes`,
    floored at 0.
    Memory already used by this process (the runtime, a loaded stage) is not counted as available.
    """
    room: Optional[int] = None
    working_set = mx.device_info().get("max_recommended_working_set_size")  # Metal reports it
    if working_set:
        room = int(working_set) - int(mx.get_active_memory())
    else:
        candidates = [v for v in (_meminfo_available_bytes(), cgroup_headroom_bytes()) if v is not None]
        if candidates:
            room = min(candidates)
    if room is None:
        return 0
    return max(0, room - reserve_bytes)


def _median_time_s(fn, repeats: int) -> float:
    fn()  # warm-up: allocation, BLAS thread start
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_bandwidth_Bps(dtype: str = "float32", nbytes: int = DEFAULT_PROBE_BYTES, repeats: int = 5) -> float:
    """Effective weight-read bandwidth of an MLX matrix-vector product in `dtype` (bytes/s).

    Args:
        dtype: the dtype the executor holds weights in ("float32" on CPU, DESIGN §6).
        nbytes: approximate size of the probe matrix (a square n x n).
        repeats: timed runs; the median is returned.
    Returns:
        bytes of the matrix / median seconds per product.
    """
    dt = getattr(mx, dtype)
    n = max(64, int((nbytes / dt.size) ** 0.5))
    w = mx.full((n, n), 0.5, dtype=dt)
    x = mx.full((1, n), 1.0, dtype=dt)
    mx.eval(w, x)
    t = _median_time_s(lambda: mx.eval(x @ w.T), repeats)
    return n * n * dt.size / t


def _relative_se(chunks: list[tuple[float, int]]) -> float:
    """Relative standard error of the mean of per-chunk seconds per call (inf with < 2 chunks)."""
    means = [s / n for s, n in chunks]
    if len(means) < 2 or statistics.fmean(means) <= 0:
        return float("inf")
    return statistics.stdev(means) / statistics.fmean(means) / len(means) ** 0.5


def _interleaved_chunks_s(fns, min_steps: int, windows_s: list[float], rounds: int = 5, *,
                          stable_within: float = 0.0, max_rounds: Optional[int] = None,
                          watched: Optional[int] = None) -> list[list[tuple[float, int]]]:
    """(seconds, calls) of each timed chunk of each of `fns`, run in alternating chunks (DESIGN §9 item 4).

    Function i runs back to back in chunks of windows_s[i] / rounds, the functions taking turns
    (round r runs chunk r of every function not yet done), until each has run >= windows_s[i] in
    total and >= `min_steps` calls. Interleaving makes a burst of interference from a neighbour
    land on every function alike, so their difference, or their ratio round by round, stays clean.

    On a time-sliced CPU (a busy machine's scheduler, a CPU quota) a chunk's end falls anywhere in
    a time slice, so each chunk mean is off by up to one descheduled gap / chunk length. With
    `stable_within` > 0 further rounds (every function one more chunk) run while the relative
    standard error of the chunk means of any of the first `watched` functions (default all) is
    above it, up to `max_rounds` rounds in all (default 3 x `rounds`): a quiet CPU stops at
    `rounds`, a jittery one runs longer.

    Returns:
        per function, its chunks as (seconds, calls).
    """
    for fn in fns:
        fn()  # warm-up
    steps = [0] * len(fns)
    spent = [0.0] * len(fns)
    chunks: list[list[tuple[float, int]]] = [[] for _ in fns]
    watched = len(fns) if watched is None else watched
    max_rounds = 3 * rounds if max_rounds is None else max_rounds

    def run_chunk(i: int, fn) -> None:
        chunk_s = windows_s[i] / rounds
        t0 = time.perf_counter()
        calls = 0
        while True:
            fn()
            calls += 1
            el = time.perf_counter() - t0
            if el >= chunk_s:
                break
        steps[i] += calls
        spent[i] += el
        chunks[i].append((el, calls))

    while any(s < w or n < min_steps for s, w, n in zip(spent, windows_s, steps)):
        for i, fn in enumerate(fns):
            if spent[i] >= windows_s[i] and steps[i] >= min_steps:
                continue
            run_chunk(i, fn)
    while (stable_within > 0 and min(len(c) for c in chunks) < max_rounds
           and any(_relative_se(c) > stable_within for c in chunks[:watched])):
        for i, fn in enumerate(fns):
            run_chunk(i, fn)
    return chunks


def _interleaved_window_means_s(fns, min_steps: int, window_s: float, rounds: int = 5) -> list[float]:
    """Mean seconds per call of each of `fns`, timed in alternating chunks (`_interleaved_chunks_s`,
    every function with the window `window_s`).

    Window means, not medians of single calls: on a time-sliced CPU (a cgroup quota, a busy
    machine) single steps are bimodal and a median of a few picks one mode.
    """
    chunks = _interleaved_chunks_s(fns, min_steps, [window_s] * len(fns), rounds)
    return [sum(s for s, _ in c) / sum(n for _, n in c) for c in chunks]


@attrs.frozen
class StageTiming:
    """What `measure_stage` read off blocks of the session's architecture (DESIGN §5.1).

    Attributes:
        bandwidth_Bps: effective bytes/s of the blocks' weights at batch 1.
        step_overhead_s: fixed seconds per decode step, >= 0.
        batch_row_cost: rho, the extra cost of each further row of a batched decode step as a
            fraction of a one-row step (kafilad/planner/throughput.py), in [0, 1]; None when not
            measured.
    """

    bandwidth_Bps: float
    step_overhead_s: float
    batch_row_cost: Optional[float] = None


def _rewind(cache: list) -> None:
    """Take the last decode step back out of each block's cache, so the context stays fixed
    across repeats (KVCache and BatchKVCache: `trim(1)`; a cache that cannot trim, such as an
    SSM state, just advances)."""
    for c in cache:
        if hasattr(c, "is_trimmable") and c.is_trimmable():
            c.trim(1)


def measure_stage(model: str | Path | dict, *, dtype: str = "float32", context_tokens: int = 16,
                  repeats: int = 3, window_s: float = DEFAULT_STAGE_WINDOW_S, batch_rows: int = 0,
                  batch_window_s: Optional[float] = None, stable_within: float = DEFAULT_STABLE_WITHIN,
                  max_rounds: int = DEFAULT_MAX_ROUNDS) -> StageTiming:
    """Time blocks of the session's architecture at batch 1, and optionally at `batch_rows` rows
    (DESIGN §5.1 "Best"; issue 12: rho).

    Only the config is needed (a member has not fetched any weights when it reports): two blocks
    of the model's own mlx-lm class are built with the class's random initialisation, held in
    `dtype` and quantised as the config says, then decode steps after a `context_tokens`
    prefill are run back to back through one block and through both, in alternating chunks, for
    >= `window_s` seconds and >= `repeats` steps each (5 rounds of chunks), and fitted as
    t(k blocks) = overhead + k * block_bytes / Bps: the per-block time is the median over rounds
    of (two-block chunk mean - one-block chunk mean of the same round), t(1) the median of the
    one-block chunk means, the overhead their difference (>= 0).

    On a time-sliced CPU (a busy machine, a CPU quota: DESIGN §9 item 4) a chunk's end falls
    anywhere in a time slice, so chunk means scatter by up to a descheduled gap / chunk length,
    and a two-point fit turns that into a per-block time off by tens of percent (measured at 20%
    of a core with a 10 ms CFS period: per-block time 6.2-13.1 ms over three 0.25 s probes,
    docs/cost-model.md "Probing under a quota"). So rounds continue while the relative standard
    error of any chunk mean (one-row or batched) is above `stable_within`, up to `max_rounds` rounds (at
    most 3x the window with the defaults): a quiet device stops after the first 5, and the
    medians of paired rounds drop a round a neighbour's burst hit.

    With `batch_rows` B >= 2, a B-row decode step through the same blocks is timed in the same
    rounds: the prefilled cache is merged B times into mlx-lm's batch caches (`merge`, as
    kafilad/executor/runner.py `run_batch` builds them), and its chunk mean is paired with the
    one-row chunk mean of the same round; `batch_row_cost_of` turns the pairs into rho (median of
    the ratios). Its window, `batch_window_s`, defaults to `window_s`, so that its chunks are as
    long as the one-row ones and its chunk means scatter as little (a third of the window made
    15 ms chunks, which a 10 ms quota period turned into rho anywhere in 0.01-0.12); its scatter
    counts for the further rounds too.

    Mixture-of-experts models (kafilad.planner.moe): the blocks are built with every block MoE
    (`moe.all_moe_config`: the MoE blocks make up most of such a model), routers that mlx-lm
    initialises to zeros get random weights (`spread_routers`), and each step takes the next of 64
    random one-token inputs (`token_inputs`; a batched step one per row), so that the router spreads
    the steps over the experts as it spreads real tokens. The bytes per block are those a token
    reads (`stage_read_bytes`: routed experts x experts per token / experts), the planner's
    `read_bytes`, so the bandwidth applies to them.

    Window means replaced medians of 7 single steps (scripts/validate_cost_model.py, eight runs on
    a shared 2-vCPU machine, docs/cost-model.md): the median-of-7 fit read a bandwidth-bound
    model at 2.8-5.2 GB/s from run to run, even with the CPU to itself; window means read
    4.4-5.4 GB/s.

    Args:
        model: a model directory (only config.json is read) or its config dict.
        repeats: the fewest timed steps per block count.
        window_s: the shortest timed window per block count, seconds.
        batch_rows: B, the rows of the batched step; below 2: rho is not measured.
        batch_window_s: the shortest timed window of the batched step, seconds.
    Returns:
        the StageTiming (batch_row_cost None when not measured, or when this architecture's
        caches cannot batch).
    Raises:
        ModelFormatError: unreadable config or an architecture mlx-lm lacks.
    """
    from kafilad.modelinfo import read_model_info

    config = model if isinstance(model, dict) else read_model_info(model).config
    blocks = ProbeBlocks(config, dtype=dtype, context_tokens=context_tokens)
    n = blocks.n
    fns = [blocks.step(k) for k in range(1, n + 1)]
    windows = [window_s] * len(fns)
    if batch_rows >= 2:
        batched = blocks.batched_step(batch_rows)
        if batched is not None:
            fns.append(batched)
            windows.append(DEFAULT_BATCH_WINDOW_FRACTION * window_s if batch_window_s is None else batch_window_s)
    chunks = _interleaved_chunks_s(fns, repeats, windows, stable_within=stable_within, max_rounds=max_rounds,
                                   watched=len(fns))
    rho = None
    if len(fns) > n:  # the batched step ran: pair its chunks with the n-block one-row chunks, round by round
        pairs = list(zip(chunks[n - 1], chunks[n]))
        rho = batch_row_cost_of([a[0] / a[1] for a, _ in pairs], [b[0] / b[1] for _, b in pairs], batch_rows)
    per_block_s, overhead_s = fit_block_overhead_s(chunks[0], chunks[1] if n == 2 else None)
    return StageTiming(blocks.per_block_bytes / per_block_s, overhead_s, rho)


class ProbeBlocks:
    """The random blocks `measure_stage` times and their decode steps (DESIGN §5.1 "Best").

    min(2, num_hidden_layers) blocks of the config's own mlx-lm class, random weights held in
    `dtype`, prefilled with `context_tokens` tokens; for a mixture-of-experts config built with
    every block MoE and routers spread (`measure_stage`). Each step takes the next of the
    `token_inputs` pool and rewinds its cache, so the context stays fixed.

    Attributes:
        n: blocks built (1 or 2). stage: the random Stage. layers: its blocks.
        per_block_bytes: bytes a token reads of one block (`stage_read_bytes` / n).
    Raises:
        ModelFormatError, ValueError: a config mlx-lm cannot build.
    """

    def __init__(self, config: dict, *, dtype: str = "float32", context_tokens: int = 16):
        from kafilad.executor.stage import build_random_stage

        self.n = min(2, int(config["num_hidden_layers"]))
        spec = moe.moe_spec(config)
        self.stage = build_random_stage(moe.all_moe_config(config), self.n, dtype=dtype)
        if spec is not None:
            spread_routers(self.stage.model, spec.num_experts)
        self.per_block_bytes = stage_read_bytes(self.stage.model, spec) / self.n
        D = int(config["hidden_size"])
        dt = getattr(mx, dtype)
        self.cache = self.stage.make_cache()
        mx.eval(self.stage.run_blocks(mx.zeros((1, context_tokens, D), dtype=dt), self.cache))
        self.inputs = token_inputs(D, dt)
        self.layers = self.stage.layers
        self._turn = 0

    def next_input(self, rows: int) -> mx.array:
        """The next `rows` of the input pool as (rows, 1, D): a MoE router sends consecutive steps
        (and a batch's rows) to different experts, as it does real tokens."""
        i, pool = self._turn, self.inputs
        self._turn += rows
        if rows == 1:
            return pool[i % len(pool)]
        return mx.concatenate([pool[(i + r) % len(pool)] for r in range(rows)])

    def step(self, k: int):
        """A function running one decode step through the first `k` blocks."""
        def one():
            self.stage.layers = self.layers[:k]
            mx.eval(self.stage.run_blocks(self.next_input(1), self.cache[:k]))
            _rewind(self.cache[:k])
            self.stage.layers = self.layers
        return one

    def batched_step(self, rows: int):
        """A function running one `rows`-row decode step through every block (mlx-lm batch caches
        merged from the prefilled ones), or None when this architecture's caches cannot batch."""
        try:
            batch_cache = [c.merge([c] * rows) for c in self.cache]
        except Exception:  # noqa: BLE001 - a cache type mlx-lm cannot batch: no rho, the rest stands
            return None

        def batched():
            self.stage.layers = self.layers
            mx.eval(self.stage.run_blocks(self.next_input(rows), batch_cache))
            _rewind(batch_cache)
        return batched


#: distinct one-token inputs the stage probe cycles through (a router's choices vary from step to step)
DEFAULT_INPUT_POOL = 64
#: seed of the probe's inputs and spread routers: every member times the same steps
PROBE_SEED = 0


def token_inputs(hidden_size: int, dtype: mx.Dtype, count: int = DEFAULT_INPUT_POOL,
                 seed: int = PROBE_SEED) -> list[mx.array]:
    """`count` one-token hidden states (1, 1, hidden_size) ~ N(0, 1) in `dtype`, evaluated: the
    probe's steps take them in turn, so that a mixture-of-experts router spreads the steps over its
    experts as it spreads real tokens (a constant input would send every step to the same k experts,
    which then stay in cache on a small model). A dense block reads the same bytes whatever its input."""
    key = mx.random.key(seed)
    pool = mx.random.normal((count, 1, 1, hidden_size), key=key).astype(dtype)
    mx.eval(pool)
    return [pool[i] for i in range(count)]


def spread_routers(model, num_experts: int, seed: int = PROBE_SEED) -> int:
    """Give every float router weight of `model` random values ~ N(0, 1/D), in place: mlx-lm
    initialises some routers to zeros (DeepSeek-V3's and GLM-4.5's `MoEGate`), and a zero router
    sends every token to the same experts. A router is a parameter named `...gate.weight` or
    `...router.weight` whose first dimension is `num_experts` (the routers of mlx-lm's MoE models).
    Quantised routers (integer weights) are left as the class's random init made them.

    Returns:
        how many router weights were replaced.
    """
    from mlx.utils import tree_flatten

    key = mx.random.key(seed + 1)
    new = []
    for name, v in tree_flatten(model.parameters()):
        if ((name.endswith(".gate.weight") or name.endswith(".router.weight")) and v.ndim == 2
                and v.shape[0] == num_experts and mx.issubdtype(v.dtype, mx.floating)):
            key, sub = mx.random.split(key)
            new.append((name, (mx.random.normal(v.shape, key=sub) / v.shape[1] ** 0.5).astype(v.dtype)))
    if new:
        model.load_weights(new, strict=False)
        mx.eval(model.parameters())
    return len(new)


def stage_read_bytes(model, spec: Optional[moe.MoeSpec]) -> int:
    """Bytes one token reads of `model`'s parameters (kafilad.planner.moe.read_bytes on their
    names: routed experts count experts per token / experts; a dense model all of its bytes)."""
    from mlx.utils import tree_flatten

    return moe.read_bytes(((name, v.nbytes) for name, v in tree_flatten(model.parameters())), spec)


def fit_block_overhead_s(one_block: list[tuple[float, int]],
                         two_blocks: Optional[list[tuple[float, int]]]) -> tuple[float, float]:
    """(seconds per block, fixed seconds per step >= 0) from the (seconds, calls) chunks of one-block
    and two-block steps, timed in alternating rounds (`_interleaved_chunks_s`).

    t(1) is the median of the one-block chunk means; the per-block time the median over rounds of
    the two-block minus the one-block chunk mean of the same round. Without two-block chunks, or
    when that difference is not positive (noise swamped a tiny block), there is no split: the
    whole t(1) is the block's and the overhead is 0.
    """
    t1 = statistics.median(s / k for s, k in one_block)
    if not two_blocks:
        return t1, 0.0
    per_block_s = statistics.median(b[0] / b[1] - a[0] / a[1] for a, b in zip(one_block, two_blocks))
    if per_block_s <= 0:
        return t1, 0.0
    return per_block_s, max(0.0, t1 - per_block_s)


def measure_stage_Bps(model: str | Path | dict, *, dtype: str = "float32", context_tokens: int = 16,
                      repeats: int = 3, window_s: float = DEFAULT_STAGE_WINDOW_S) -> tuple[float, float]:
    """`measure_stage` at batch 1 only: (effective bandwidth in bytes/s, fixed step overhead in
    seconds, >= 0). Same arguments and errors."""
    t = measure_stage(model, dtype=dtype, context_tokens=context_tokens, repeats=repeats, window_s=window_s)
    return t.bandwidth_Bps, t.step_overhead_s


def backend_name(device_type: str, metal_available: bool) -> str:
    """The MLX backend of a default device: "cpu", "metal" or "cuda".

    Args:
        device_type: "cpu" or "gpu" (`mx.default_device().type`'s name).
        metal_available: `mx.metal.is_available()`; a GPU that is not Metal is CUDA.
    """
    if device_type != "gpu":
        return "cpu"
    return "metal" if metal_available else "cuda"


def current_backend() -> str:
    """This process's MLX backend (`backend_name` of the default device)."""
    device_type = str(mx.default_device().type).rsplit(".", 1)[-1]
    return backend_name(device_type, bool(mx.metal.is_available()))


def checkpoint_dtype_of(model: Optional[str | Path | dict], given: Optional[str] = None) -> str:
    """The checkpoint's float dtype: `given` (the host's `admitted` frame) when set; else, for a
    model directory, its safetensors headers' (ModelInfo.float_dtype); else the config's
    `torch_dtype` when it names a stage dtype; else float32."""
    if given:
        return given
    if isinstance(model, (str, Path)):
        from kafilad.modelinfo import read_model_info
        try:
            return read_model_info(model).float_dtype
        except Exception:  # noqa: BLE001 - an unreadable directory fails later, where it is used
            return DEFAULT_DTYPE
    if isinstance(model, dict) and model.get("torch_dtype") in ("float32", "bfloat16", "float16"):
        return str(model["torch_dtype"])
    return DEFAULT_DTYPE


def measure_capability(model_dir: Optional[str | Path | dict] = None, *, dtype: Optional[str] = None,
                       checkpoint_dtype: Optional[str] = None, backend: Optional[str] = None,
                       reserve_bytes: int = DEFAULT_RESERVE_BYTES, batch_rows: int = DEFAULT_BATCH_ROWS) -> dict:
    """This member's capability report (issue 2 item 5; DESIGN §5.1). One to two seconds on small models,
    up to three times that on a time-sliced CPU (`measure_stage`'s further rounds).

    With `model_dir` (a directory, of which only config.json is read, or the config dict the host
    sent), bandwidth, step overhead and the batch row cost rho come from timing blocks of that
    architecture (`measure_stage`, a `batch_rows`-row decode step against the one-row step:
    issue 12); without it, or if that fails, the matrix-vector probe is used, the step overhead
    is 0 (the what-if default) and rho is None (unknown: the planner counts 1). Every member of a
    session should be given the same config, so that all are measured the same way.

    Args:
        dtype: the dtype to report and time; None chooses it (`backend_dtypes` of the backend and
            the checkpoint's dtype, `checkpoint_dtype_of`).
        checkpoint_dtype: the checkpoint's float dtype, when known (the host's `admitted` dtype).
        backend: "cpu", "metal" or "cuda"; None: this process's (`current_backend`).
        batch_rows: B of the batched step timed for rho (below 2: rho is not measured).
    Returns:
        {"memory_bytes": int, "bandwidth_Bps": float, "step_overhead_s": float,
         "batch_row_cost": float in [0, 1] | None, "dtype": str, "fallback_dtype": str | None,
         "backend": str, "bandwidth_source": "stage" | "gemv"}
    """
    backend = backend or current_backend()
    fallback = None
    if dtype is None:
        dtype, fallback = backend_dtypes(backend, checkpoint_dtype_of(model_dir, checkpoint_dtype))
    memory = available_memory_bytes(reserve_bytes)
    bw, overhead, rho, source = None, 0.0, None, "gemv"
    if model_dir is not None:
        try:
            timing = measure_stage(model_dir, dtype=dtype, batch_rows=batch_rows)
            bw, overhead, rho, source = timing.bandwidth_Bps, timing.step_overhead_s, timing.batch_row_cost, "stage"
        except Exception:  # noqa: BLE001 - a probe failure must not stop the member; fall back
            bw = None
    if bw is None:
        bw = measure_bandwidth_Bps(dtype)
    return {"memory_bytes": int(memory), "bandwidth_Bps": float(bw), "step_overhead_s": float(overhead),
            "batch_row_cost": rho, "dtype": dtype, "fallback_dtype": fallback, "backend": backend,
            "bandwidth_source": source}
