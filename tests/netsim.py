"""In-memory networks for tests: a NAT model, a datagram network under trio's clock, a rendezvous.

- :class:`Nat`: a NAT box with one public IP, full cone ("O"), port-restricted cone ("C") or
  symmetric ("S") (DESIGN §3 step 4). Pure; tests/proto/test_ice.py pumps ICE agents through it.
- :class:`SimNet`: hosts behind :class:`Nat` boxes (several hosts may share one box: a LAN,
  where they reach each other's local addresses directly) exchanging datagrams with a one-way delay on
  trio's clock (so ``trio.testing.MockClock(autojump_threshold=0)`` runs ICE and QUIC timeouts
  instantly), STUN responders (the sans-IO :class:`kafilad.proto.stun.StunResponder`, so the
  real RFC 5780 classifier runs against the NAT model), a ``drop`` hook (a firewall) and a log
  of every datagram sent. Each host gets a :class:`SimEndpoint`: the real
  :class:`kafilad.net.udp_endpoint.UdpEndpoint` demultiplexer with the kernel socket replaced
  by the network.
- :class:`MemoryRendezvous`: signals and relayed "ring" circuits between in-process peers, as
  the rendezvous relays them (proto_spec 03 §2.1, §4); a circuit is a trio.testing memory
  stream pair carrying u16-framed messages (proto_spec 01 §5.1).
- :class:`WebSocketRendezvous`: the real rendezvous server behind real WebSockets over memory
  streams, for the real client (whole session drivers: tests/node/test_session_drivers.py);
  :class:`PausableStream` freezes one daemon's connection.

Nothing here opens a socket.
"""

from __future__ import annotations

import heapq
import itertools
import math
import socket as _socket
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlparse

import trio
from trio.testing import memory_stream_pair

from kafilad.net.transport import StreamMessageTransport
from kafilad.net.udp_endpoint import UdpEndpoint
from kafilad.proto.quic_header import protocol_of
from kafilad.proto.stun import StunResponder

Address = tuple[str, int]

#: A 2 IPs x 2 ports STUN grid (full RFC 5780 discovery), as `kafilad rendezvous --stun` advertises.
STUN_GRID = [("192.0.2.10", 3478), ("192.0.2.10", 3479), ("192.0.2.11", 3478), ("192.0.2.11", 3479)]
RENDEZVOUS_URL = "ws://192.0.2.10:7400"


@dataclass
class Nat:
    """A NAT box with one public IP: "O" full cone, "C" port-restricted cone, "S" symmetric, None = no NAT."""

    cls: str | None
    public_ip: str
    next_port: int = 40000
    table: dict = field(default_factory=dict)
    reverse: dict = field(default_factory=dict)
    permits: set = field(default_factory=set)

    def outbound(self, src, dst):
        if self.cls is None:
            return src
        key = (src, dst) if self.cls == "S" else (src,)
        if key not in self.table:
            self.table[key] = self.next_port
            self.reverse[self.next_port] = src
            self.next_port += 7
        port = self.table[key]
        self.permits.add((port, None if self.cls == "O" else dst))
        return (self.public_ip, port)

    def inbound(self, src, dst):
        if self.cls is None:
            return dst
        if dst[0] != self.public_ip or dst[1] not in self.reverse:
            return None
        if (dst[1], None if self.cls == "O" else src) not in self.permits:
            return None
        return self.reverse[dst[1]]


@dataclass(frozen=True)
class Sent:
    """One datagram as it left a host (before its NAT)."""

    at_s: float
    host: str
    dst: Address
    kind: str     # "stun" | "quic" | "other" (RFC 9443 §3 first byte)
    data: bytes


class SimSocket:
    """The part of a trio UDP socket that UdpEndpoint's STUN view and candidate gathering use."""

    family = _socket.AF_INET
    type = _socket.SOCK_DGRAM

    def __init__(self, endpoint: "SimEndpoint"):
        self._endpoint = endpoint

    def getsockname(self) -> Address:
        return self._endpoint.local

    async def sendto(self, data: bytes, addr) -> int:
        await trio.lowlevel.checkpoint()
        self._endpoint.net.send(self._endpoint, bytes(data), (str(addr[0]), int(addr[1])))
        return len(data)

    def close(self) -> None:
        pass


class SimEndpoint(UdpEndpoint):
    """UdpEndpoint on a :class:`SimNet`: the real demultiplexer; datagrams go through the network."""

    def __init__(self, net: "SimNet", name: str, local: Address, nat: Nat):
        self.net, self.name, self.local, self.nat = net, name, local, nat
        super().__init__(SimSocket(self))

    def interfaces(self) -> list[tuple[str, int]]:
        """The host's one interface address, on a /24 (its LAN behind the NAT)."""
        return [(self.local[0], 24)]

    def send_nowait(self, data: bytes, addr) -> bool:
        self.net.send(self, bytes(data), (str(addr[0]), int(addr[1])))
        return True

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Nothing to read: the network calls ``dispatch`` (SimNet.run)."""
        task_status.started()
        await trio.sleep_forever()


class SimNet:
    """Hosts behind NATs and STUN responders, one-way delay ``one_way_s``, on trio's clock.

    Run :meth:`run` in a nursery (``await nursery.start(net.run)``). Datagrams are delivered in
    the order of their arrival time, then of sending.

    Args:
        one_way_s: delay of every hop (host to host, host to STUN server, and back).
        drop: ``drop(data, src_public, dst) -> bool``; True loses the datagram (a firewall).
    Attributes:
        sent: every datagram any host sent, in order (:class:`Sent`).
    """

    def __init__(self, *, one_way_s: float = 0.01,
                 drop: Optional[Callable[[bytes, Address, Address], bool]] = None):
        self.one_way_s = one_way_s
        self.drop = drop
        self.sent: list[Sent] = []
        self.hosts: list[SimEndpoint] = []
        self._stun: dict[Address, StunResponder] = {}
        self._queue: list = []
        self._seq = itertools.count()
        self._wake = trio.Event()

    def host(self, name: str, nat_class: Optional[str], public_ip: str, local_ip: Optional[str] = None,
             port: int = 5000, *, behind: Optional[SimEndpoint] = None) -> SimEndpoint:
        """A host at ``local_ip`` behind a NAT of ``nat_class`` (None: no NAT, the host owns ``public_ip``).

        ``behind``: put the new host behind that host's NAT box, on the same LAN (``nat_class`` and
        ``public_ip`` are then the box's; ``local_ip`` defaults to the next address of the LAN).
        """
        if behind is not None:
            nat = behind.nat
            lan = behind.local[0].rsplit(".", 1)[0]
            taken = {h.local[0] for h in self.hosts if h.nat is nat}
            local = (local_ip or next(f"{lan}.{i}" for i in range(2, 255) if f"{lan}.{i}" not in taken), port)
        elif nat_class is None:
            nat, local = Nat(None, public_ip), (public_ip, port)
        else:
            nat, local = Nat(nat_class, public_ip), (local_ip or f"10.0.{len(self.hosts) + 1}.2", port)
        ep = SimEndpoint(self, name, local, nat)
        self.hosts.append(ep)
        return ep

    def stun_servers(self, addresses: list[Address] = STUN_GRID) -> list[str]:
        """STUN responders at ``addresses``; their "ip:port" strings, as the rendezvous advertises them."""
        responder = StunResponder(list(addresses))
        for a in addresses:
            self._stun[a] = responder
        return [f"{ip}:{port}" for ip, port in addresses]

    def sent_by(self, host: str, *, after_s: float = -math.inf, kind: Optional[str] = None) -> list[Sent]:
        return [s for s in self.sent if s.host == host and s.at_s > after_s and (kind is None or s.kind == kind)]

    # ---- the wire ------------------------------------------------------------------------------
    def send(self, ep: SimEndpoint, data: bytes, dst: Address) -> None:
        now = trio.current_time()
        self.sent.append(Sent(now, ep.name, dst, protocol_of(data), data))
        if ep.nat.cls is not None:
            neighbour = next((h for h in self.hosts if h.nat is ep.nat and h.local == dst and h is not ep), None)
            if neighbour is not None:  # the same LAN: straight to it, no NAT on the way
                if self.drop is None or not self.drop(data, ep.local, dst):
                    self._later(now + self.one_way_s, neighbour.dispatch, data, ep.local)
                return
            if dst[0].startswith(ep.local[0].rsplit(".", 1)[0] + ".") or dst[0] == ep.nat.public_ip:
                return  # an address of our LAN where nobody is, or our own NAT (no hairpinning): lost
        src = ep.nat.outbound(ep.local, dst)
        if self.drop is not None and self.drop(data, src, dst):
            return
        self._later(now + self.one_way_s, self._arrive, data, src, dst)

    def _arrive(self, data: bytes, src: Address, dst: Address) -> None:
        responder = self._stun.get(dst)
        if responder is not None:
            answer = responder.handle_datagram(data, dst, src)
            if answer is not None:
                response, origin = answer
                if self.drop is None or not self.drop(response, origin, src):
                    self._later(trio.current_time() + self.one_way_s, self._arrive, response, origin, src)
            return
        for ep in self.hosts:
            owner = ep.nat.public_ip if ep.nat.cls is not None else ep.local[0]
            if owner == dst[0] and ep.nat.inbound(src, dst) == ep.local:
                ep.dispatch(data, src)
                return

    def _later(self, at_s: float, fn, *args) -> None:
        heapq.heappush(self._queue, (at_s, next(self._seq), fn, args))
        self._wake.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Deliver datagrams when they arrive, until cancelled."""
        task_status.started()
        while True:
            while self._queue and self._queue[0][0] <= trio.current_time():
                _, _, fn, args = heapq.heappop(self._queue)
                fn(*args)
            self._wake = trio.Event()
            with trio.move_on_at(self._queue[0][0] if self._queue else math.inf):
                await self._wake.wait()


# ---- rendezvous: signals and relayed circuits ---------------------------------------------------

class MemoryCircuit(StreamMessageTransport):
    """One end of a relayed circuit (proto_spec 03 §4) over a memory stream: ``peer_id`` is the other end."""

    def __init__(self, stream, *, peer_id: str, label: str):
        super().__init__(stream)
        self.peer_id = peer_id
        self.label = label


class MemoryRendezvousClient:
    """What a session uses of its rendezvous connection, over a :class:`MemoryRendezvous`.

    Attributes:
        incoming: circuits opened to this peer (the session's accept loop would route them by label).
        on_signal: called with (from_peer_id, body) for every signal to this peer.
    """

    def __init__(self, hub: "MemoryRendezvous", peer_id: str, name: str):
        self.hub, self.peer_id, self.name = hub, peer_id, name
        self.session_id = hub.session_id
        self.url = RENDEZVOUS_URL
        self.stun_servers = list(hub.stun_servers)
        self._incoming_send, self.incoming = trio.open_memory_channel(16)
        self.on_signal: Callable[[str, object], None] = lambda from_peer, body: None
        self.circuits: list[MemoryCircuit] = []
        self.signals: list[tuple[float, str, object]] = []  # (sent at, to, body) of every signal sent

    async def send_signal(self, to: str, body) -> None:
        await trio.lowlevel.checkpoint()
        self.signals.append((trio.current_time(), to, body))
        self.hub._later(self.hub.clients[to].on_signal, self.peer_id, body)

    async def open_circuit(self, to: str, label: str) -> MemoryCircuit:
        a, b = memory_stream_pair()
        mine = MemoryCircuit(a, peer_id=to, label=label)
        theirs = MemoryCircuit(b, peer_id=self.peer_id, label=label)
        self.circuits.append(mine)
        self.hub.clients[to].circuits.append(theirs)
        await self.hub.clients[to]._incoming_send.send(theirs)
        return mine


class MemoryRendezvous:
    """Signals (delayed ``delay_s``, in order) and circuits between the clients of one session.

    Run :meth:`run` in a nursery (``await nursery.start(hub.run)``).
    """

    def __init__(self, *, session_id: str = "s1", stun_servers: tuple = (), delay_s: float = 0.02):
        self.session_id = session_id
        self.stun_servers = list(stun_servers)
        self.delay_s = delay_s
        self.clients: dict[str, MemoryRendezvousClient] = {}
        self._send, self._recv = trio.open_memory_channel(math.inf)

    def client(self, peer_id: str, name: str) -> MemoryRendezvousClient:
        c = self.clients[peer_id] = MemoryRendezvousClient(self, peer_id, name)
        return c

    def _later(self, fn, *args) -> None:
        self._send.send_nowait((trio.current_time() + self.delay_s, fn, args))

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for at_s, fn, args in self._recv:
            await trio.sleep_until(at_s)
            fn(*args)


# ---- the real rendezvous server over in-memory WebSockets ---------------------------------------

class PausableStream(trio.abc.HalfCloseableStream):
    """A stream that can be paused: nothing goes out or comes in while paused (a frozen process).

    Bytes that arrive meanwhile wait (the memory stream buffers them) and are read on :meth:`resume`.
    """

    def __init__(self, inner: trio.abc.HalfCloseableStream):
        self.inner = inner
        self._running = trio.Event()
        self._running.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def pause(self) -> None:
        if self._running.is_set():
            self._running = trio.Event()

    def resume(self) -> None:
        self._running.set()

    async def send_all(self, data) -> None:
        await self._running.wait()
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._running.wait()
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        await self._running.wait()
        data = await self.inner.receive_some(max_bytes)
        await self._running.wait()
        return data

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


class WebSocketRendezvous:
    """The real rendezvous (kafilad/rendezvous/server.py ``RendezvousServer``, its sans-IO state and
    relay) serving real WebSockets (trio-websocket, wsproto) over memory streams.

    Daemons reach it through the real client (kafilad/node/session/rdv_client.py ``open_rendezvous``) once
    ``trio_websocket.open_websocket_url`` is replaced by :meth:`open_websocket_url` (a test's
    monkeypatch): a URL's path names the connecting daemon (``ws://192.0.2.10:7400/m1``), so a
    test can pause (freeze) or cut that daemon's connections. Run :meth:`run` in a nursery.

    Args:
        stun_addresses: (ip, port) advertised in ``registered`` / ``joined`` (proto_spec 07 §1).
    Attributes:
        server: the RendezvousServer.
        streams: the client end of every connection made, by URL path, oldest first.
    """

    def __init__(self, *, stun_addresses=(), limits=None):
        from kafilad.proto.rendezvous import RendezvousLimits
        self.limits = limits or RendezvousLimits()
        self._stun_addresses = list(stun_addresses)
        self.server = self._new_server()
        self.streams: dict[str, list[PausableStream]] = {}
        self._nursery = None
        self._down = False

    def _new_server(self):
        from kafilad.rendezvous.server import RendezvousServer
        return RendezvousServer(self.limits, None, self._stun_addresses)

    async def kill(self) -> None:
        """The rendezvous process dies: every connection ends abruptly and new ones are refused
        (``ConnectionRefusedError``, as from a closed port) until :meth:`restart`."""
        self._down = True
        for streams in self.streams.values():
            for stream in streams:
                await stream.aclose()

    def restart(self) -> None:
        """A new rendezvous process on the same address: it accepts again and knows no session."""
        self.server = self._new_server()
        self._down = False

    @staticmethod
    def url(who: str) -> str:
        """The URL daemon ``who`` is given (the rendezvous host is an IP: no name lookup)."""
        return f"{RENDEZVOUS_URL}/{who}"

    def latest(self, who: str) -> PausableStream:
        """The client end of ``who``'s newest connection."""
        return self.streams["/" + who][-1]

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    @asynccontextmanager
    async def open_websocket_url(self, url: str, *, max_message_size: int = 2 ** 20, connect_timeout: float = 10,
                                 disconnect_timeout: float = 5, **_ignored):
        """As ``trio_websocket.open_websocket_url``, to this rendezvous over a memory stream pair.

        Raises:
            trio_websocket.HandshakeError: the opening handshake did not finish in ``connect_timeout``.
        """
        import trio_websocket
        if self._down:
            raise ConnectionRefusedError(111, "Connection refused")
        parsed = urlparse(url)
        a, b = memory_stream_pair()
        client = PausableStream(a)
        self.streams.setdefault(parsed.path or "/", []).append(client)
        self._nursery.start_soon(self._serve, b, max_message_size)
        ws = None
        with trio.move_on_after(connect_timeout):
            ws = await trio_websocket.wrap_client_stream(self._nursery, client, parsed.hostname or "",
                                                         parsed.path or "/", max_message_size=max_message_size)
        if ws is None:
            await client.aclose()
            raise trio_websocket.ConnectionTimeout(f"no WebSocket handshake within {connect_timeout:g} s")
        try:
            yield ws
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(disconnect_timeout):
                await ws.aclose()

    async def _serve(self, stream, max_message_size: int) -> None:
        import trio_websocket
        try:
            request = await trio_websocket.wrap_server_stream(self._nursery, stream, max_message_size=max_message_size)
            await self.server.handle(request)
        except trio_websocket.ConnectionClosed:
            pass
        finally:
            await stream.aclose()
