"""Direct paths for ring edges: classification, candidate offers, checks, QUIC (DESIGN §3 steps 3-6, §4; proto_spec 07).

One :class:`PathManager` per session, opened by the session as an async context manager on the
daemon's one :class:`UdpEndpoint` (proto_spec 07 §1)::

    async with open_session_paths(node, rdv, session_id=sid) as paths:
        cap = await paths.capability()            # nat_class, rendezvous_rtt_ms (§1)
        ...  the session's events loop calls paths.on_signal(from_peer_id, body) for each Signal (§2)
        ...  kafilad/node/edge.py forms the ring edges on it (§5) and re-probes relayed ones (§7)

The manager owns one nursery: every ICE agent (checks, then keepalives on the selected pair), QUIC
driver and re-probe of the session runs there. Leaving the block closes every QUIC connection
the manager opened (their CONNECTION_CLOSE leaves at once, even while the session is being
cancelled) and cancels that nursery, so nothing of the session's paths outlives it.

What lives here is the machinery of one *attempt* (:meth:`PathManager.try_direct`): an offer
exchange over rendezvous signals (§2), both classes predicting relay skips the checks at
attempt 0, else an :class:`kafilad.proto.ice.IceAgent` runs (bounded, paced, §3) and on success
the edge's sender opens QUIC to the verified address and the receiver accepts it (§4). The
outcome is noted on the edge's :class:`EdgeRecord` (§6). The life of one edge (securing with
Noise, falling back to the relay, re-probing, the make-before-break switch) is
:class:`kafilad.node.edge.RingEdge`.

Environment (read when used, so each daemon can differ):

- ``KAFILA_DIRECT=0``: relay every edge (benchmarks, debugging).
- ``KAFILA_UDP_BIND=IP`` or ``IP:PORT``: where the daemon's one UDP socket binds (default
  ``0.0.0.0``, any port).
- ``KAFILA_REPROBE_S``: first re-probe delay of a relayed edge in seconds (default 10).
- ``KAFILA_TEST_DROP_CHECKS=N`` (test hook, default 0): this daemon ignores every datagram
  addressed to the connectivity checks of attempts ``try < N`` of every edge, as a firewall
  dropping the peer's UDP would, so those attempts fail honestly (no answer within the check
  timeout) and the edges relay; later re-probes run normally. Used by tests/e2e/test_upgrade.py.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import os
import time
import weakref
from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional
from urllib.parse import urlparse

import attrs
import trio

from kafilad.errors import collapse_groups
from kafilad.net.quic_transport import QuicTransport, quic_accept, quic_connect
from kafilad.net.stun_client import classify_nat, local_address_toward, parse_host_port
from kafilad.net.udp_endpoint import UdpEndpoint
from kafilad.planner.ring import predict_path
from kafilad.proto import ice

log = logging.getLogger("kafilad.paths")

#: How long to wait for the peer's offer signal before relaying (proto_spec 07 §2); also how long
#: a receiver holds a re-probe offer before it is stale (§7 step 2).
OFFER_TIMEOUT_S = 5.0
#: Bound on the QUIC handshake after a verified pair.
QUIC_TIMEOUT_S = 8.0
#: Bound on NAT classification at session start.
CLASSIFY_TIMEOUT_S = 6.0
#: Default first re-probe delay of a relayed edge, and the cap of its doubling (DESIGN §3 step 6).
REPROBE_INITIAL_S = 10.0
REPROBE_MAX_S = 300.0
#: Offers kept in a session's inbox (the oldest are dropped beyond it).
INBOX_OFFERS = 64


def direct_enabled() -> bool:
    """False when ``KAFILA_DIRECT`` is 0 / false / no: every edge relays."""
    return os.environ.get("KAFILA_DIRECT", "1") not in ("0", "false", "no")


def reprobe_initial_s() -> float:
    """First re-probe delay in seconds (``KAFILA_REPROBE_S``, default :data:`REPROBE_INITIAL_S`)."""
    try:
        return max(0.0, float(os.environ.get("KAFILA_REPROBE_S", REPROBE_INITIAL_S)))
    except ValueError:
        return REPROBE_INITIAL_S


def dropped_check_attempts() -> int:
    """Test hook ``KAFILA_TEST_DROP_CHECKS``: attempts ``try`` below this ignore their checks (default 0)."""
    try:
        return max(0, int(os.environ.get("KAFILA_TEST_DROP_CHECKS", "0")))
    except ValueError:
        return 0


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

    @property
    def link(self):
        """The Link this edge uses now (None before it formed)."""
        return self.links[-1] if self.links else None

    @link.setter
    def link(self, value) -> None:
        if value is not None and (not self.links or self.links[-1] is not value):
            self.links.append(value)

    # ---- transitions -------------------------------------------------------------------------
    def note_attempt(self, attempt: int, found: Optional[dict], reason: str = "") -> None:
        """An attempt ended: verified with ``found`` measurements (QUIC up), or failed with ``reason``.

        At attempt 0 a verified pair makes the record "direct" at once; a verified re-probe only
        parks its measurements in ``pending`` until :meth:`upgraded` (proto_spec 07 §7 step 2).
        """
        self.tries = max(self.tries, attempt)
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

    def upgraded(self, link=None) -> None:
        """The ring now uses the re-probed direct path (``link`` on the sender; proto_spec 07 §7 step 3)."""
        found, self.pending = self.pending or {}, None
        self.verify_s, self.rtt_ms, self.remote = found.get("verify_s"), found.get("rtt_ms"), found.get("remote")
        self.path, self.reason, self.upgraded_at = PathKind.DIRECT, "", time.time()
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
        if self.links:  # frame bytes this end sent on the edge, over every path it used, now
            out["link_bytes_sent"] = sum(int(getattr(lk, "bytes_sent", 0) or 0) for lk in self.links)
        return out


class OfferInbox:
    """Candidate offers received over rendezvous signals (proto_spec 07 §2), matched by (edge, try) and sender."""

    def __init__(self, capacity: int = INBOX_OFFERS):
        self.capacity = capacity
        self.offers: dict[tuple[str, int], dict] = {}
        self._changed = trio.Event()

    def store(self, from_peer: str, body, now: float) -> bool:
        """Keep a well-formed offer, stamped with ``from`` and ``received_at`` = ``now``; False if it was dropped."""
        if not isinstance(body, dict) or body.get("t") != "ice_offer":
            return False
        edge, attempt = body.get("edge"), body.get("try", 0)
        if not isinstance(edge, str) or not isinstance(attempt, int) or isinstance(attempt, bool):
            return False
        if not (isinstance(body.get("ufrag"), str) and isinstance(body.get("pwd"), str)):
            return False
        self.offers[(edge, attempt)] = {**body, "from": from_peer, "received_at": now}
        while len(self.offers) > self.capacity:
            self.offers.pop(next(iter(self.offers)))
        self._changed.set()
        self._changed = trio.Event()
        return True

    async def wait(self, edge: str, attempt: int, peer: str, timeout_s: float) -> Optional[dict]:
        """The offer of ``peer`` for (``edge``, ``attempt``), taken out of the inbox; None after ``timeout_s``."""
        with trio.move_on_after(timeout_s):
            while True:
                offer = self.offers.pop((edge, attempt), None)
                if offer is not None and offer["from"] == peer:
                    return offer
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
            for key in [k for k, o in self.offers.items() if k[0] == edge and k[1] >= 1 and o["received_at"] < stale]:
                self.offers.pop(key, None)
            tries = [k for (e, k), o in self.offers.items() if e == edge and k >= 1 and o["from"] == peer]
            if tries:
                newest = max(tries)
                for k in tries:
                    if k != newest:
                        self.offers.pop((edge, k), None)
                return newest
            with trio.move_on_after(OFFER_TIMEOUT_S):
                await changed.wait()


class PathManager:
    """Direct-path machinery of one daemon in one session (make it with :func:`open_session_paths`).

    Args:
        endpoint: the daemon's UDP endpoint (already serving).
        rdv: the session's rendezvous client: ``peer_id``, ``session_id``, ``url``, ``stun_servers``,
            ``send_signal(peer_id, body)``, ``open_circuit(peer_id, label)``.
        nursery: where agents, QUIC drivers and re-probes run; it must not outlive the session.
        inbox: offers that arrived before this manager (default: a new inbox).
        name: this daemon's display name; static_private: its static key (Noise on ring edges).
        session_id: the session's id (default: ``rdv.session_id`` when used).
    Attributes:
        edges: every EdgeRecord this daemon is an end of, by edge id (proto_spec 07 §2).
        report: the NAT classification (a NatReport) once :meth:`classify` ran.
    """

    def __init__(self, endpoint: UdpEndpoint, rdv, nursery, inbox: Optional[OfferInbox] = None, *,
                 name: Optional[str] = None, static_private: Optional[bytes] = None,
                 session_id: Optional[str] = None):
        self.endpoint = endpoint
        self.rdv = rdv
        self.nursery = nursery
        self.name = name if name is not None else getattr(rdv, "name", "?")
        self.static_private = static_private
        self._session_id = session_id
        self.report = None
        self.nat_class: Optional[str] = None
        self.rendezvous_rtt_ms: Optional[float] = None
        self.edges: dict[str, EdgeRecord] = {}
        self.ring_edges: list = []  # the RingEdges of the ring formed last (kafilad/node/edge.py form_ring)
        self.inbox = inbox if inbox is not None else OfferInbox()
        self.closed = False
        self._quic: weakref.WeakSet[QuicTransport] = weakref.WeakSet()
        self._scope: Optional[trio.CancelScope] = None

    @property
    def peer_id(self) -> str:
        return self.rdv.peer_id

    @property
    def session_id(self) -> str:
        return self._session_id or getattr(self.rdv, "session_id", "") or ""

    def close(self) -> None:
        """End every path of the session now: close its QUIC connections, stop agents and re-probes.

        Synchronous so it runs even while the session is being cancelled: each connection's
        CONNECTION_CLOSE is sent before this returns (RFC 9000 §10.2), the peer sees a clean end.
        As with any nursery, cancelling it also cancels the body of the ``open_session_paths``
        block; the block calls this on exit.
        """
        self.closed = True
        for t in list(self._quic):
            t.close_now()
        if self._scope is not None:
            self._scope.cancel()

    # ---- classification ------------------------------------------------------------------------
    async def classify(self) -> dict:
        """Classify our NAT on the endpoint's socket; {"nat_class", "rendezvous_rtt_ms"} (None if unknown)."""
        servers = [parse_host_port(s) if isinstance(s, str) else tuple(s)
                   for s in getattr(self.rdv, "stun_servers", None) or []]
        if servers:
            try:
                self.report = await classify_nat(self.endpoint.stun_socket(), servers, timeout_s=CLASSIFY_TIMEOUT_S)
                self.nat_class = self.report.nat_class
                self.rendezvous_rtt_ms = self.report.rtt_ms
            except Exception as e:  # classification is advice: a failure must not stop the session
                log.warning("NAT classification failed: %s", e)
        return {"nat_class": self.nat_class, "rendezvous_rtt_ms": self.rendezvous_rtt_ms}

    async def capability(self) -> dict:
        """{"nat_class", "rendezvous_rtt_ms"} for the capability frame (DESIGN §3 step 3); classifies once."""
        if self.report is None:
            return await self.classify()
        return {"nat_class": self.nat_class, "rendezvous_rtt_ms": self.rendezvous_rtt_ms}

    async def candidates(self) -> list[str]:
        """Our candidates as SDP strings: host (toward the rendezvous) then server-reflexive (proto_spec 07 §2)."""
        port = self.endpoint.local_address[1]
        out = []
        host = urlparse(getattr(self.rdv, "url", "") or "").hostname
        if host:
            try:
                target = (str(ipaddress.ip_address(host)), 9)
            except ValueError:
                target = None
                try:
                    infos = await trio.socket.getaddrinfo(host, 9, family=trio.socket.AF_INET)
                    target = (infos[0][4][0], 9)
                except OSError:
                    pass
            if target is not None:
                local = await local_address_toward(self.endpoint.sock, target)
                if local is not None:
                    out.append(ice.make_candidate("host", (local[0], port)))
        if self.report is not None and self.report.mapped_address is not None:
            mapped = tuple(self.report.mapped_address)
            if not out or (out[0].host, out[0].port) != mapped:
                out.append(ice.make_candidate("srflx", mapped))
        return ice.candidates_to_sdp(out)

    # ---- signals -------------------------------------------------------------------------------
    def on_signal(self, from_peer: str, body) -> None:
        """Take a rendezvous signal body (proto_spec 07 §2); malformed ones are dropped.

        The session's events loop calls this for every ``Signal`` event.
        """
        self.inbox.store(from_peer, body, trio.current_time())

    # ---- edges ---------------------------------------------------------------------------------
    def edge_id(self, peer_id: str, sender: bool) -> str:
        """``<session_id>:<sender peer id>><receiver peer id>`` (proto_spec 07 §2)."""
        me = self.peer_id
        return f"{self.session_id}:{me}>{peer_id}" if sender else f"{self.session_id}:{peer_id}>{me}"

    def record(self, peer_id: str, peer_name: str, *, sender: bool, me_name: Optional[str] = None,
               new: bool = False) -> EdgeRecord:
        """The record of our edge to (``sender``) or from ``peer_id``, made on first use (or anew if ``new``)."""
        edge = self.edge_id(peer_id, sender)
        rec = self.edges.get(edge)
        if rec is None or new:
            me = me_name or self.name
            rec = self.edges[edge] = EdgeRecord(me if sender else peer_name, peer_name if sender else me)
        return rec

    def edge_from_me(self, peer_id: str) -> Optional[EdgeRecord]:
        return self.edges.get(self.edge_id(peer_id, True))

    def edge_list(self) -> list[dict]:
        """Every edge's status record (proto_spec 07 §6)."""
        return [r.to_json() for r in self.edges.values()]

    # ---- one attempt ---------------------------------------------------------------------------
    async def direct(self, *, peer_id: str, peer_name: str, sender: bool, me_name: Optional[str] = None,
                     attempt: int = 0) -> Optional[QuicTransport]:
        """One direct attempt on the edge to (``sender``) or from ``peer_id``, noted on its record.

        Returns:
            The QUIC transport over the verified path, or None (the record says why).
        """
        rec = self.record(peer_id, peer_name, sender=sender, me_name=me_name)
        return await self.try_direct(rec, peer_id=peer_id, peer_name=peer_name, sender=sender, attempt=attempt)

    async def try_direct(self, rec: EdgeRecord, *, peer_id: str, peer_name: str, sender: bool,
                         attempt: int = 0) -> Optional[QuicTransport]:
        """One offer exchange, check run and QUIC handshake on ``rec``'s edge (proto_spec 07 §2-§4).

        Args:
            sender: True on the edge's sender (ICE controlling, QUIC client).
            attempt: 0 at formation, then 1, 2, ... for re-probes (kept apart in signals, §7).
        Returns:
            The QUIC transport, or None; the outcome is noted on ``rec`` (:meth:`EdgeRecord.note_attempt`).
        """
        t, found = await self._attempt(rec, edge=self.edge_id(peer_id, sender), peer_id=peer_id,
                                       peer_name=peer_name, sender=sender, attempt=attempt)
        rec.note_attempt(attempt, found if t is not None else None, found.get("reason", ""))
        return t

    async def _attempt(self, rec: EdgeRecord, *, edge: str, peer_id: str, peer_name: str, sender: bool,
                       attempt: int) -> tuple[Optional[QuicTransport], dict]:
        """(transport, measurements) or (None, {"reason"})."""
        if not direct_enabled():
            return None, {"reason": "direct paths are disabled (KAFILA_DIRECT=0)"}
        creds = ice.new_credentials()
        offer = {"t": "ice_offer", "edge": edge, "try": attempt, "ufrag": creds.ufrag, "pwd": creds.pwd,
                 "cands": await self.candidates(), "nat_class": self.nat_class}
        t0 = trio.current_time()
        try:
            await self.rdv.send_signal(peer_id, offer)
        except trio.BrokenResourceError:
            return None, {"reason": "the rendezvous connection was lost"}
        theirs = await self.inbox.wait(edge, attempt, peer_id, OFFER_TIMEOUT_S)
        if theirs is None:
            return None, {"reason": f"no candidate offer from {peer_name} within {OFFER_TIMEOUT_S:g} s"}
        their_class = theirs.get("nat_class") if theirs.get("nat_class") in ("O", "C", "S") else None
        rec.predicted = PathKind(predict_path(self.nat_class, their_class))
        if rec.predicted == PathKind.RELAYED and attempt == 0:
            return None, {"reason": f"predicted relay ({self.nat_class}-{their_class})"}
        agent = ice.IceAgent(controlling=sender, local=creds, remote=ice.Credentials(theirs["ufrag"], theirs["pwd"]),
                             remote_candidates=ice.candidates_from_sdp(theirs.get("cands")),
                             now=trio.current_time(), tie_breaker=int.from_bytes(os.urandom(8), "big"))
        result = await self._run_checks(agent, rec, deaf=attempt < dropped_check_attempts())
        if not isinstance(result, ice.PathVerified):
            return None, {"reason": result.reason if result else "the checks stopped"}
        found = {"verify_s": trio.current_time() - t0, "rtt_ms": result.rtt_ms,
                 "remote": f"{result.remote[0]}:{result.remote[1]}"}
        try:
            if sender:
                t = await quic_connect(self.endpoint, result.remote, self.nursery, timeout_s=QUIC_TIMEOUT_S)
            else:
                t = await quic_accept(self.endpoint, result.remote, self.nursery, timeout_s=QUIC_TIMEOUT_S)
        except trio.BrokenResourceError as e:
            return None, {"reason": f"QUIC did not connect over the verified path: {e}"}
        self._quic.add(t)
        if self.closed:  # the session ended while QUIC connected
            t.close_now()
            return None, {"reason": "the session ended"}
        return t, found

    async def _run_checks(self, agent: ice.IceAgent, rec: EdgeRecord, *, deaf: bool = False):
        """Drive ``agent`` until it selects a pair or fails; it keeps running in the nursery afterwards
        (answering checks, keepalives every 15 s, proto_spec 07 §3) until the path is lost or the
        session's paths close.

        ``deaf`` (the ``KAFILA_TEST_DROP_CHECKS`` hook) leaves the agent unregistered with the
        endpoint: its checks go out but nothing addressed to it is delivered, so it fails after
        its check timeout exactly as behind a firewall dropping the peer's datagrams.
        """
        wake = trio.Event()

        def on_stun(data: bytes, addr) -> bool:
            claimed = agent.receive_datagram(data, addr, trio.current_time())
            if claimed:
                wake.set()
            return claimed

        if deaf:
            log.warning("ring edge %s -> %s: ignoring this attempt's checks (KAFILA_TEST_DROP_CHECKS test hook)",
                        rec.src, rec.dst)
        else:
            self.endpoint.add_stun_handler(on_stun)
        outcome: dict = {}
        settled = trio.Event()

        async def drive() -> None:
            nonlocal wake
            try:
                while True:
                    for data, dst in agent.datagrams_to_send(trio.current_time()):
                        await self.endpoint.sendto(data, dst)
                    while (ev := agent.next_event()) is not None:
                        if isinstance(ev, (ice.PathVerified, ice.ChecksFailed)) and "ev" not in outcome:
                            outcome["ev"] = ev
                            settled.set()
                        elif isinstance(ev, ice.PathLost):
                            rec.reason = ev.reason
                            log.warning("ring edge %s -> %s: %s", rec.src, rec.dst, ev.reason)
                    timer = agent.get_timer()
                    if timer is None:
                        return
                    with trio.move_on_at(timer):
                        await wake.wait()
                    wake = trio.Event()
                    now = trio.current_time()
                    if now >= timer:
                        agent.handle_timer(now)
            finally:
                if not deaf:
                    self.endpoint.remove_stun_handler(on_stun)
                settled.set()

        self.nursery.start_soon(drive)
        await settled.wait()
        return outcome.get("ev")

    async def wait_reprobe(self, *, peer_id: str) -> int:
        """Receiver: the newest re-probe attempt (``try`` >= 1) ``peer_id`` offered on its edge to us (§7)."""
        return await self.inbox.newest_reprobe(self.edge_id(peer_id, False), peer_id)


@asynccontextmanager
async def open_session_paths(node, rdv, *, session_id: Optional[str] = None,
                             endpoint: Optional[UdpEndpoint] = None,
                             inbox: Optional[OfferInbox] = None) -> AsyncIterator[PathManager]:
    """The session's PathManager for the duration of the block; on exit every path of it ends.

    Args:
        node: the daemon (``name``, ``static_private``; and ``nursery`` to serve its UDP endpoint
            on first use when ``endpoint`` is not given).
        rdv: the session's rendezvous client.
        session_id: the session id (default: ``rdv.session_id`` when an edge is made).
        endpoint: the daemon's UDP endpoint, serving (default: :func:`endpoint_of` ``node``).
        inbox: offers received before the block (default: a new inbox).
    Yields:
        The PathManager. Its nursery holds every agent, QUIC driver and re-probe of the session;
        leaving the block closes its QUIC connections at once and cancels that nursery.
    """
    ep = endpoint if endpoint is not None else await endpoint_of(node)
    with collapse_groups():
        async with trio.open_nursery() as nursery:
            pm = PathManager(ep, rdv, nursery, inbox, name=getattr(node, "name", None),
                             static_private=getattr(node, "static_private", None), session_id=session_id)
            pm._scope = nursery.cancel_scope
            try:
                yield pm
            finally:
                pm.close()


# ---- the daemon's one UDP endpoint (proto_spec 07 §1) ------------------------------------------

_ENDPOINTS: "weakref.WeakKeyDictionary[object, UdpEndpoint]" = weakref.WeakKeyDictionary()


async def endpoint_of(node) -> UdpEndpoint:
    """The daemon's one UDP endpoint, bound on first use (``KAFILA_UDP_BIND``) and served in the
    node's root nursery for the daemon's lifetime (proto_spec 07 §1)."""
    ep = _ENDPOINTS.get(node)
    if ep is None:
        host, port = bind_address(os.environ.get("KAFILA_UDP_BIND", ""))
        ep = await UdpEndpoint.bind(host, port)
        _ENDPOINTS[node] = ep
        await node.nursery.start(ep.serve)
    return ep


def bind_address(spec: str) -> tuple[str, int]:
    """``KAFILA_UDP_BIND`` as (host, port): "", "IP", "IP:PORT" or "[IPv6]:PORT"; port 0 = any."""
    spec = spec.strip()
    if not spec:
        return "0.0.0.0", 0
    if spec.startswith("[") or spec.count(":") == 1:
        host, port = parse_host_port(spec)
        return host, int(port)
    return spec, 0
