"""A ring edge's numbering, acknowledgements and resends, as two pure machines (proto_spec 07 §7).

The edge's driver (kafilad/node/paths/edgelink.py ``EdgeSender`` / ``EdgeReceiver``) moves frames
between paths; these machines decide what each frame's number is, what the sender keeps, what it
sends again after a switch, what the receiver hands to the ring and when it acknowledges::

    SendSequencer                                   ReceiveSequencer
    stamp(body) -> {**body, "es": n}   ── path ──>  receive(es) -> DELIVER | REPEAT
      keeps (n, frame) until acked                    (a gap raises SequenceGap: the edge breaks)
    on_ack(n)                          <── edge_ack ── ack_due() -> n   (then acked(n))
    on_path_ready(d) -> frames es > d  <── path_ready(d) ── delivered   (on a new path)
      (sent again, in order, on the new path)

``es`` counts an edge's frames from 1 across every path it used. A sender keeps at most
``window`` frames unacknowledged (``window_full``; its driver waits for an ack). A receiver
delivers only the next number; a number it already delivered is a repeat (a frame resent after a
switch that had arrived on the old path); a frame without a number (an older sender) is delivered
as it is, uncounted. So over any run of FIFO paths with frames lost in flight at each switch,
every frame reaches the ring once, in order (tests/proto/test_edge_seq.py checks it by hypothesis).

Pure: no trio, sockets or mlx (tests/test_import_boundary.py).
"""

from __future__ import annotations

import collections
import enum
from typing import Optional

from kafilad.errors import LocalProtocolError, SequenceGap
from kafilad.proto.ring_frames import stamp

#: Frames a sender keeps unacknowledged before it stops stamping (its driver waits for an `edge_ack`).
KEEP_FRAMES = 1024


class SendSequencer:
    """The sending end's numbering and resend buffer (proto_spec 07 §7).

    Args:
        window: most frames kept unacknowledged (>= 1).
    Attributes:
        sent: the highest ``es`` stamped. acked: the highest ``es`` acknowledged (or implied by a
            `path_ready`). resent: frames handed out again by ``on_path_ready``.
    """

    def __init__(self, window: int = KEEP_FRAMES):
        if window < 1:
            raise LocalProtocolError(f"An edge's window holds at least one frame, not {window}.")
        self.window = window
        self.sent = 0
        self.acked = 0
        self.resent = 0
        self._kept: collections.deque[tuple[int, dict]] = collections.deque()

    @property
    def kept(self) -> int:
        """Frames kept for a possible resend (sent, not yet acknowledged)."""
        return len(self._kept)

    @property
    def window_full(self) -> bool:
        """``stamp`` would refuse: the driver waits for an ack (or the edge's end) first."""
        return len(self._kept) >= self.window

    def stamp(self, body: dict) -> tuple[int, dict]:
        """Number the next frame and keep it until acknowledged.

        Returns:
            (es, the map to send: ``body`` plus "es").
        Raises:
            LocalProtocolError: the window is full, or ``body`` carries an "es" of its own.
        """
        if self.window_full:
            raise LocalProtocolError(f"The edge keeps {self.window} unacknowledged frames, its window; "
                                     "wait for an acknowledgement.")
        frame = stamp(body, self.sent + 1)
        self.sent += 1
        self._kept.append((self.sent, frame))
        return self.sent, frame

    def on_ack(self, es: int) -> bool:
        """The receiver acknowledged frames up to ``es`` (an `edge_ack`); they are no longer kept.

        An ``es`` beyond what was sent (a confused or hostile peer) is ignored.
        Returns:
            Whether frames left the window (a driver parked on a full window may go on).
        """
        if es > self.sent:
            return False
        if es > self.acked:
            self.acked = es
        before = len(self._kept)
        while self._kept and self._kept[0][0] <= es:
            self._kept.popleft()
        return len(self._kept) != before

    def on_path_ready(self, delivered: int) -> list[tuple[int, dict]]:
        """The receiver reads a new path from now on, having delivered up to ``delivered``.

        Returns:
            Every kept frame after ``delivered``, in order, as (es, map): the driver sends them
            again on the new path before anything new (``resent`` counts them).
        """
        self.on_ack(delivered)
        again = [(es, f) for es, f in self._kept if es > delivered]
        self.resent += len(again)
        return again


class Delivery(enum.Enum):
    """What the receiver does with a numbered frame."""

    DELIVER = "deliver"  # hand it to the ring
    REPEAT = "repeat"  # delivered before (resent after a switch): drop it


class ReceiveSequencer:
    """The receiving end's in-order, exactly-once delivery and coalesced acks (proto_spec 07 §7).

    Attributes:
        delivered: the highest ``es`` handed to the ring. repeats: frames dropped as delivered
            before. acked: the highest ``es`` acknowledged to the sender.
    """

    def __init__(self) -> None:
        self.delivered = 0
        self.repeats = 0
        self.acked = 0

    def receive(self, es: Optional[int]) -> Delivery:
        """Judge a frame carrying sequence number ``es`` (None: an older sender's, delivered uncounted).

        Raises:
            SequenceGap: ``es`` skips frames (it is not the next one and was not delivered before).
        """
        if es is None:
            return Delivery.DELIVER
        if es <= self.delivered:
            self.repeats += 1
            return Delivery.REPEAT
        if es != self.delivered + 1:
            raise SequenceGap(f"frames {self.delivered + 1}..{es - 1} were skipped", expected=self.delivered + 1,
                              got=es)
        self.delivered = es
        return Delivery.DELIVER

    def ack_due(self) -> Optional[int]:
        """The ``es`` an `edge_ack` should carry now, or None when everything delivered was acknowledged."""
        return self.delivered if self.delivered > self.acked else None

    def acked_up_to(self, es: int) -> None:
        """An `edge_ack` carrying ``es`` went out."""
        self.acked = max(self.acked, es)
