"""What the ring driver (kafilad/node/serving/ring.py `RingMember`) keeps beside its state: a
generation's `RequestState` as `RingMember.generate` returns it, the head's `FusedStep` (a next
decode step run with its sampling), the stage's calls in the wire form (`WireStage`) and the one
MLX worker thread (`run_on_mlx_thread`, DESIGN §6).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import attrs
import trio

from kafilad.proto.scheduler import Request
from kafilad.proto.sampling import Sampling


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


class WireStage:
    """A RingMember's stage seen in the wire form: its StageRunner's calls, taking and giving
    activations as the frame layer's array maps (proto_spec 02 §3). Each call runs whole on the MLX
    thread (`RingMember._compute`). Held in `RingMember.wire`.

    Args:
        runner: the member's kafilad.executor.runner.StageRunner.
        ex: the executor module (kafilad.executor.runner): array_to_wire / array_from_wire.
    """

    def __init__(self, runner, ex):
        self.runner = runner
        self.ex = ex

    def run_blocks(self, req: str, h_wire: dict, trim: int = 0) -> dict:
        h = self.ex.array_from_wire(h_wire)
        self.runner.trim(req, trim)  # a speculative pass's rejected drafts first (proto_spec 05 §3.1)
        return self.ex.array_to_wire(self.runner.run(req, h))

    def run_batch(self, rids: list[str], h_wire: dict, group: int = 0, trims: tuple = ()) -> dict:
        h = self.ex.array_from_wire(h_wire)
        if any(trims):  # the rows' rejected drafts first, in their batch caches (proto_spec 05 §3.1)
            self.runner.trim_rows(rids, list(trims), group)
        return self.ex.array_to_wire(self.runner.run_batch(rids, h, group))

    def head_verify_batch(self, rids: list[str], h_wire: dict, drafts: list, temperatures: list, group: int,
                          rows: Optional[list] = None) -> list:
        return self.runner.head_verify_batch(rids, self.ex.array_from_wire(h_wire), drafts, temperatures, group,
                                             rows)

    def head_verify(self, req: str, h_wire: dict, drafts: list, temperature: float) -> list:
        return self.runner.head_verify(req, self.ex.array_from_wire(h_wire), list(drafts), temperature)

    def head_sample_batch_and_run(self, rids: list[str], h_wire: dict, group: int) -> tuple:
        tokens, out = self.runner.head_sample_batch_and_run(rids, self.ex.array_from_wire(h_wire), group)
        return tokens, (self.ex.array_to_wire(out) if out is not None else None)

    def head_sample_and_run(self, req: str, h_wire: dict, temperature: float) -> tuple:
        token, out = self.runner.head_sample_and_run(req, self.ex.array_from_wire(h_wire), temperature)
        return token, (self.ex.array_to_wire(out) if out is not None else None)

    def head_embed(self, req: str, ids: list) -> dict:
        return self.ex.array_to_wire(self.runner.head_embed_and_run(req, ids))

    def head_embed_batch(self, rids: list[str], tokens: list, group: int = 0) -> dict:
        return self.ex.array_to_wire(self.runner.head_embed_and_run_batch(rids, tokens, group))

    def head_sample(self, req: str, h_wire: dict, temperature: float) -> int:
        return int(self.runner.head_sample(req, self.ex.array_from_wire(h_wire), temperature))

    def head_sample_batch(self, rids: list[str], h_wire: dict, temperatures: list[float]) -> list[int]:
        return self.runner.head_sample_batch(rids, self.ex.array_from_wire(h_wire), temperatures)

    def head_sample_rows(self, rids: list[str], h_wire: dict, samplings: list, histories: list) -> list:
        return self.runner.head_sample_rows(rids, self.ex.array_from_wire(h_wire), samplings, histories)
