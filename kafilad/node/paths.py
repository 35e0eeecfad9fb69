"""Direct paths for ring edges: candidates over rendezvous signals, checks, QUIC, relay fallback (DESIGN §3 steps 3-6, §4; proto_spec 07).

One :class:`PathManager` per session and daemon, on the daemon's one :class:`UdpEndpoint`:

1. :meth:`PathManager.classify` runs RFC 5780 discovery on that socket against the rendezvous's
   STUN addresses (advertised in `registered` / `joined`, proto_spec 03) and keeps the report: its
   class and RTT go into the member's capability frame, its mapped address is our srflx candidate.
2. For each chosen ring edge only, both ends call :meth:`PathManager.direct`: each sends an
   offer signal (proto_spec 07 §2) with fresh ICE credentials, candidates and its NAT class; when
   both classes predict relay (C–S, S–S) both skip the checks at once; otherwise an
   :class:`kafilad.proto.ice.IceAgent` runs (bounded, paced) and on success the edge's sender opens
   QUIC to the verified address and the receiver accepts it. Any failure returns None and the
   caller (kafilad/node/stagehost.py ``connect_ring``) uses the relayed circuit instead.
3. Every outcome is kept as an :class:`EdgeRecord` (predicted and actual path, RTT, time to verify)
   for ``status --json`` and the session trace.
4. A relayed edge is re-probed (:meth:`PathManager.reprobe`, proto_spec 07 §7): the sender retries
   with offers ``try`` = 1, 2, ... after a backoff doubling from ``KAFILA_REPROBE_S`` (10 s) to 5 min;
   the receiver answers every re-probe offer it gets. A re-probe that verifies a pair and finishes
   Noise returns the new link; ``stagehost.connect_ring`` switches the ring onto it (make before
   break) and :meth:`PathManager.mark_upgraded` records the switch.

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

import ipaddress
import logging
import os
import time
from typing import Awaitable, Callable, Optional
from urllib.parse import urlparse

import attrs
import trio

from kafilad.net.quic_transport import QuicTransport, quic_accept, quic_connect
from kafilad.net.stun_client import classify_nat, local_address_toward, parse_host_port
from kafilad.net.udp_endpoint import UdpEndpoint
from kafilad.planner.ring import predict_path
from kafilad.proto import ice

log = logging.getLogger("kafilad.paths")

#: How long to wait for the peer's offer signal before relaying.
OFFER_TIMEOUT_S = 5.0
#: Bound on the QUIC handshake after a verified pair.
QUIC_TIMEOUT_S = 8.0
#: Bound on NAT classification at session start.
CLASSIFY_TIMEOUT_S = 6.0
#: Default first re-probe delay of a relayed edge, and the cap of its doubling (DESIGN §3 step 6).
REPROBE_INITIAL_S = 10.0
REPROBE_MAX_S = 300.0


def direct_enabled() -> bool:
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


@attrs.define
class EdgeRecord:
    """One ring edge as this daemon saw it (proto_spec 07 §5)."""

    src: str            # sender's name
    dst: str            # receiver's name
    predicted: str      # "direct" | "relayed"
    path: str = "pending"   # "direct" | "relayed"
    rtt_ms: Optional[float] = None
    verify_s: Optional[float] = None
    remote: Optional[str] = None
    reason: str = ""
    links: list = attrs.field(factory=list)  # every Link this edge has used, oldest first (sender side)
    tries: int = 0                  # the last attempt made: 0 at formation, then re-probes 1, 2, ...
    upgraded_at: Optional[float] = None   # Unix time the edge switched from relayed to direct
    pending: Optional[dict] = None  # a verified re-probe's measurements, applied at the switch

    @property
    def link(self):
        """The Link this edge uses now (None before it formed)."""
        return self.links[-1] if self.links else None

    @link.setter
    def link(self, value) -> None:
        if value is not None and (not self.links or self.links[-1] is not value):
            self.links.append(value)

    def to_json(self) -> dict:
        out = {"from": self.src, "to": self.dst, "path": self.path, "predicted_path": self.predicted,
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


class PathManager:
    """Direct-path machinery of one daemon in one session.

    Args:
        endpoint: the daemon's UDP endpoint (already serving).
        rdv: the session's RendezvousClient (send_signal; ``stun_servers`` if advertised).
        nursery: where QUIC drivers and agent tasks run (lives as long as the session's links).
    """

    def __init__(self, endpoint: UdpEndpoint, rdv, nursery, inbox: Optional[dict] = None):
        self.endpoint = endpoint
        self.rdv = rdv
        self.nursery = nursery
        self.report = None
        self.nat_class: Optional[str] = None
        self.rendezvous_rtt_ms: Optional[float] = None
        self.edges: dict[str, EdgeRecord] = {}
        self._inbox = inbox if inbox is not None else {"offers": {}, "event": trio.Event()}
        self._scope: Optional[trio.CancelScope] = None

    def close(self) -> None:
        """Stop this session's agents and QUIC drivers."""
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

    async def candidates(self) -> list[str]:
        """Our candidates as SDP strings: host (toward the rendezvous) then server-reflexive."""
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
        """Take a signal body from the rendezvous (proto_spec 07 §2); malformed ones are dropped."""
        self.store_offer(self._inbox, from_peer, body)

    @staticmethod
    def store_offer(inbox: dict, from_peer: str, body) -> None:
        if not isinstance(body, dict) or body.get("t") != "ice_offer":
            return
        edge, attempt = body.get("edge"), body.get("try", 0)
        if not isinstance(edge, str) or not isinstance(attempt, int):
            return
        if not (isinstance(body.get("ufrag"), str) and isinstance(body.get("pwd"), str)):
            return
        offers = inbox["offers"]
        offers[(edge, attempt)] = {**body, "from": from_peer, "received_at": time.monotonic()}
        while len(offers) > 64:
            offers.pop(next(iter(offers)))
        inbox["event"].set()
        inbox["event"] = trio.Event()

    async def _wait_offer(self, edge: str, attempt: int, peer: str, timeout_s: float) -> Optional[dict]:
        with trio.move_on_after(timeout_s):
            while True:
                offer = self._inbox["offers"].pop((edge, attempt), None)
                if offer is not None and offer["from"] == peer:
                    return offer
                await self._inbox["event"].wait()
        return None

    # ---- one edge ------------------------------------------------------------------------------
    async def direct(self, *, peer_id: str, peer_name: str, me_name: str, sender: bool,
                     attempt: int = 0) -> Optional[QuicTransport]:
        """Try the direct path of one ring edge; the QUIC transport, or None to relay.

        At ``attempt`` 0 the edge's record takes the outcome (path, RTT, time to verify). A
        re-probe (``attempt`` >= 1, proto_spec 07 §7) leaves the record "relayed" and keeps the
        measurements in ``pending`` until :meth:`mark_upgraded` says the ring switched.

        Args:
            peer_id, peer_name: the other end of the edge.
            sender: True on the edge's sender (ICE controlling, QUIC client).
            attempt: 0 at formation, then 1, 2, ... for re-probes (kept apart in signals).
        """
        edge = self._edge_id(peer_id, sender)
        rec = self.edges.get(edge) or EdgeRecord(me_name if sender else peer_name, peer_name if sender else me_name,
                                                 predicted="direct")
        self.edges[edge] = rec
        rec.tries = max(rec.tries, attempt)
        t, found = await self._attempt(rec, edge=edge, peer_id=peer_id, peer_name=peer_name, sender=sender,
                                       attempt=attempt)
        if t is None:
            if rec.path != "direct":
                rec.path = "relayed"
            rec.reason = found["reason"]  # a re-probe's own number is in ``tries``
            return None
        if attempt == 0:
            rec.path, rec.verify_s, rec.rtt_ms, rec.remote = "direct", found["verify_s"], found["rtt_ms"], found["remote"]
            log.info("ring edge %s -> %s is direct via %s (verified in %.3f s)", rec.src, rec.dst, rec.remote,
                     rec.verify_s)
        else:
            rec.pending = found
        return t

    async def _attempt(self, rec: EdgeRecord, *, edge: str, peer_id: str, peer_name: str, sender: bool,
                       attempt: int) -> tuple[Optional[QuicTransport], dict]:
        """One offer exchange, check run and QUIC handshake: (transport, measurements) or (None, {"reason"})."""
        if not direct_enabled():
            return None, {"reason": "direct paths are disabled (KAFILA_DIRECT=0)"}
        creds = ice.new_credentials()
        offer = {"t": "ice_offer", "edge": edge, "try": attempt, "ufrag": creds.ufrag, "pwd": creds.pwd,
                 "cands": await self.candidates(), "nat_class": self.nat_class}
        t0 = time.perf_counter()
        try:
            await self.rdv.send_signal(peer_id, offer)
        except trio.BrokenResourceError:
            return None, {"reason": "the rendezvous connection was lost"}
        theirs = await self._wait_offer(edge, attempt, peer_id, OFFER_TIMEOUT_S)
        if theirs is None:
            return None, {"reason": f"no candidate offer from {peer_name} within {OFFER_TIMEOUT_S:g} s"}
        their_class = theirs.get("nat_class") if theirs.get("nat_class") in ("O", "C", "S") else None
        rec.predicted = predict_path(self.nat_class, their_class)
        if rec.predicted == "relayed" and attempt == 0:
            return None, {"reason": f"predicted relay ({self.nat_class}-{their_class})"}
        agent = ice.IceAgent(controlling=sender, local=creds, remote=ice.Credentials(theirs["ufrag"], theirs["pwd"]),
                             remote_candidates=ice.candidates_from_sdp(theirs.get("cands")),
                             now=trio.current_time(), tie_breaker=int.from_bytes(os.urandom(8), "big"))
        result = await self._run_checks(agent, rec, deaf=attempt < dropped_check_attempts())
        if not isinstance(result, ice.PathVerified):
            return None, {"reason": result.reason if result else "the checks stopped"}
        found = {"verify_s": time.perf_counter() - t0, "rtt_ms": result.rtt_ms,
                 "remote": f"{result.remote[0]}:{result.remote[1]}"}
        try:
            if sender:
                t = await quic_connect(self.endpoint, result.remote, self.nursery, timeout_s=QUIC_TIMEOUT_S)
            else:
                t = await quic_accept(self.endpoint, result.remote, self.nursery, timeout_s=QUIC_TIMEOUT_S)
        except trio.BrokenResourceError as e:
            return None, {"reason": f"QUIC did not connect over the verified path: {e}"}
        return t, found

    async def _run_checks(self, agent: ice.IceAgent, rec: EdgeRecord, *, deaf: bool = False):
        """Drive ``agent`` until it selects a pair or fails; keep it alive afterwards in the nursery.

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

        self.nursery.start_soon(drive)  # keeps answering checks and sending keepalives after selection
        await settled.wait()
        return outcome.get("ev")

    # ---- upgrade of a relayed edge (proto_spec 07 §7) -------------------------------------------
    async def reprobe(self, *, peer_id: str, peer_name: str, me_name: str, sender: bool,
                      secure: Callable[[QuicTransport], Awaitable[Optional[object]]]):
        """Re-probe a relayed edge until a direct path verifies and ``secure`` makes a link over it.

        The sender makes attempts ``try`` = 1, 2, ... after a backoff doubling from
        :func:`reprobe_initial_s` to :data:`REPROBE_MAX_S` (DESIGN §3 step 6); the receiver answers
        the newest re-probe offer it has from the sender, whenever one arrives.

        Args:
            secure: runs Noise over the new QUIC transport; returns the Link, or None (then the
                attempt counts as failed and the edge stays relayed).
        Returns:
            The new Link (the record stays "relayed" until :meth:`mark_upgraded`).
        """
        edge = self._edge_id(peer_id, sender)
        delay_s = reprobe_initial_s()
        attempt = 0
        while True:
            if sender:
                await trio.sleep(delay_s)
                attempt += 1
                delay_s = min(max(delay_s, 0.5) * 2, REPROBE_MAX_S)
            else:
                attempt = await self._wait_reprobe(edge, peer_id)
            t = await self.direct(peer_id=peer_id, peer_name=peer_name, me_name=me_name, sender=sender,
                                  attempt=attempt)
            if t is None:
                continue
            link = await secure(t)
            if link is not None:
                return link
            rec = self.edges.get(edge)
            if rec is not None:
                rec.pending = None

    async def _wait_reprobe(self, edge: str, peer: str) -> int:
        """The newest re-probe attempt (``try`` >= 1) offered by ``peer`` on ``edge``; older ones are dropped.

        An offer older than :data:`OFFER_TIMEOUT_S` is stale (its sender stopped waiting for our
        answer), so it is dropped too: answering it would only desynchronise the two ends.
        """
        while True:
            event = self._inbox["event"]
            offers = self._inbox["offers"]
            stale = time.monotonic() - OFFER_TIMEOUT_S
            for key in [(e, k) for (e, k), o in offers.items() if e == edge and k >= 1 and o["received_at"] < stale]:
                offers.pop(key, None)
            tries = [k for (e, k), o in offers.items() if e == edge and k >= 1 and o["from"] == peer]
            if tries:
                newest = max(tries)
                for k in tries:
                    if k != newest:
                        self._inbox["offers"].pop((edge, k), None)
                return newest
            with trio.move_on_after(OFFER_TIMEOUT_S):
                await event.wait()

    def mark_upgraded(self, peer_id: str, sender: bool, link=None) -> Optional[EdgeRecord]:
        """Record that the ring now uses the direct path of this edge (``link`` on the sender)."""
        rec = self.edges.get(self._edge_id(peer_id, sender))
        if rec is None:
            return None
        found, rec.pending = rec.pending or {}, None
        rec.verify_s, rec.rtt_ms, rec.remote = found.get("verify_s"), found.get("rtt_ms"), found.get("remote")
        rec.path, rec.reason, rec.upgraded_at = "direct", "", time.time()
        if link is not None:
            rec.link = link
        log.info("ring edge %s -> %s upgraded from relayed to direct via %s (re-probe %d)", rec.src, rec.dst,
                 rec.remote, rec.tries)
        return rec

    def _edge_id(self, peer_id: str, sender: bool) -> str:
        me, sid = self.rdv.peer_id, getattr(self.rdv, "session_id", "") or ""
        return f"{sid}:{me}>{peer_id}" if sender else f"{sid}:{peer_id}>{me}"

    def edge_from_me(self, peer_id: str) -> Optional[EdgeRecord]:
        return self.edges.get(self._edge_id(peer_id, True))

    def mark_relayed(self, peer_id: str, sender: bool, reason: str) -> None:
        rec = self.edges.get(self._edge_id(peer_id, sender))
        if rec is not None:
            rec.path, rec.reason = "relayed", reason

    def edge_list(self) -> list[dict]:
        return [r.to_json() for r in self.edges.values()]


# ---- per-daemon endpoint, per-session manager ---------------------------------------------------

async def endpoint_of(node) -> UdpEndpoint:
    """The daemon's one UDP endpoint, bound on first use and served in the node's root nursery."""
    ep = getattr(node, "_kafila_udp", None)
    if ep is None:
        host, port = bind_address(os.environ.get("KAFILA_UDP_BIND", ""))
        ep = await UdpEndpoint.bind(host, port)
        node._kafila_udp = ep
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


def _inbox(node) -> dict:
    box = getattr(node, "_kafila_offers", None)
    if box is None:
        box = node._kafila_offers = {"offers": {}, "event": trio.Event()}
    return box


def deliver_signal(node, from_peer: str, body) -> None:
    """Route a rendezvous Signal to the path machinery (call from the session's events loop).

    Offers may arrive before this daemon's PathManager exists, so they wait in a per-daemon inbox.
    """
    pm = getattr(node, "_kafila_paths", None)
    if pm is not None:
        pm.on_signal(from_peer, body)
        return
    PathManager.store_offer(_inbox(node), from_peer, body)


async def paths_of(node, rdv) -> PathManager:
    """This session's PathManager (made on first use; a new rendezvous connection gets a new one).

    Its tasks (check agents, QUIC drivers) run in a nursery under the node's root nursery; the
    previous session's manager is closed when a new one is made.
    """
    pm = getattr(node, "_kafila_paths", None)
    if pm is None or pm.rdv is not rdv:
        if pm is not None:
            pm.close()
        ep = await endpoint_of(node)
        holder = await node.nursery.start(_hold)
        pm = PathManager(ep, rdv, holder[0], inbox=_inbox(node))
        pm._scope = holder[1]
        node._kafila_paths = pm
    return pm


async def _hold(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            task_status.started((nursery, scope))
            await trio.sleep_forever()
