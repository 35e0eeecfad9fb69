"""NAT classification of a session's path manager (proto_spec 07 §1, 04 §4.4-§4.6).

:class:`NatClassifier` is a part of :class:`kafilad.node.paths.manager.PathManager`, held in its ``nat``
field: it owns the classification's state and is given what it uses of the manager (the UDP
endpoint, the rendezvous, the session's nursery, the event log and whether the paths closed).
Classification runs once at session start; an "unknown" class (no STUN answer) is noted with its
reason and retried in the background with backoff.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import trio

from kafilad.net.stun_client import classify_nat, parse_host_port
from kafilad.proto.natclass import UNKNOWN_CLASS

log = logging.getLogger("kafilad.paths")

#: Bound on NAT classification at session start.
CLASSIFY_TIMEOUT_S = 6.0
#: An "unknown" class is classified again after this wait, doubling up to the cap (proto_spec 07 §1).
CLASSIFY_RETRY_S = 5.0
CLASSIFY_RETRY_MAX_S = 300.0
#: How long a STUN address we sent to may keep a NAT filter open for it (Linux conntrack keeps a
#: replied UDP flow 120 s): a rerun within it does not trust that address's filtering answers.
STUN_CONTACT_MEMORY_S = 120.0


class NatClassifier:
    """The NAT classification of one session's paths (see :meth:`classify`).

    Args:
        endpoint: the daemon's UDP endpoint (classification runs on its STUN socket).
        rdv: the session's rendezvous: its ``stun_servers`` (host:port strings or pairs).
        nursery: the session paths' nursery, where a retry of an "unknown" class runs.
        event: ``event(kind, **fields)``, the manager's path-event log (proto_spec 07 §6).
        closed: whether the session's paths closed (a retry stops then).
    Attributes:
        report: the last NatReport (kafilad/net/stun_client.py), None before one.
        nat_class: "O" | "C" | "S" | "unknown" once classified; None without STUN servers.
        nat_reason: why ``nat_class`` is "unknown" (a sentence), else "".
        rendezvous_rtt_ms: the STUN round trip measured by the last classification.
        classifications: how many classifications ran.
    """

    def __init__(self, endpoint, rdv, nursery, event: Callable[..., None], closed: Callable[[], bool]):
        self.endpoint = endpoint
        self.rdv = rdv
        self.nursery = nursery
        self.event = event
        self._closed = closed
        self.report = None
        self.nat_class: Optional[str] = None
        self.nat_reason = ""
        self.rendezvous_rtt_ms: Optional[float] = None
        self.classifications = 0
        self._retrying_class = False
        self._stun_contacts: dict[tuple, float] = {}  # STUN address -> when a classification last sent to it

    @property
    def closed(self) -> bool:
        return self._closed()

    def _stun_servers(self) -> list:
        return [parse_host_port(s) if isinstance(s, str) else tuple(s)
                for s in getattr(self.rdv, "stun_servers", None) or []]

    async def classify(self) -> dict:
        """Classify our NAT on the endpoint's socket (proto_spec 04 §4.4); the capability fields.

        An "unknown" class (no STUN answer, a mapping test unanswered, a failure) is logged with
        its reason, noted as a ``nat_class`` event, and classified again in the background with
        backoff (:data:`CLASSIFY_RETRY_S` doubling to :data:`CLASSIFY_RETRY_MAX_S`) until a class
        is measured or the session ends; later offers carry the new class (proto_spec 07 §1).

        Returns:
            {"nat_class", "rendezvous_rtt_ms"} (None values without STUN servers), plus
            "nat_reason" when the class is "unknown".
        """
        if self._stun_servers():
            await self._classify_once()
            if self.nat_class == UNKNOWN_CLASS and not self._retrying_class and not self.closed:
                self._retrying_class = True
                self.nursery.start_soon(self._classify_again)
        return self._capability_fields()

    async def _classify_once(self) -> None:
        self.classifications += 1
        report, reason = None, ""
        now = trio.current_time()
        contacted = [a for a, at in self._stun_contacts.items() if now - at < STUN_CONTACT_MEMORY_S]
        try:
            report = await classify_nat(self.endpoint.stun_socket(), self._stun_servers(),
                                        timeout_s=CLASSIFY_TIMEOUT_S, contacted=contacted)
        except Exception as e:  # noqa: BLE001 - classification is advice: a failure must not stop the session
            reason = f"the NAT classification failed: {e}"
        if report is not None:
            for a in report.probed:
                self._stun_contacts[tuple(a)] = trio.current_time()
        previous = self.nat_class
        if report is not None:
            self.report = report
            self.nat_class, reason = report.nat_class, report.reason
            if report.rtt_ms is not None:
                self.rendezvous_rtt_ms = report.rtt_ms
        else:
            self.nat_class = UNKNOWN_CLASS
        self.nat_reason = reason if self.nat_class == UNKNOWN_CLASS else ""
        fields = {"nat_class": self.nat_class, "attempt": self.classifications}
        if report is not None:
            fields.update(probes=report.probes, discovery=report.discovery, mapping=report.mapping,
                          filtering=report.filtering)
        if self.nat_reason:
            fields["reason"] = self.nat_reason
            log.warning("NAT class unknown (classification %d): %s", self.classifications, self.nat_reason)
        elif previous == UNKNOWN_CLASS:
            log.info("NAT classified as %s on retry %d", self.nat_class, self.classifications - 1)
        self.event("nat_class", **fields)

    async def _classify_again(self) -> None:
        """Retry an "unknown" classification with backoff until a class is measured."""
        delay_s = CLASSIFY_RETRY_S
        try:
            while self.nat_class == UNKNOWN_CLASS and not self.closed:
                await trio.sleep(delay_s)
                delay_s = min(delay_s * 2, CLASSIFY_RETRY_MAX_S)
                await self._classify_once()
        finally:
            self._retrying_class = False

    def _capability_fields(self) -> dict:
        out = {"nat_class": self.nat_class, "rendezvous_rtt_ms": self.rendezvous_rtt_ms}
        if self.nat_reason:
            out["nat_reason"] = self.nat_reason
        return out

    async def capability(self) -> dict:
        """The capability frame's NAT fields (DESIGN §3 step 3; see :meth:`classify`); classifies once."""
        if self.classifications == 0:
            return await self.classify()
        return self._capability_fields()

