"""One direction of an emulated WAN hop: fixed one-way delay plus a token-bucket rate cap (issue 24 item 2).

tc netem does not exist on the development machine, so WAN latency between loopback daemons is put
in by a userspace UDP forwarder (scripts/wan_forwarder.py). This module is its pure part: it takes
datagrams and the current time and says when each leaves, in the sans-IO shape of aioquic's
datagram machines (STYLE.md): :meth:`WanLink.receive_datagram`, :meth:`WanLink.get_timer`,
:meth:`WanLink.datagrams_to_send`. No sockets, no trio, no clock of its own.

Timing model, per direction, FIFO::

    depart_s  = first time >= max(arrival_s, previous depart_s) at which the bucket holds the
                datagram's bytes (bucket refills at rate_Bps, holds at most burst_bytes)
    deliver_s = depart_s + delay_s

With ``rate_Bps=None`` there is no cap and ``deliver_s = arrival_s + delay_s``. A datagram that
would wait in the bucket's queue longer than ``queue_limit_bytes / rate_Bps`` is dropped and
counted (a router's tail drop), so a sender faster than the cap sees loss, not unbounded delay.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, Hashable, Optional, TypeVar

Dest = TypeVar("Dest", bound=Hashable)


@dataclass(frozen=True)
class LinkStats:
    """Counters of one link direction: datagrams and bytes forwarded, datagrams tail-dropped."""

    forwarded: int
    forwarded_bytes: int
    dropped: int


class WanLink(Generic[Dest]):
    """A delay queue and token bucket for one direction of a hop.

    Args:
        delay_s: one-way delay added to every datagram, seconds (>= 0).
        rate_Bps: rate cap in bytes per second, or None for no cap (> 0 when given).
        burst_bytes: bucket size; a full bucket lets this many bytes through at once. Defaults to
            one 64 KiB datagram so a single datagram never waits on an idle link longer than its
            own serialisation time.
        queue_limit_bytes: bytes that may wait for the bucket before tail drop (default 1 MiB).

    Raises:
        ValueError: a negative delay, a non-positive rate, burst or queue limit.
    """

    def __init__(
        self,
        delay_s: float,
        rate_Bps: Optional[float] = None,
        burst_bytes: int = 65536,
        queue_limit_bytes: int = 1 << 20,
    ) -> None:
        if delay_s < 0:
            raise ValueError(f"The hop delay must be >= 0 seconds, not {delay_s}.")
        if rate_Bps is not None and rate_Bps <= 0:
            raise ValueError(f"The rate cap must be > 0 bytes/s or None, not {rate_Bps}.")
        if burst_bytes <= 0 or queue_limit_bytes <= 0:
            raise ValueError("The burst and the queue limit must be > 0 bytes.")
        self.delay_s = delay_s
        self.rate_Bps = rate_Bps
        self.burst_bytes = burst_bytes
        self.queue_limit_bytes = queue_limit_bytes
        self._queue: deque[tuple[float, bytes, Dest]] = deque()
        self._tokens_bytes = float(burst_bytes)
        self._tokens_at_s: Optional[float] = None
        self._last_depart_s = float("-inf")
        self._forwarded = 0
        self._forwarded_bytes = 0
        self._dropped = 0

    def receive_datagram(self, data: bytes, dest: Dest, now: float) -> bool:
        """Queue ``data`` for ``dest``, arrived at ``now`` (seconds).

        Returns:
            True if queued, False if tail-dropped (counted in :meth:`stats`).
        """
        depart_s = max(now, self._last_depart_s)
        if self.rate_Bps is not None:
            if (depart_s - now) * self.rate_Bps > self.queue_limit_bytes:
                self._dropped += 1
                return False
            if self._tokens_at_s is None:
                self._tokens_at_s = depart_s
            tokens = min(
                float(self.burst_bytes),
                self._tokens_bytes + (depart_s - self._tokens_at_s) * self.rate_Bps,
            )
            size = len(data)
            if tokens >= size:
                tokens -= size
            else:
                depart_s += (size - tokens) / self.rate_Bps
                tokens = 0.0
            self._tokens_bytes = tokens
            self._tokens_at_s = depart_s
        self._last_depart_s = depart_s
        self._queue.append((depart_s + self.delay_s, data, dest))
        return True

    def get_timer(self) -> Optional[float]:
        """The time (seconds) the next queued datagram is due, or None when nothing is queued."""
        return self._queue[0][0] if self._queue else None

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Dest]]:
        """Take every datagram due at or before ``now``, in arrival order: ``[(data, dest), ...]``."""
        out: list[tuple[bytes, Dest]] = []
        while self._queue and self._queue[0][0] <= now:
            _, data, dest = self._queue.popleft()
            out.append((data, dest))
            self._forwarded += 1
            self._forwarded_bytes += len(data)
        return out

    def stats(self) -> LinkStats:
        """Counters so far."""
        return LinkStats(self._forwarded, self._forwarded_bytes, self._dropped)
