"""One ring edge as a daemon saw it (proto_spec 07 §6): its path, the transitions the path machinery
makes on it (an attempt's outcome, a fallback, an upgrade) and its status form. Pure: the clock's
readings are given (issue 25 item 1); kafilad/node/paths drives it.

- :class:`PathKind`: "pending" | "direct" | "relayed", as status shows an edge's path.
- :class:`EdgeRecord`: the record.
"""

from __future__ import annotations

import enum
import logging
from typing import Optional

import attrs

log = logging.getLogger("kafilad.paths")


class PathKind(str, enum.Enum):
    """The path of an edge as status reports it (proto_spec 07 §6); compares equal to its string."""

    PENDING = "pending"
    DIRECT = "direct"
    RELAYED = "relayed"

    def __str__(self) -> str:
        return self.value


@attrs.define
class EdgeRecord:
    """One ring edge as this daemon saw it (proto_spec 07 §6), and its transitions.

    Attributes:
        src, dst: the sender's and the receiver's names.
        predicted: the path the two NAT classes predict (DESIGN §3 step 4).
        path: the path the ring uses now.
        links: every Link this edge has used, oldest first (sender side).
        tries: the last attempt made: 0 at formation, then re-probes 1, 2, ...
        pending: a verified re-probe's measurements, applied by :meth:`upgraded` at the switch.
    """

    src: str
    dst: str
    predicted: PathKind = PathKind.DIRECT
    path: PathKind = PathKind.PENDING
    rtt_ms: Optional[float] = None
    verify_s: Optional[float] = None
    remote: Optional[str] = None
    reason: str = ""
    links: list = attrs.field(factory=list)
    tries: int = 0
    upgraded_at: Optional[float] = None   # Unix time the edge switched from relayed to direct
    pending: Optional[dict] = None
    classes: dict = attrs.field(factory=dict)         # name -> NAT class of each end at the last attempt
    class_reasons: dict = attrs.field(factory=dict)   # name -> why that class is "unknown"
    same_network: bool = False  # the ends share a NAT or a LAN: checks run even if the classes predict relay
    fallbacks: int = 0          # times the edge fell back from direct to relayed mid-session (§7a)
    fell_back_at: Optional[float] = None   # Unix time of the last fallback
    last_attempt: Optional[dict] = None    # {"try", "ok", "reason", "at"} of the last re-probe (§7)
    datagram_bytes: Optional[int] = None   # largest QUIC datagram the sender sends on the direct path (§4a)
    pmtu: Optional[dict] = None            # the sender's path MTU search: state, probes, black_holes (§4a)
    birthday: Optional[dict] = None        # the birthday search that found the direct path in use (§7b)
    direct_after_s: Optional[float] = None  # relay up -> the switch to that path, seconds (§7b)
    #: the direct path in use: its smallest QUIC RTT sample so far (RFC 9002 §5.2 min_rtt), ms, and how
    #: many samples (the sender's; §6). Unlike `rtt_ms`, one check's round trip taken while the daemons
    #: start, it settles on the path's own round trip as the liveness PINGs and the ring's traffic are
    #: acknowledged
    path_rtt_ms: Optional[float] = None
    rtt_samples: int = 0

    @property
    def link(self):
        """The Link this edge uses now (None before it formed)."""
        return self.links[-1] if self.links else None

    @link.setter
    def link(self, value) -> None:
        if value is not None and (not self.links or self.links[-1] is not value):
            self.links.append(value)

    # ---- transitions -------------------------------------------------------------------------
    def note_attempt(self, attempt: int, found: Optional[dict], reason: str = "", *, now_s: float) -> None:
        """An attempt ended: verified with ``found`` measurements (QUIC up), or failed with ``reason``;
        ``now_s``: the wall clock's reading (time.time()), kept as a re-probe's "at".

        At attempt 0 a verified pair makes the record "direct" at once; a verified re-probe only
        parks its measurements in ``pending`` until :meth:`upgraded` (proto_spec 07 §7 step 2).
        """
        self.tries = max(self.tries, attempt)
        if attempt > 0:
            self.last_attempt = {"try": attempt, "ok": found is not None, "reason": "" if found else reason,
                                 "at": now_s}
        if found is None:
            if self.path != PathKind.DIRECT:
                self.path = PathKind.RELAYED
            self.reason = reason
        elif attempt == 0:
            self.path, self.reason = PathKind.DIRECT, ""
            self.verify_s, self.rtt_ms, self.remote = found["verify_s"], found["rtt_ms"], found["remote"]
            log.info("ring edge %s -> %s is direct via %s (verified in %.3f s)", self.src, self.dst, self.remote,
                     self.verify_s)
        else:
            self.pending = found

    def relayed(self, reason: str) -> None:
        """The edge uses (or stays on) the relayed circuit, for ``reason``."""
        self.path, self.reason, self.pending = PathKind.RELAYED, reason, None
        self.datagram_bytes = self.pmtu = None
        self.birthday = self.direct_after_s = None

    def fell_back(self, reason: str, link=None, *, now_s: float) -> None:
        """The direct path went away mid-session and the edge now uses the relay (proto_spec 07 §7a);
        ``now_s``: the wall clock's reading (time.time())."""
        self.relayed(reason)
        self.fallbacks += 1
        self.fell_back_at = now_s
        self.link = link
        log.warning("ring edge %s -> %s fell back to the relay: %s", self.src, self.dst, reason)

    def upgraded(self, link=None, direct_after_s: Optional[float] = None, *, now_s: float) -> None:
        """The ring now uses the re-probed direct path (``link`` on the sender; proto_spec 07 §7 step 3);
        ``direct_after_s``: how long after the relay came up (§7b); ``now_s``: the wall clock's reading."""
        found, self.pending = self.pending or {}, None
        self.verify_s, self.rtt_ms, self.remote = found.get("verify_s"), found.get("rtt_ms"), found.get("remote")
        self.birthday, self.direct_after_s = found.get("birthday"), direct_after_s
        self.path, self.reason, self.upgraded_at = PathKind.DIRECT, "", now_s
        self.link = link
        log.info("ring edge %s -> %s upgraded from relayed to direct via %s (re-probe %d)", self.src, self.dst,
                 self.remote, self.tries)

    def to_json(self) -> dict:
        out = {"from": self.src, "to": self.dst, "path": str(self.path), "predicted_path": str(self.predicted),
               "rtt_ms": self.rtt_ms, "verify_s": self.verify_s, "tries": self.tries}
        if self.remote:
            out["remote"] = self.remote
        if self.reason:
            out["reason"] = self.reason
        if self.upgraded_at is not None:
            out["upgraded_at"] = self.upgraded_at
            out["upgraded_from"] = "relayed"
        if self.classes:
            out["classes"] = dict(self.classes)
        if self.class_reasons:
            out["class_reasons"] = dict(self.class_reasons)
        if self.same_network:
            out["same_network"] = True
        if self.fallbacks:
            out["fallbacks"] = self.fallbacks
            out["fell_back_at"] = self.fell_back_at
        if self.last_attempt is not None:
            out["last_attempt"] = dict(self.last_attempt)
        if self.path == PathKind.DIRECT and self.rtt_samples:
            out["path_rtt_ms"], out["rtt_samples"] = self.path_rtt_ms, self.rtt_samples
        if self.path == PathKind.DIRECT and self.datagram_bytes is not None:
            out["datagram_bytes"] = self.datagram_bytes
            if self.pmtu is not None:
                out["pmtu"] = dict(self.pmtu)
        if self.path == PathKind.DIRECT and self.birthday is not None:
            out["birthday"] = dict(self.birthday)
            out["direct_after_s"] = self.direct_after_s
        if self.links:  # frame bytes this end sent on the edge, over every path it used, now
            out["link_bytes_sent"] = sum(int(getattr(lk, "bytes_sent", 0) or 0) for lk in self.links)
        return out
