"""Datagram size discovery for a direct path, sans-IO (DPLPMTUD, RFC 8899; RFC 9000 §14; proto_spec 07 §4a).

QUIC starts every network path at 1,200-byte datagrams, the size every QUIC path must carry
(RFC 9000 §14.1). :class:`PmtuSearch` then decides which larger sizes to try, one at a time, from
a short ascending ladder; the edge's sender probes each with a padded, authenticated STUN Binding
request on the path (RFC 8899 §4.1: a probe packet that carries no application data, so a lost
probe loses nothing) and raises its QUIC datagram size to every size answered::

    BASE (1200) --probe 1252--> 1252 --probe 1348--> 1348 --probe 1400--> ... --> SEARCH_COMPLETE
                  \\ MAX_PROBES unanswered tries of one size: the search completes below it
    any state --black_hole()--> BASE, and a new search after BLACK_HOLE_RETRY_S
    SEARCH_COMPLETE --after RAISE_S--> a new search (the path may carry more now; RFC 8899 §5.1.1)

A black hole (RFC 8899 §4.2) is seen by the transport, not here: small datagrams (PINGs) are
acknowledged while stream data of the current size is not (kafilad/net/quic_transport.py
``stalled_for_s``). The ladder's sizes are UDP payloads and multiples of 4 (a STUN message's
length always is): 1252 fits an IPv4 path of MTU 1280 (20 + 8 header bytes), 1452 an IPv6 path of
MTU 1500 (40 + 8).
"""

from __future__ import annotations

import enum
from typing import Optional, Sequence

#: The size every QUIC path carries (RFC 9000 §14.1): where each search starts.
BASE_BYTES = 1200
#: Sizes probed in turn (UDP payload bytes).
LADDER_BYTES = (1252, 1348, 1400, 1452)
#: Unanswered tries of one size before it counts as too large (RFC 8899 MAX_PROBES = 3).
MAX_PROBES = 3
#: Wait for one probe's answer: at least this, or 3 RTTs.
PROBE_TIMEOUT_MIN_S = 0.5
#: A completed search runs again after this (RFC 8899 §5.1.1 PMTU_RAISE_TIMER: 600 s).
RAISE_S = 600.0
#: After a black hole, the search runs again after this.
BLACK_HOLE_RETRY_S = 30.0


class SearchState(enum.Enum):
    BASE = "base"                 # nothing above BASE_BYTES confirmed yet; searching
    SEARCHING = "searching"       # a size above BASE_BYTES confirmed; probing higher
    COMPLETE = "complete"         # the largest size of the ladder this path carries is known
    WAITING = "waiting"           # after a black hole, until the next search


class PmtuSearch:
    """Which datagram size to probe next, and the largest one confirmed (RFC 8899 §5.2).

    Drive it with the clock: ``next_probe(now)`` gives the size to probe now (or None), the
    driver reports ``confirmed(size)`` / ``failed(size)`` for each probe, and
    ``black_hole(now)`` when the transport saw the current size stop crossing the path.

    Args:
        ladder: sizes to try, ascending, each above BASE_BYTES.
        now: the current time, seconds.
    Attributes:
        size: the largest size confirmed (BASE_BYTES until a probe is answered).
        probes: probe tries reported (answered or not); black_holes: black holes reported.
    """

    def __init__(self, *, now: float, ladder: Sequence[int] = LADDER_BYTES):
        self.ladder = tuple(sorted(s for s in ladder if s > BASE_BYTES))
        self.size = BASE_BYTES
        self.state = SearchState.BASE
        self.probes = 0
        self.black_holes = 0
        self._tries = 0
        self._index = 0
        self._resume_at = now

    @property
    def probing(self) -> Optional[int]:
        """The size under test, or None when not searching."""
        if self.state in (SearchState.COMPLETE, SearchState.WAITING) or self._index >= len(self.ladder):
            return None
        return self.ladder[self._index]

    def next_probe(self, now: float) -> Optional[int]:
        """The size to probe now, or None (search complete or waiting; see :meth:`wake_at`)."""
        if self.state in (SearchState.COMPLETE, SearchState.WAITING) and now >= self._resume_at:
            self._restart()
        return self.probing

    def wake_at(self) -> Optional[float]:
        """When :meth:`next_probe` may give a size again while complete or waiting; None while searching."""
        return self._resume_at if self.state in (SearchState.COMPLETE, SearchState.WAITING) else None

    def confirmed(self, size: int, now: float) -> None:
        """A probe of ``size`` was answered: the path carries it."""
        self.probes += 1
        if size != self.probing:
            return
        self.size, self._tries = size, 0
        self._index += 1
        self.state = SearchState.SEARCHING
        if self._index >= len(self.ladder):
            self._complete(now)

    def failed(self, size: int, now: float) -> None:
        """A probe of ``size`` went unanswered; after MAX_PROBES such tries the search completes below it."""
        self.probes += 1
        if size != self.probing:
            return
        self._tries += 1
        if self._tries >= MAX_PROBES:
            self._complete(now)

    def black_hole(self, now: float) -> int:
        """Datagrams of the current size stopped crossing the path: back to BASE_BYTES; the new size."""
        self.black_holes += 1
        self.size = BASE_BYTES
        self.state = SearchState.WAITING
        self._resume_at = now + BLACK_HOLE_RETRY_S
        return self.size

    def _complete(self, now: float) -> None:
        self.state = SearchState.COMPLETE
        self._resume_at = now + RAISE_S

    def _restart(self) -> None:
        # Search again from the size confirmed last: a raise probes above it, a retry after a
        # black hole starts over from BASE_BYTES (size was reset).
        self.state = SearchState.BASE if self.size == BASE_BYTES else SearchState.SEARCHING
        self._tries = 0
        self._index = next((i for i, s in enumerate(self.ladder) if s > self.size), len(self.ladder))
        if self._index >= len(self.ladder):
            self.state = SearchState.COMPLETE
            self._resume_at = float("inf")

    def to_json(self) -> dict:
        return {"datagram_bytes": self.size, "state": self.state.value, "probes": self.probes,
                "black_holes": self.black_holes}
