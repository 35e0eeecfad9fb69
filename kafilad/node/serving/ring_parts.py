"""Parts of the ring driver that hold no ring state (kafilad/node/serving/ring.py re-exports them).

The environment switches of the head's schedule (`KAFILA_BATCH`, `KAFILA_MICRO_BATCHES`), a
generation's `RequestState` as `RingMember.generate` returns it, the one MLX worker thread
(`run_on_mlx_thread`, DESIGN §6), the driver's calls into its StageRunner in the wire form
(`StageCalls`) and small helpers of the driver.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import attrs
import trio

from kafilad.proto.scheduler import Request
from kafilad.proto.sampling import Sampling

#: environment switch: "0" decodes every request in its own passes (no batching).
BATCH_ENV = "KAFILA_BATCH"
#: environment switch: pin the decode micro-batches in flight (kafilad/proto/step_policy.py)
MICRO_BATCHES_ENV = "KAFILA_MICRO_BATCHES"

def _env_value(environ, name: str, parse: Callable[[str], float], valid: Callable[[float], bool], must: str):
    """`environ[name]` parsed, None when unset or blank.

    Raises:
        ValueError: a value `parse` refuses or `valid` rejects ("<name> must be <must>, not '<raw>'.").
    """
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or not valid(value):
        raise ValueError(f"{name} must be {must}, not {raw!r}.")
    return value


def pinned_micro_batches(environ=os.environ) -> Optional[int]:
    """`KAFILA_MICRO_BATCHES=N` pins the decode micro-batches in flight (N ≥ 1); unset: chosen from
    measured stage times (kafilad/proto/step_policy.py).

    Raises:
        ValueError: a value that is not a positive integer (the daemon refuses to start with it).
    """
    return _env_value(environ, MICRO_BATCHES_ENV, int, lambda n: n >= 1, "a positive integer")


#: environment switch: the daemon process's GIL switch interval, in milliseconds
SWITCH_INTERVAL_ENV = "KAFILA_SWITCH_INTERVAL_MS"
#: the daemon's GIL switch interval when the environment does not say (s); None keeps Python's 5 ms
DAEMON_SWITCH_INTERVAL_S: Optional[float] = None


def daemon_switch_interval_s(environ=os.environ) -> Optional[float]:
    """The GIL switch interval a daemon process sets (`sys.setswitchinterval`), in seconds.

    A daemon runs its trio thread (links, QUIC, Noise) beside one MLX worker thread; with Python's
    5 ms interval a thread wanting the GIL may wait up to 5 ms while the other runs Python code.
    Only the daemon's own entry point (kafilad/main.py) sets it: a process with many threads (the
    in-process session tests) ran 2-5x slower with 0.2 ms. `KAFILA_SWITCH_INTERVAL_MS=X` (X > 0)
    sets X ms; unset: DAEMON_SWITCH_INTERVAL_S.

    Raises:
        ValueError: a value that is not a positive number (the daemon refuses to start with it).
    """
    ms = _env_value(environ, SWITCH_INTERVAL_ENV, float, lambda x: 0 < x <= 1000,
                    "a number of milliseconds in (0, 1000]")
    return DAEMON_SWITCH_INTERVAL_S if ms is None else ms / 1e3


#: schedule modes of `apply_schedule` (the control API's `schedule` op): besides these, an integer M ≥ 1
SCHEDULE_MODES = ("auto", "lockstep", "per-request")


def parse_schedule(mode) -> object:
    """A schedule mode as `apply_schedule` takes it: "auto", "lockstep", "per-request" or an int M ≥ 1
    (also given as a string of digits).

    Raises:
        ValueError: anything else, with a sentence.
    """
    if isinstance(mode, str) and mode.strip().lstrip("+-").isdigit():
        mode = int(mode.strip())
    if isinstance(mode, int) and not isinstance(mode, bool):
        if mode < 1:
            raise ValueError(f"A schedule of {mode} micro-batches is not possible; give 1 or more.")
        return mode
    if mode in SCHEDULE_MODES:
        return mode
    raise ValueError(f"Unknown schedule {mode!r}; give auto, lockstep, per-request or a number of micro-batches.")


def apply_schedule(scheduler, mode) -> None:
    """Set the head's decode schedule (kafilad/proto/scheduler.py, step_policy.py): "auto" (micro-batches
    chosen from measured stage times, the default), "lockstep" (M = 1), "per-request" (every request
    its own passes, as `KAFILA_BATCH=0`) or an int M (pinned, as `KAFILA_MICRO_BATCHES=M`).

    Raises:
        ValueError: a bad mode (parse_schedule), or requests running (the schedule changes between requests).
    """
    mode = parse_schedule(mode)
    if scheduler.requests:
        raise ValueError(f"The schedule changes between requests; {len(scheduler.requests)} are running now.")
    policy = scheduler.policy
    scheduler.batching = mode != "per-request"
    policy.pinned = {"auto": None, "lockstep": 1, "per-request": None}.get(mode, mode)
    policy.current = policy.pinned or 1
    policy.trials.clear()


def batching_enabled(environ=os.environ) -> bool:
    """Whether decode steps are batched (the default) or per request (`KAFILA_BATCH=0`)."""
    return environ.get(BATCH_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _record_view(name: str) -> property:
    return property(lambda self: getattr(self.record, name), doc=f"The scheduler record's `{name}`.")


@attrs.frozen
class FusedStep:
    """A next decode step the head ran with its sampling (one MLX call), not yet sent: the fused
    "sample and run the next step" (not speculative decoding, which is kafilad/node/serving/drafts.py).

    Attributes:
        reqs: the step's rows (request ids), in row order. tokens: the token sampled for each row.
        out: the head stage's output, as sent in an `act` frame's `h` (proto_spec 05 §3).
        dt_s: the head's compute time for the step (s).
        group: the micro-batch (`mb`) of a batched step; None for the single form (one request).
    """

    reqs: tuple
    tokens: tuple
    out: dict
    dt_s: float
    group: Optional[int]

    def matches(self, reqs, tokens, group: int) -> bool:
        """Whether the step the scheduler asks for (rows, tokens, micro-batch) is this one."""
        return (tuple(reqs) == self.reqs and tuple(tokens) == self.tokens
                and self.group in (None, group))

    def holds_only(self, req: str) -> bool:
        """Whether this is the single-form step of `req` alone."""
        return self.group is None and self.reqs == (req,)


@attrs.define(eq=False)
class RequestState:
    """A generation at the head, as `RingMember.generate` returns it.

    `text` is what was streamed (the detokenized `generated`); the statistics (`circuit_s`,
    `end_stats`, ...) are read from the scheduler's record (kafilad/proto/scheduler.py `Request`).
    """

    req: str
    detok: object
    events: trio.MemorySendChannel
    record: Optional[Request] = None
    text: str = ""
    done: trio.Event = attrs.field(factory=trio.Event)
    #: why the request was ended early (its client left or read too slowly), else None
    cancelled: Optional[str] = None
    #: tokens it had produced when it was ended early
    cancelled_at_tokens: Optional[int] = None
    #: it was ended through `RingMember.cancel` (its caller asked), not for a failing stream
    cancel_requested: bool = False

    prompt_ids = _record_view("prompt_ids")
    max_tokens = _record_view("max_tokens")
    temperature = _record_view("temperature")
    generated = _record_view("generated")
    reused_tokens = _record_view("reused_tokens")
    started_s = _record_view("started_s")
    first_token_s = _record_view("first_token_s")
    circuit_s = _record_view("circuit_s")
    hop_compute_s = _record_view("hop_compute_s")
    batch_rows = _record_view("batch_rows")
    end_stats = _record_view("end_stats")
    decode_passes = _record_view("decode_passes")
    drafted = _record_view("drafted")
    accepted = _record_view("accepted")
    error = _record_view("error")


_mlx_pool: Optional[ThreadPoolExecutor] = None


async def run_on_mlx_thread(fn, *args):
    """Run `fn(*args)` on this process's one MLX worker thread, off the trio thread (DESIGN §6).

    MLX binds a lazy array to a stream of the thread that built it ("There is no Stream(cpu, N)
    in current thread" when another thread evaluates it), and a StageRunner leaves lazy cache
    state behind (BatchKVCache `filter` on `drop`, `extract` when a request leaves a batch). All
    runner calls therefore run on one thread. Waits uncancellably, as `trio.to_thread.run_sync`.
    """
    global _mlx_pool
    if _mlx_pool is None:
        _mlx_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kafila-mlx")
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_fut) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass
    fut = _mlx_pool.submit(fn, *args)
    fut.add_done_callback(wake)
    with trio.CancelScope(shield=True):
        await done.wait()
    return fut.result()


def _recent(rec: Request, n: int) -> list[int]:
    """The last `n` ids of the request's prompt and generated tokens (what its penalties read)."""
    gen = rec.generated
    if len(gen) >= n:
        return list(gen[-n:])
    return list(rec.prompt_ids[len(rec.prompt_ids) - (n - len(gen)):] if n - len(gen) < len(rec.prompt_ids)
                else rec.prompt_ids) + list(gen)


def _plain(rec: Optional[Request]) -> Sampling:
    """The Sampling of a row whose request gave only a temperature (or that ended meanwhile)."""
    return Sampling(temperature=rec.temperature if rec is not None else 0.0)


class StageCalls:
    """RingMember's calls into its StageRunner (`self.runner`) that take and give activations in
    the wire form (`self.ex`: kafilad.executor.runner's array_to_wire / array_from_wire); each runs
    whole on the MLX thread (`RingMember._compute`)."""

    def _run_blocks_wire(self, req: str, h_wire: dict, trim: int = 0) -> dict:
        h = self.ex.array_from_wire(h_wire)
        self.runner.trim(req, trim)  # a speculative pass's rejected drafts first (proto_spec 05 §3.1)
        return self.ex.array_to_wire(self.runner.run(req, h))

    def _run_batch_wire(self, rids: list[str], h_wire: dict, group: int = 0, trims: tuple = ()) -> dict:
        h = self.ex.array_from_wire(h_wire)
        for r, n in zip(rids, trims):
            self.runner.trim(r, n)
        return self.ex.array_to_wire(self.runner.run_batch(rids, h, group))

    def _head_verify_wire(self, req: str, h_wire: dict, drafts: list, temperature: float) -> list:
        return self.runner.head_verify(req, self.ex.array_from_wire(h_wire), list(drafts), temperature)

    def _head_sample_batch_and_run_wire(self, rids: list[str], h_wire: dict, group: int) -> tuple:
        tokens, out = self.runner.head_sample_batch_and_run(rids, self.ex.array_from_wire(h_wire), group)
        return tokens, (self.ex.array_to_wire(out) if out is not None else None)

    def _head_sample_and_run_wire(self, req: str, h_wire: dict, temperature: float) -> tuple:
        token, out = self.runner.head_sample_and_run(req, self.ex.array_from_wire(h_wire), temperature)
        return token, (self.ex.array_to_wire(out) if out is not None else None)

    def _head_embed_wire(self, req: str, ids: list) -> dict:
        return self.ex.array_to_wire(self.runner.head_embed_and_run(req, ids))

    def _head_embed_batch_wire(self, rids: list[str], tokens: list[int], group: int = 0) -> dict:
        return self.ex.array_to_wire(self.runner.head_embed_and_run_batch(rids, tokens, group))

    def _head_sample_wire(self, req: str, h_wire: dict, temperature: float) -> int:
        return int(self.runner.head_sample(req, self.ex.array_from_wire(h_wire), temperature))

    def _head_sample_batch_wire(self, rids: list[str], h_wire: dict, temperatures: list[float]) -> list[int]:
        return self.runner.head_sample_batch(rids, self.ex.array_from_wire(h_wire), temperatures)

    def _head_sample_rows_wire(self, rids: list[str], h_wire: dict, samplings: list, histories: list) -> list:
        return self.runner.head_sample_rows(rids, self.ex.array_from_wire(h_wire), samplings, histories)


class RingViews:
    """RingMember's read-only views for `status` and tests: its head scheduler's step counts
    (`self.scheduler`, None off the head) and its per-request statistics (`self.stats`)."""

    @property
    def decode_steps(self) -> int:
        return self.scheduler.decode_steps if self.scheduler is not None else 0

    @property
    def decode_rows(self) -> int:
        return self.scheduler.decode_rows if self.scheduler is not None else 0

    @property
    def max_batch_rows(self) -> int:
        return self.scheduler.max_batch_rows if self.scheduler is not None else 0

    @property
    def steps_total(self) -> int:
        return self.stats.steps_total

    @property
    def req_steps(self) -> dict:
        """req -> step time (s) of every pass, on this member."""
        return self.stats.steps_s

    @property
    def req_share_s(self) -> dict:
        """req -> its share of this member's compute (s)."""
        return self.stats.share_s

    @property
    def req_bytes(self) -> dict:
        """req -> its share of the bytes sent to the next member."""
        return self.stats.sent_bytes
