"""What a daemon records about its ring edges, and the offers it receives (proto_spec 07 §2, §6).

- :class:`PathKind`, :class:`EdgeRecord`: one ring edge as this daemon saw it (pure, in
  kafilad/proto/edge_record.py; imported from here too).
- :class:`OfferInbox`: candidate offers received over rendezvous signals, matched by (edge, try).

Split from kafilad/node/paths/manager.py, which re-exports these names.
"""

from __future__ import annotations

import logging
from typing import Optional

import attrs
import trio

from kafilad.errors import MalformedFrame
from kafilad.proto.edge_record import EdgeRecord, PathKind  # noqa: F401 - imported from here by the paths
from kafilad.proto.ring_frames import IceOffer, decode_ice_offer

log = logging.getLogger("kafilad.paths")

#: How long to wait for the peer's offer signal before relaying (proto_spec 07 §2); also how long
#: a receiver holds a re-probe offer before it is stale (§7 step 2).
OFFER_TIMEOUT_S = 5.0
#: Offers kept in a session's inbox (the oldest are dropped beyond it).
INBOX_OFFERS = 64


@attrs.frozen
class HeldOffer:
    """An offer in the inbox: the typed offer, the peer that signalled it, and when (trio time, s)."""

    offer: IceOffer
    from_peer: str
    received_at: float


class OfferInbox:
    """Candidate offers received over rendezvous signals (proto_spec 07 §2), matched by (edge, try) and sender."""

    def __init__(self, capacity: int = INBOX_OFFERS):
        self.capacity = capacity
        self.offers: dict[tuple[str, int], HeldOffer] = {}
        self._changed = trio.Event()

    def store(self, from_peer: str, body, now: float) -> bool:
        """Keep a well-formed offer (``decode_ice_offer``), with its sender and ``now``; False if it was dropped."""
        try:
            offer = decode_ice_offer(body)
        except MalformedFrame as e:
            log.debug("dropping a signal from %s: %s", from_peer, e)
            return False
        self.offers[(offer.edge, offer.attempt)] = HeldOffer(offer, from_peer, now)
        while len(self.offers) > self.capacity:
            self.offers.pop(next(iter(self.offers)))
        self._changed.set()
        self._changed = trio.Event()
        return True

    async def wait(self, edge: str, attempt: int, peer: str, timeout_s: float) -> Optional[IceOffer]:
        """The offer of ``peer`` for (``edge``, ``attempt``), taken out of the inbox; None after ``timeout_s``."""
        with trio.move_on_after(timeout_s):
            while True:
                held = self.offers.pop((edge, attempt), None)
                if held is not None and held.from_peer == peer:
                    return held.offer
                await self._changed.wait()
        return None

    async def newest_reprobe(self, edge: str, peer: str) -> int:
        """Wait for a re-probe offer (``try`` >= 1) of ``peer`` on ``edge``; its attempt number.

        Older re-probe offers are dropped, and so is any held longer than :data:`OFFER_TIMEOUT_S`
        (its sender stopped waiting for our answer; answering it would desynchronise the ends).
        """
        while True:
            changed = self._changed
            stale = trio.current_time() - OFFER_TIMEOUT_S
            for key in [k for k, o in self.offers.items() if k[0] == edge and k[1] >= 1 and o.received_at < stale]:
                self.offers.pop(key, None)
            tries = [k for (e, k), o in self.offers.items() if e == edge and k >= 1 and o.from_peer == peer]
            if tries:
                newest = max(tries)
                for k in tries:
                    if k != newest:
                        self.offers.pop((edge, k), None)
                return newest
            with trio.move_on_after(OFFER_TIMEOUT_S):
                await changed.wait()
