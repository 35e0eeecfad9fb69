"""Direct paths for ring edges: classification, candidate offers, checks, QUIC (DESIGN §3 steps 3-6, §4; proto_spec 07).

One :class:`PathManager` per session, opened by the session as an async context manager on the
daemon's one :class:`UdpEndpoint` (proto_spec 07 §1)::

    async with open_session_paths(node, rdv, session_id=sid) as paths:
        cap = await paths.capability()            # nat_class, rendezvous_rtt_ms (§1)
        ...  the session's events loop calls paths.on_signal(from_peer_id, body) for each Signal (§2)
        ...  kafilad/node/paths/edge.py forms the ring edges on it (§5) and re-probes relayed ones (§7)

The manager owns one nursery: every ICE agent (checks, then keepalives on the selected pair), QUIC
driver and re-probe of the session runs there. Leaving the block closes every QUIC connection
the manager opened (their CONNECTION_CLOSE leaves at once, even while the session is being
cancelled) and cancels that nursery, so nothing of the session's paths outlives it.

Classification (§1): :meth:`PathManager.capability` classifies once; an "unknown" class (no STUN
answer; proto_spec 04 §4.6) is reported with its reason, noted as an event and retried in the
background with backoff. Records and events: kafilad/node/paths/records.py, ``PathManager.events``.

What lives here is the machinery of one *attempt* (:meth:`PathManager.try_direct`): an offer
exchange over rendezvous signals (§2) carrying host candidates (the interface addresses, RFC 8445
§5.1.1.1) and the server-reflexive one; both classes predicting relay skips the checks at
attempt 0 unless the ends share a NAT or a LAN (then the host candidates connect), else an
:class:`kafilad.proto.ice.IceAgent` runs (bounded, paced, §3) and on success
the edge's sender opens QUIC to the verified address and the receiver accepts it (§4). The
outcome is noted on the edge's :class:`EdgeRecord` (§6). The life of one edge (securing with
Noise, falling back to the relay, re-probing, the make-before-break switch) is
:class:`kafilad.node.paths.edge.RingEdge`.

A re-probe between C and S or S and S searches by birthday probing instead (§7b,
kafilad/node/paths/birthday.py): the S end's extra sockets and the C end's port sweep; the pair found is
a (socket, remote) pair, and its ICE agent and QUIC connection live on that socket's endpoint,
which :meth:`PathManager.release` closes with the path. Classification (§1) and the datagram size
search (§4a) live in kafilad/node/paths/classify.py and kafilad/node/paths/sizes.py (parts of PathManager, in its `nat` and `sizes` fields).

Environment (read when used, so each daemon can differ):

- ``KAFILA_DIRECT=0``: relay every edge (benchmarks, debugging).
- ``KAFILA_UDP_BIND=IP`` or ``IP:PORT``: where the daemon's one UDP socket binds (default
  ``0.0.0.0``, any port).
- ``KAFILA_REPROBE_S``: first re-probe delay of a relayed edge in seconds (default 10; a C–S or
  S–S edge's first re-probe runs at once, §7b).
- ``KAFILA_BIRTHDAY=0``: no birthday search (C–S and S–S re-probes run ordinary checks).
- ``KAFILA_TEST_DROP_CHECKS=N`` (test hook, default 0): this daemon ignores every datagram
  addressed to the connectivity checks of attempts ``try < N`` of every edge, as a firewall
  dropping the peer's UDP would, so those attempts fail honestly (no answer within the check
  timeout) and the edges relay; later re-probes run normally. Used by tests/e2e/test_upgrade.py.
- ``KAFILA_TEST_ADVERTISE=IP:PORT`` (test hook): the daemon offers this address as its only
  candidate, a host candidate (an emulated WAN hop's forwarder in front of its socket,
  kafila_ctl/wan_hops.py), so every direct edge to it crosses that forwarder.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import os
import time
import weakref
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Optional
from urllib.parse import urlparse

import trio

from kafilad.errors import SessionError, collapse_groups
from kafilad.net.quic_config import initial_dcid
from kafilad.net.quic_open import quic_accept, quic_connect
from kafilad.net.quic_transport import QuicTransport
from kafilad.net.stun_client import local_address_toward, parse_host_port
from kafilad.net.udp_endpoint import UdpEndpoint
from kafilad.node.paths import birthday
from kafilad.node.paths.classify import (CLASSIFY_RETRY_MAX_S, CLASSIFY_RETRY_S, CLASSIFY_TIMEOUT_S,  # noqa: F401 - re-exported
                                    STUN_CONTACT_MEMORY_S, NatClassifier)
from kafilad.node.paths.records import INBOX_OFFERS, OFFER_TIMEOUT_S, EdgeRecord, OfferInbox, PathKind  # noqa: F401 - re-exported
from kafilad.node.paths.sizes import PathSizes
from kafilad.planner.ring import class_known, predict_path
from kafilad.proto import ice
from kafilad.proto.birthday import role_for as bd_role_for
from kafilad.proto.pmtu import LADDER_BYTES
from kafilad.proto.ring_frames import IceOffer

log = logging.getLogger("kafilad.paths")

#: Bound on the QUIC handshake after a verified pair.
QUIC_TIMEOUT_S = 8.0
#: Host candidates offered from the interface list, beside the routed one (RFC 8445 §5.1.1.1).
MAX_HOST_CANDIDATES = 4
#: Path events kept for status and tests (PathManager.events).
EVENTS_KEPT = 64
#: Default first re-probe delay of a relayed edge, and the cap of its doubling (DESIGN §3 step 6).
REPROBE_INITIAL_S = 10.0
REPROBE_MAX_S = 300.0


def _addr(a) -> str:
    return f"{a[0]}:{a[1]}"


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


def advertised_candidate() -> Optional[tuple[str, int]]:
    """Test hook ``KAFILA_TEST_ADVERTISE``: the (IP, PORT) offered as this daemon's only candidate, or
    None (unset, or not IP:PORT: then a warning, and the daemon's own candidates)."""
    text = os.environ.get("KAFILA_TEST_ADVERTISE", "").strip()
    if not text:
        return None
    host, _, port = text.rpartition(":")
    try:
        return str(ipaddress.ip_address(host)), int(port)
    except ValueError:
        log.warning("KAFILA_TEST_ADVERTISE=%r is not IP:PORT; offering this daemon's own candidates", text)
        return None


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
        nat: the NAT classification (kafilad/node/paths/classify.py NatClassifier); ``nat_class``,
            ``nat_reason`` and ``report`` read it.
        events: the last EVENTS_KEPT path events as dicts {"event", "ts", ...} (classifications,
            fallbacks, failed re-probes; proto_spec 07 §6).
        on_event: called as ``on_event(kind, fields)`` for each event, e.g. to write the session
            trace (the session driver sets it; errors in it are logged, never raised).
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
        self.events: collections.deque = collections.deque(maxlen=EVENTS_KEPT)
        self.on_event: Optional[Callable[[str, dict], object]] = None
        self.nat = NatClassifier(endpoint, rdv, nursery, self.event, lambda: self.closed)
        self.edges: dict[str, EdgeRecord] = {}
        self.ring_edges: list = []  # the RingEdges of the ring formed last (kafilad/node/paths/edge.py form_ring)
        self.ring_epoch = 0  # the plan epoch of that ring: part of its edges' ids (proto_spec 07 §2)
        self.inbox = inbox if inbox is not None else OfferInbox()
        self.closed = False
        self._quic: weakref.WeakSet[QuicTransport] = weakref.WeakSet()
        self._agents: "weakref.WeakKeyDictionary[QuicTransport, tuple]" = weakref.WeakKeyDictionary()
        self._wakers: dict = {}  # running ICE agent -> wakes its driver (to stop it at once)
        self.sizes = PathSizes(self._agents, self._wakers, self.event)
        self._pools: "weakref.WeakKeyDictionary[QuicTransport, birthday.SocketPool]" = weakref.WeakKeyDictionary()
        self._scope: Optional[trio.CancelScope] = None

    @property
    def peer_id(self) -> str:
        return self.rdv.peer_id

    # ---- NAT classification (proto_spec 07 §1): the ``nat`` part's ----------------------------
    @property
    def nat_class(self) -> Optional[str]:
        return self.nat.nat_class

    @property
    def nat_reason(self) -> str:
        return self.nat.nat_reason

    @property
    def report(self):
        return self.nat.report

    async def classify(self) -> dict:
        """Classify our NAT now (NatClassifier.classify); the capability's NAT fields."""
        return await self.nat.classify()

    async def capability(self) -> dict:
        """The capability frame's NAT fields (DESIGN §3 step 3); classifies once (NatClassifier.capability)."""
        return await self.nat.capability()

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

    # ---- events --------------------------------------------------------------------------------
    def event(self, kind: str, **fields) -> None:
        """Note a path event (proto_spec 07 §6): kept in ``events`` and handed to ``on_event``."""
        self.events.append({"event": kind, "ts": time.time(), **fields})
        if self.on_event is not None:
            try:
                self.on_event(kind, dict(fields))
            except Exception:  # noqa: BLE001 - a trace writer's failure must not stop a path
                log.exception("paths: the event hook failed on %s", kind)

    async def candidates(self) -> list[str]:
        """Our candidates as SDP strings (proto_spec 07 §2), best first, at most 1 + MAX_HOST_CANDIDATES + 1:

        host candidates: the source address the kernel picks toward the rendezvous, then this
        socket's other interface addresses (RFC 8445 §5.1.1.1: no loopback or link-local, bounded;
        two members on one LAN or behind one NAT reach each other there), all with the socket's
        port; then the server-reflexive (STUN-mapped) address when it differs.
        """
        advertised = advertised_candidate()
        if advertised is not None:  # the KAFILA_TEST_ADVERTISE hook: a forwarder stands in front of us
            return ice.candidates_to_sdp([ice.make_candidate("host", advertised)])
        port = self.endpoint.local_address[1]
        hosts: list[str] = []
        target = await self._rendezvous_target()
        if target is not None:
            local = await local_address_toward(self.endpoint.sock, target)
            if local is not None:
                hosts.append(local[0])
        for ip, _prefix in self._interfaces():
            if ip not in hosts and len(hosts) < 1 + MAX_HOST_CANDIDATES:
                hosts.append(ip)
        out = [ice.make_candidate("host", (ip, port)) for ip in hosts]
        if self.report is not None and self.report.mapped_address is not None:
            mapped = tuple(self.report.mapped_address)
            if all((c.host, c.port) != mapped for c in out):
                out.append(ice.make_candidate("srflx", mapped))
        return ice.candidates_to_sdp(out)

    def _interfaces(self) -> list[tuple[str, int]]:
        try:
            return list(self.endpoint.interfaces())
        except (OSError, ValueError) as e:
            log.warning("paths: no interface addresses: %s", e)
            return []

    async def _rendezvous_target(self) -> Optional[tuple[str, int]]:
        host = urlparse(getattr(self.rdv, "url", "") or "").hostname
        if not host:
            return None
        try:
            return (str(ipaddress.ip_address(host)), 9)
        except ValueError:
            pass
        try:
            infos = await trio.socket.getaddrinfo(host, 9, family=trio.socket.AF_INET)
            return (infos[0][4][0], 9)
        except OSError:
            return None

    def shares_network(self, their_candidates: list) -> bool:
        """True when the peer is behind our own NAT or on one of our networks (proto_spec 07 §2):
        its server-reflexive address has our mapped IP, or a host candidate of its lies in the
        network of one of our interfaces. Checks then run even if the classes predict relay."""
        mapped = self.report.mapped_address if self.report is not None else None
        nets = []
        for ip, prefix in self._interfaces():
            try:
                nets.append(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))
            except ValueError:
                continue
        mine = {ip for ip, _ in self._interfaces()}
        for c in their_candidates:
            if c.type == "srflx" and mapped is not None and c.host == mapped[0]:
                return True
            if c.type == "host" and c.host not in mine:
                try:
                    a = ipaddress.ip_address(c.host)
                except ValueError:
                    continue
                if any(a in n for n in nets if n.prefixlen < n.max_prefixlen):
                    return True
        return False

    # ---- signals -------------------------------------------------------------------------------
    def on_signal(self, from_peer: str, body) -> None:
        """Take a rendezvous signal body (proto_spec 07 §2); malformed ones are dropped.

        The session's events loop calls this for every ``Signal`` event.
        """
        self.inbox.store(from_peer, body, trio.current_time())

    # ---- edges ---------------------------------------------------------------------------------
    def edge_id(self, peer_id: str, sender: bool) -> str:
        """``<session_id>:<plan epoch>:<sender peer id>><receiver peer id>`` (proto_spec 07 §2).

        The epoch is :attr:`ring_epoch`, the plan of the ring formed last, so an offer or circuit
        meant for an edge of an earlier ring never pairs with the same two members' edge of this one.
        """
        me = self.peer_id
        pair = f"{me}>{peer_id}" if sender else f"{peer_id}>{me}"
        return f"{self.session_id}:{self.ring_epoch}:{pair}"

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
        rec.note_attempt(attempt, found if t is not None else None, found.get("reason", ""), now_s=time.time())
        return t

    async def _attempt(self, rec: EdgeRecord, *, edge: str, peer_id: str, peer_name: str, sender: bool,
                       attempt: int) -> tuple[Optional[QuicTransport], dict]:
        """(transport, measurements) or (None, {"reason"})."""
        if not direct_enabled():
            return None, {"reason": "direct paths are disabled (KAFILA_DIRECT=0)"}
        creds = ice.new_credentials()
        offer = IceOffer(edge=edge, attempt=attempt, ufrag=creds.ufrag, pwd=creds.pwd,
                         cands=tuple(await self.candidates()), nat_class=self.nat_class,
                         nat_reason=self.nat_reason or None, birthday=birthday.birthday_enabled()).to_wire()
        t0 = trio.current_time()
        try:
            await self.rdv.send_signal(peer_id, offer)
        except (trio.BrokenResourceError, SessionError):  # lost, or reconnecting (issue 8 §3)
            return None, {"reason": "the rendezvous connection was lost"}
        log.debug("edge %s try %d: offer sent to %s", edge, attempt, peer_name)
        theirs = await self.inbox.wait(edge, attempt, peer_id, OFFER_TIMEOUT_S)
        log.debug("edge %s try %d: %s", edge, attempt, "their offer came" if theirs else "no offer came")
        if theirs is None:
            return None, {"reason": f"no candidate offer from {peer_name} within {OFFER_TIMEOUT_S:g} s"}
        their_class = theirs.nat_class
        their_cands = ice.candidates_from_sdp(list(theirs.cands))
        self._note_classes(rec, their_class, theirs.nat_reason, peer_name)
        rec.predicted = PathKind(predict_path(self.nat_class, their_class))
        rec.same_network = self.shares_network(their_cands)
        if rec.predicted == PathKind.RELAYED and rec.same_network:
            rec.predicted = PathKind.DIRECT  # one NAT or one LAN: the host candidates connect (§2)
        if rec.predicted == PathKind.RELAYED and attempt == 0:
            return None, {"reason": f"predicted relay ({self.nat_class}-{their_class})"}
        their_creds = ice.Credentials(theirs.ufrag, theirs.pwd)
        deaf = attempt < dropped_check_attempts()
        endpoint, pool, found = self.endpoint, None, {}
        role, peer = self._birthday_role(theirs, their_class, their_cands, attempt)
        if role is not None:  # C-S or S-S re-probe: search by birthday probing (§7b)
            out = await birthday.search(self, rec, role=role, controlling=sender, local=creds, remote=their_creds,
                                        peer=peer, deaf=deaf)
            self.event("birthday", edge=f"{rec.src} -> {rec.dst}", tries=attempt, ok=out.verified is not None,
                       **out.stats, **({"remote": _addr(out.verified.remote)} if out.verified else {"reason": out.reason}))
            if out.verified is None:
                return None, {"reason": out.reason}
            agent, result, endpoint, pool = out.agent, out.verified, out.endpoint, out.pool
            found["birthday"] = {k: out.stats[k] for k in ("role", "sockets", "probes", "search_s")}
        else:
            agent = ice.IceAgent(controlling=sender, local=creds, remote=their_creds, remote_candidates=their_cands,
                                 now=trio.current_time(), tie_breaker=int.from_bytes(os.urandom(8), "big"))
            result = await self._run_checks(agent, rec, deaf=deaf)
            log.debug("edge %s try %d: checks ended: %r", edge, attempt, result)
            if not isinstance(result, ice.PathVerified):
                agent.close()
                return None, {"reason": result.reason if result else "the checks stopped"}
        found.update(verify_s=trio.current_time() - t0, rtt_ms=result.rtt_ms, remote=_addr(result.remote))
        t = None
        ours, theirs_c = (creds, their_creds) if sender else (their_creds, creds)  # (sender's, receiver's)
        odcid = initial_dcid(ours.ufrag, ours.pwd, theirs_c.ufrag, theirs_c.pwd)  # this attempt's connection (§4)
        try:
            if sender:
                t = await quic_connect(endpoint, result.remote, self.nursery, timeout_s=QUIC_TIMEOUT_S, odcid=odcid)
            else:
                t = await quic_accept(endpoint, result.remote, self.nursery, timeout_s=QUIC_TIMEOUT_S, odcid=odcid)
        except trio.BrokenResourceError as e:
            log.debug("edge %s try %d: QUIC did not connect: %s", edge, attempt, e)
            self._stop_agent(agent)
            return None, {"reason": f"QUIC did not connect over the verified path: {e}"}
        finally:
            if t is None and pool is not None:  # the extra socket carries no path
                pool.close()
        self._quic.add(t)
        self._agents[t] = (agent, self._wakers.get(agent))
        if pool is not None:
            self._pools[t] = pool
        t.watch()  # PINGs every LIVENESS_PING_S: the edge sees a dead path within seconds (§7a)
        if sender and t.datagram_bytes < max(LADDER_BYTES):  # a network path: find its size (§4a)
            self.nursery.start_soon(self.sizes.search, t, agent, rec)
        if self.closed:  # the session ended while QUIC connected
            self.release(t)
            return None, {"reason": "the session ended"}
        return t, found

    def _note_classes(self, rec: EdgeRecord, their_class: Optional[str], their_reason, peer_name: str) -> None:
        """Record both ends' NAT classes on the edge, with the reasons of unknown ones (proto_spec 07 §6)."""
        me = rec.src if rec.dst == peer_name else rec.dst
        rec.classes = {me: self.nat_class, peer_name: their_class}
        rec.class_reasons = {}
        if self.nat_class is not None and not class_known(self.nat_class):
            rec.class_reasons[me] = self.nat_reason or "the NAT classification did not finish"
        if their_class is not None and not class_known(their_class):
            rec.class_reasons[peer_name] = their_reason if isinstance(their_reason, str) and their_reason else \
                "the NAT classification did not finish"

    def _birthday_role(self, theirs: IceOffer, their_class: Optional[str], their_cands: list, attempt: int):
        """(our role, the peer's server-reflexive address) when this attempt searches by birthday
        probing (§7b): a re-probe between C and S or S and S, both ends willing, the peer's mapped
        address known; else (None, None)."""
        role = bd_role_for(self.nat_class, their_class)
        if role is None or attempt < 1 or not birthday.birthday_enabled() or not theirs.birthday:
            return None, None
        srflx = [c for c in their_cands if c.type == "srflx"]
        if not srflx:
            return None, None
        return role, (srflx[0].host, srflx[0].port)

    def release(self, transport: Optional[QuicTransport]) -> None:
        """Let a direct path go: close its QUIC connection now and stop its ICE agent's keepalives
        (an edge that moved to another path, proto_spec 07 §7-§7a). Idempotent; None is ignored."""
        if transport is None:
            return
        transport.close_now()
        agent, waker = self._agents.pop(transport, (None, None))
        if agent is not None:
            self._stop_agent(agent)
        pool = self._pools.pop(transport, None)
        if pool is not None:  # the extra socket of a birthday path closes with it (§7b)
            pool.close()

    def _stop_agent(self, agent: ice.IceAgent) -> None:
        agent.close()
        waker = self._wakers.pop(agent, None)
        if waker is not None:
            waker()

    async def _run_checks(self, agent: ice.IceAgent, rec: EdgeRecord, *, deaf: bool = False,
                          endpoint: Optional[UdpEndpoint] = None):
        """Drive ``agent`` until it selects a pair or fails; it keeps running in the nursery afterwards
        (answering checks, keepalives every 15 s, proto_spec 07 §3) until the path is lost or the
        session's paths close.

        ``deaf`` (the ``KAFILA_TEST_DROP_CHECKS`` hook) leaves the agent unregistered with the
        endpoint: its checks go out but nothing addressed to it is delivered, so it fails after
        its check timeout exactly as behind a firewall dropping the peer's datagrams. ``endpoint``:
        the socket the pair lives on (default the daemon's; a birthday path's extra socket, §7b).
        """
        ep = endpoint if endpoint is not None else self.endpoint
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
            ep.add_stun_handler(on_stun)
        outcome: dict = {}
        settled = trio.Event()

        async def drive() -> None:
            nonlocal wake
            try:
                while True:
                    for data, dst in agent.datagrams_to_send(trio.current_time()):
                        await ep.sendto(data, dst)
                    while (ev := agent.next_event()) is not None:
                        if isinstance(ev, (ice.PathVerified, ice.ChecksFailed)) and "ev" not in outcome:
                            outcome["ev"] = ev
                            settled.set()
                        elif isinstance(ev, ice.SizeConfirmed):
                            self.sizes.size_confirmed(agent, ev.size_bytes)
                        elif isinstance(ev, ice.PathLost):
                            log.warning("ring edge %s -> %s: %s", rec.src, rec.dst, ev.reason)
                            self.event("path_lost", edge=f"{rec.src} -> {rec.dst}", reason=ev.reason)
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
                    ep.remove_stun_handler(on_stun)
                self._wakers.pop(agent, None)
                settled.set()

        self._wakers[agent] = lambda: wake.set()
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
    node's root nursery for the daemon's lifetime (proto_spec 07 §1). A node with a ``udp_endpoint``
    attribute (tests: an endpoint on an in-memory network, tests/netsim.py) uses that one."""
    ep = getattr(node, "udp_endpoint", None) or _ENDPOINTS.get(node)
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
