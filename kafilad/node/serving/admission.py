"""Run-time admission at the host: at most K requests on the ring, a bounded FIFO queue behind them.

The plan reserved KV memory for the session's declared concurrency K (`--concurrency`, DESIGN §5.4
"admission at the declared context and concurrency", §10 "Plan for the declared concurrency K"), so
the host never lets more than K requests onto the ring at once (issue 9 "Admission at run time"):

```
request ──▶ running < K and nobody waiting?  ── yes ──▶ RUN (a slot; released when the request ends)
               │ no
               ▼
            queue has room (< queue_limit)?    ── yes ──▶ QUEUED, first in first out; RUN when a slot frees
               │ no
               ▼
            REFUSED: HostBusyError (HTTP 429 with Retry-After; `kafila-ctl generate` says the host is busy)
```
A slot that frees goes to the oldest waiter directly (no newcomer overtakes the queue). A waiter
that gives up (its client left, or its task was cancelled) leaves the queue; a waiter that gave
up after its slot was granted hands the slot on.

`AdmissionQueue` is the policy, pure (no trio; times are passed in, so tests need no clock);
`Limiter` is its trio driver (one `trio.Event` per waiter). `Retry-After` is an estimate: the
mean time a slot was held (an exponentially weighted mean of the last requests) times the
requests ahead of a newcomer, divided by K, clamped to [1, 60] s.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import deque
from typing import Optional

import attrs
import trio

from kafilad.errors import HostBusyError, KafilaError
from kafilad.modelinfo import unsplittable_reason
from kafilad.proto.status import RequestCounts

#: default queue length per slot: a host with --concurrency K queues 4K requests
QUEUE_PER_SLOT = 4
#: weight of the newest hold time in the mean used for Retry-After
HOLD_EWMA_WEIGHT = 0.2
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60


class Verdict(enum.Enum):
    """What `AdmissionQueue.arrive` decided for a request."""

    RUN = "run"
    QUEUED = "queued"
    REFUSED = "refused"


class AdmissionQueue:
    """The admission policy (module docstring), with no I/O.

    Args:
        concurrency: K, requests allowed on the ring at once (>= 1).
        queue_limit: requests allowed to wait (>= 0); None: QUEUE_PER_SLOT * K.
    Attributes:
        running: tickets holding a slot; waiting: tickets queued, oldest first.
        hold_s: the weighted mean time a slot was held (s), None before the first release.
    Raises:
        ValueError: concurrency below 1 or a negative queue limit.
    """

    def __init__(self, concurrency: int, queue_limit: Optional[int] = None):
        if concurrency < 1:
            raise ValueError(f"Concurrency must be at least 1 (got {concurrency}).")
        queue_limit = QUEUE_PER_SLOT * concurrency if queue_limit is None else queue_limit
        if queue_limit < 0:
            raise ValueError(f"The queue limit must be 0 or more (got {queue_limit}).")
        self.concurrency = concurrency
        self.queue_limit = queue_limit
        self.running: dict[int, float] = {}  # ticket -> when it got its slot (s)
        self.waiting: deque[int] = deque()
        self.hold_s: Optional[float] = None

    def arrive(self, ticket: int, now_s: float) -> Verdict:
        """A request asks for a slot.

        Raises:
            ValueError: the ticket is already running or waiting (a driver bug).
        """
        if ticket in self.running or ticket in self.waiting:
            raise ValueError(f"Ticket {ticket} arrived twice.")
        if len(self.running) < self.concurrency and not self.waiting:
            self.running[ticket] = now_s
            return Verdict.RUN
        if len(self.waiting) < self.queue_limit:
            self.waiting.append(ticket)
            return Verdict.QUEUED
        return Verdict.REFUSED

    def leave(self, ticket: int, now_s: float) -> list[int]:
        """A request ends (it ran) or gives up (it waited); return the tickets that now run, oldest first.

        An unknown ticket (refused, or already gone) changes nothing.
        """
        started = self.running.pop(ticket, None)
        if started is not None:
            held = max(0.0, now_s - started)
            self.hold_s = held if self.hold_s is None else \
                (1 - HOLD_EWMA_WEIGHT) * self.hold_s + HOLD_EWMA_WEIGHT * held
        elif ticket in self.waiting:
            self.waiting.remove(ticket)
        granted = []
        while self.waiting and len(self.running) < self.concurrency:
            nxt = self.waiting.popleft()
            self.running[nxt] = now_s
            granted.append(nxt)
        return granted

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait before retrying (module docstring), in [1, 60]."""
        if self.hold_s is None:
            return RETRY_AFTER_MIN_S
        ahead = len(self.waiting) + 1
        est = self.hold_s * ahead / self.concurrency
        return int(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(est))))


@attrs.frozen
class Slot:
    """A granted turn on the ring; give it back with `Limiter.release`."""

    ticket: int


class Limiter:
    """The trio driver of an AdmissionQueue: `acquire` waits for a slot, `release` frees it.

    Args:
        concurrency, queue_limit: as AdmissionQueue.
    """

    def __init__(self, concurrency: int, queue_limit: Optional[int] = None):
        self.queue = AdmissionQueue(concurrency, queue_limit)
        self._tickets = itertools.count(1)
        self._granted: dict[int, trio.Event] = {}

    @property
    def running(self) -> int:
        return len(self.queue.running)

    @property
    def queued(self) -> int:
        return len(self.queue.waiting)

    def counts(self) -> RequestCounts:
        """Requests running and waiting, and the limits, for the status (kafilad/proto/status.py)."""
        return RequestCounts(running=self.running, queued=self.queued, concurrency=self.queue.concurrency,
                             queue_limit=self.queue.queue_limit)

    async def acquire(self, *, abandoned: Optional[trio.Event] = None) -> Optional[Slot]:
        """Wait for a slot, first in first out.

        Args:
            abandoned: set when the request's client went away; a request still waiting then
                leaves the queue.
        Returns:
            The Slot, or None when `abandoned` was set before the slot was granted.
        Raises:
            HostBusyError: K requests run and the queue is full (nothing changed).
            trio.Cancelled: the caller was cancelled while waiting (it left the queue).
        """
        ticket = next(self._tickets)
        verdict = self.queue.arrive(ticket, trio.current_time())
        if verdict is Verdict.RUN:
            await trio.lowlevel.checkpoint()
            return Slot(ticket)
        if verdict is Verdict.REFUSED:
            retry = self.queue.retry_after_s()
            raise HostBusyError(
                f"The host is busy: {self.running} request(s) are being served, as many as the session's "
                f"plan holds memory for, and {self.queued} more are waiting, as many as it queues; "
                f"retry in about {retry} s.", running=self.running, queued=self.queued, retry_after_s=retry)
        granted = self._granted[ticket] = trio.Event()
        try:
            if abandoned is None:
                await granted.wait()
            else:
                async with trio.open_nursery() as nursery:
                    async def give_up() -> None:
                        await abandoned.wait()
                        nursery.cancel_scope.cancel()
                    nursery.start_soon(give_up)
                    await granted.wait()
                    nursery.cancel_scope.cancel()
        except BaseException:
            self._give_up(ticket)
            raise
        if not granted.is_set():  # the client left while it waited
            self._give_up(ticket)
            return None
        self._granted.pop(ticket, None)
        return Slot(ticket)

    def release(self, slot: Slot) -> None:
        """Free a slot (the request ended); the oldest waiter gets it. Idempotent."""
        self._give_up(slot.ticket)

    def _give_up(self, ticket: int) -> None:
        self._granted.pop(ticket, None)
        for nxt in self.queue.leave(ticket, trio.current_time()):
            ev = self._granted.get(nxt)
            if ev is not None:
                ev.set()


__all__ = ["AdmissionQueue", "HostBusyError", "Limiter", "QUEUE_PER_SLOT", "Slot", "Verdict"]


#: tokens, when --context is not given (capped at max_position_embeddings)
DEFAULT_CONTEXT = 4096


def default_context(config: dict) -> int:
    """The context a session gets when --context is not given: DEFAULT_CONTEXT, capped at the model's
    max_position_embeddings (config.json)."""
    limit = config.get("max_position_embeddings")
    return min(DEFAULT_CONTEXT, int(limit)) if limit else DEFAULT_CONTEXT


def check_session_arguments(info, *, members: int, context: Optional[int], concurrency: int,
                            admit_timeout_s: float = 1.0) -> int:
    """Refuse session arguments no plan could honour, before anyone joins (DESIGN §5.4); pure, so
    kafila-ctl demo and plan refuse with the host's own sentences (kafila_ctl/checks.py).

    Args:
        info: the model (kafilad.modelinfo.ModelInfo). members: --members, the host included.
        context: --context, or None for the default (DEFAULT_CONTEXT, capped at max_position_embeddings).
    Returns:
        The context to use, in tokens.
    Raises:
        KafilaError: members outside [1, blocks], more than one member for a model mlx-lm's code
            cannot divide (kafilad.modelinfo.unsplittable_reason), concurrency below 1, context below 2, a context
            beyond the model's max_position_embeddings, or an admit timeout that is not positive.
    """
    n_blocks = info.num_hidden_layers
    if not 1 <= members <= n_blocks:  # the planner takes at most one device per block (DESIGN §5)
        raise KafilaError(f"--members counts every machine, the host included, and a session has at most one "
                          f"per block of the model: it must be between 1 and {n_blocks} for {info.model_id} "
                          f"(got {members}).")
    unsplittable = unsplittable_reason(info.config)
    if unsplittable and members > 1:
        raise KafilaError(f"{info.model_id} cannot be divided among machines: {unsplittable}. Host it with "
                          f"--members 1 on a machine that holds it whole.")
    limit = info.config.get("max_position_embeddings")
    if context is None:
        context = default_context(info.config)
    if not admit_timeout_s > 0:
        raise KafilaError(f"--admit-timeout must be a positive number of seconds (got {admit_timeout_s:g}).")
    if concurrency < 1:
        raise KafilaError(f"--concurrency must be at least 1 (got {concurrency}).")
    if context < 2:  # a request needs a prompt token and the token it generates
        raise KafilaError(f"--context must be at least 2 tokens, room for one prompt token and one generated "
                          f"token (got {context}).")
    if limit and context > int(limit):
        raise KafilaError(f"--context {context} exceeds {info.model_id}'s max_position_embeddings "
                          f"({int(limit)}); pass --context {int(limit)} or less.")
    return context
