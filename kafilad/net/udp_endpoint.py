"""The daemon's one UDP socket, demultiplexed by first byte (DESIGN §4; RFC 9443 §3; proto_spec 07 §1).

Every datagram of the direct path (STUN classification, ICE connectivity checks, QUIC) uses one
socket, so the mapping a NAT made for STUN is the one the peer punches to. The first byte says
which protocol a datagram belongs to (RFC 9443 §3)::

    first byte   protocol                     routed to
    0 .. 3       STUN (RFC 8489 §5)           STUN handlers in order (ICE agents), else the STUN view
    64 .. 127    QUIC short header (RFC 9000 §17.3)   the QUIC connection owning the DCID
    192 .. 255   QUIC long header  (RFC 9000 §17.2)   by DCID; an unknown DCID from an expected
                                                 address starts a server connection
    anything else                             dropped (counted)

Routing QUIC by destination connection id, not by address, lets two edges share one address pair
(a two-member ring has an edge each way between the same sockets).

The first-byte rule and the DCID parser are pure: kafilad/proto/quic_header.py.

The STUN view (:meth:`UdpEndpoint.stun_socket`) looks like a trio UDP socket to
:func:`kafilad.net.stun_client.classify_nat`, so classification runs on this socket while the
demultiplexer owns it.
"""

from __future__ import annotations

import ipaddress
import logging
import socket as _socket
import struct
import sys
from collections import OrderedDict
from typing import Callable, Optional

import trio

from kafilad.proto.quic_header import CID_BYTES, is_long_header, protocol_of, quic_dcid

log = logging.getLogger("kafilad.udp")

Address = tuple[str, int]

#: Largest datagram read (a UDP payload is at most 65,507 bytes over IPv4).
RECV_BYTES = 65536
#: Datagrams read and routed back to back before the reader yields to other tasks. Reading a burst
#: at once lets a QUIC driver process it in one wake-up instead of one per datagram.
RECV_BATCH = 64
#: STUN datagrams buffered for the STUN view before new ones are dropped.
STUN_VIEW_BUFFER = 64
#: Unclaimed QUIC long-header datagrams kept per remote address until a server is expected (the newest).
STASH_PER_ADDRESS = 8
STASH_ADDRESSES = 32
#: Requested kernel socket buffer size (the kernel may cap it at net.core.rmem_max).
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
#: Most interface addresses :meth:`UdpEndpoint.interfaces` returns (host candidates are bounded,
#: RFC 8445 §5.1.1.1 "limit the number of candidates").
MAX_INTERFACES = 8


#: UDP generic segmentation offload (Linux >= 4.18, include/uapi/linux/udp.h): the socket option
#: and the most segments / bytes one send may carry.
UDP_SEGMENT = getattr(_socket, "UDP_SEGMENT", 103)
GSO_SEGMENTS = 64
GSO_MAX_BYTES = 65000


def _gso_supported(sock) -> bool:
    """Whether ``sock``'s kernel accepts UDP_SEGMENT (Linux only; probed by setting it to 0)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        sock.setsockopt(_socket.SOL_UDP, UDP_SEGMENT, 0)
        return True
    except (OSError, AttributeError):
        return False


def _is_loopback(ip: str) -> bool:
    try:
        a = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(a, "ipv4_mapped", None)
    return (mapped or a).is_loopback


def usable_interface_ip(ip: str) -> bool:
    """True for an address worth offering as a host candidate (RFC 8445 §5.1.1.1): not loopback,
    link-local, unspecified or multicast (nor IPv4-mapped / deprecated site-local IPv6)."""
    try:
        a = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return False
    if a.is_loopback or a.is_link_local or a.is_unspecified or a.is_multicast or a.is_reserved:
        return False
    if a.version == 6 and (a.ipv4_mapped is not None or a.is_site_local):
        return False
    return True


def interface_addresses(family: int = _socket.AF_INET) -> list[tuple[str, int]]:
    """This host's interface addresses of ``family`` as (ip, network prefix length), usable ones
    only (:func:`usable_interface_ip`), in the operating system's order, at most MAX_INTERFACES.

    Uses ``ifaddr`` (a dependency of aioice); sends nothing.
    """
    try:
        import ifaddr  # noqa: PLC0415 - aioice's own dependency; imported when first needed
        adapters = ifaddr.get_adapters()
    except Exception as e:  # noqa: BLE001 - enumeration is best effort: the routed address remains
        log.warning("udp: could not list the interface addresses: %s", e)
        return []
    out: list[tuple[str, int]] = []
    for adapter in adapters:
        for ip in adapter.ips:
            v4 = bool(ip.is_IPv4)
            if v4 != (family == _socket.AF_INET):
                continue
            text = ip.ip if v4 else ip.ip[0]
            if usable_interface_ip(text) and (text, ip.network_prefix) not in out:
                out.append((text, int(ip.network_prefix)))
    return out[:MAX_INTERFACES]


def _norm(addr) -> Address:
    return (str(addr[0]), int(addr[1]))


class StunView:
    """A read/write view of the endpoint for STUN clients that expect a trio UDP socket.

    Implements the subset :func:`kafilad.net.stun_client.classify_nat` uses: ``family``,
    ``getsockname()``, ``sendto(data, addr)``, ``recvfrom(n)``. It receives the STUN datagrams
    no ICE agent claimed.
    """

    def __init__(self, endpoint: "UdpEndpoint"):
        self._endpoint = endpoint
        self.family = endpoint.sock.family
        self._send, self._recv = trio.open_memory_channel(STUN_VIEW_BUFFER)

    def getsockname(self):
        return self._endpoint.sock.getsockname()

    async def sendto(self, data: bytes, addr) -> int:
        return await self._endpoint.sock.sendto(data, addr)

    async def recvfrom(self, n: int) -> tuple[bytes, Address]:
        data, addr = await self._recv.receive()
        return data[:n], addr

    def _offer(self, data: bytes, addr: Address) -> None:
        try:
            self._send.send_nowait((data, addr))
        except trio.WouldBlock:
            self._endpoint.dropped += 1


class UdpEndpoint:
    """One bound UDP socket and its demultiplexer (DESIGN §4).

    Args:
        sock: a bound trio UDP socket. Call :meth:`serve` (``nursery.start``) to start reading.

    Attributes:
        dropped: datagrams dropped (unknown protocol, unclaimed, or a full buffer).
        received: datagrams read.
    """

    def __init__(self, sock: trio.socket.SocketType):
        self.sock = sock
        self.dropped = 0
        self.received = 0
        self._stun_handlers: list[Callable[[bytes, Address], bool]] = []
        self._stun_view: Optional[StunView] = None
        self._by_cid: dict[bytes, Callable[[bytes, Address], None]] = {}
        self._batch: dict[Callable, Callable[[list[bytes], Address], None]] = {}  # route_cid(batch=)
        self._expect: dict[Address, Callable[[bytes, Address], None]] = {}
        self._stash: OrderedDict[Address, list[bytes]] = OrderedDict()
        self._raw: Optional[_socket.socket] = None
        #: Whether :meth:`send_many_nowait` may hand the kernel equal-sized runs in one call (UDP
        #: generic segmentation offload, Linux ``UDP_SEGMENT``): real sockets from :meth:`bind` only.
        self.gso = False
        self._loopback: dict[str, bool] = {}

    @classmethod
    async def bind(cls, host: str = "0.0.0.0", port: int = 0) -> "UdpEndpoint":
        """Bind a new UDP socket on (host, port); port 0 picks a free one.

        Raises:
            OSError: the address cannot be bound.
        """
        family = trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET
        sock = trio.socket.socket(family, trio.socket.SOCK_DGRAM)
        for opt in (trio.socket.SO_RCVBUF, trio.socket.SO_SNDBUF):
            try:  # bursts of QUIC datagrams overflow the default ~200 KiB buffer and read as loss
                sock.setsockopt(trio.socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
            except OSError:
                pass
        try:
            await sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        ep = cls(sock)
        ep.gso = _gso_supported(sock)
        return ep

    @property
    def local_address(self) -> Address:
        """(ip, port) the socket is bound to (ip may be 0.0.0.0)."""
        return _norm(self.sock.getsockname())

    def interfaces(self) -> list[tuple[str, int]]:
        """The addresses this socket can be reached at on its own networks, as (ip, prefix length).

        A socket bound to one address has only that one (with its interface's prefix when found,
        else a host prefix); one bound to the unspecified address has every usable interface
        address of its family (:func:`interface_addresses`). Host candidates come from here
        (proto_spec 07 §2).
        """
        ip = self.local_address[0]
        found = interface_addresses(self.sock.family)
        if ipaddress.ip_address(ip.split("%")[0]).is_unspecified:
            return found
        for addr, prefix in found:
            if addr == ip:
                return [(addr, prefix)]
        return [(ip, 32 if self.sock.family == _socket.AF_INET else 128)] if usable_interface_ip(ip) else []

    def _raw_socket(self) -> _socket.socket:
        """A non-blocking stdlib duplicate of ``sock`` (same kernel socket) for calls without a
        scheduler round trip each; closed with the endpoint."""
        if self._raw is None:
            self._raw = _socket.fromfd(self.sock.fileno(), self.sock.family, self.sock.type)
            self._raw.setblocking(False)
        return self._raw

    def send_nowait(self, data: bytes, addr: Address) -> bool:
        """Send one datagram now without yielding.

        Returns:
            False if the kernel send buffer is full (nothing sent: wait with :meth:`sendto`); True
            otherwise. An unreachable destination is treated as a lost datagram (True).
        """
        try:
            self._raw_socket().sendto(data, addr)
        except BlockingIOError:
            return False
        except OSError as e:
            log.debug("udp: send to %s failed: %s", addr, e)
        return True

    def send_many_nowait(self, datagrams: list[tuple[bytes, Address]]) -> int:
        """Send datagrams in order now without yielding; the number sent (fewer when the kernel
        send buffer filled: send the rest with :meth:`sendto`).

        With :attr:`gso`, each run of up to GSO_SEGMENTS equal-sized datagrams to one loopback
        address (the run's last may be shorter) leaves in one ``sendmsg`` with ``UDP_SEGMENT``: the
        kernel cuts it into the same datagrams, for one system call instead of one per datagram.
        Toward other addresses the kernel may hand the unsegmented packet to a virtual link (veth,
        a bridge), where a router or firewall on the same host sees one long packet: the NAT lab's
        "MTU 1280, fragments dropped" path drops it (tests/natlab), so those go one by one.
        """
        if not self.gso:
            for i, (data, addr) in enumerate(datagrams):
                if not self.send_nowait(data, addr):
                    return i
            return len(datagrams)
        raw = self._raw_socket()
        i, n = 0, len(datagrams)
        while i < n:
            data, addr = datagrams[i]
            size = len(data)
            j = i + 1
            total = size
            loopback = self._loopback.get(addr[0])
            if loopback is None:
                loopback = self._loopback[addr[0]] = _is_loopback(addr[0])
            while (loopback and j < n and j - i < GSO_SEGMENTS and datagrams[j][1] == addr and len(datagrams[j][0]) <= size
                   and total + len(datagrams[j][0]) <= GSO_MAX_BYTES):
                total += len(datagrams[j][0])
                j += 1
                if len(datagrams[j - 1][0]) < size:
                    break  # only the last segment may be shorter
            try:
                if j - i == 1:
                    raw.sendto(data, addr)
                else:
                    raw.sendmsg([b"".join(d for d, _ in datagrams[i:j])],
                                [(_socket.SOL_UDP, UDP_SEGMENT, struct.pack("=H", size))], 0, addr)
            except BlockingIOError:
                return i
            except OSError as e:
                if j - i > 1:  # the kernel or the interface refuses segmentation: send one by one
                    log.debug("udp: segmentation offload refused (%s); sending datagrams one by one", e)
                    self.gso = False
                    return i + self.send_many_nowait(datagrams[i:])
                log.debug("udp: send to %s failed: %s", addr, e)
            i = j
        return n

    async def sendto(self, data: bytes, addr: Address) -> None:
        """Send one datagram, waiting while the kernel send buffer is full; an unreachable
        destination is treated as a lost datagram."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self.send_nowait(data, addr):
            await trio.lowlevel.wait_writable(self.sock)
        await trio.lowlevel.cancel_shielded_checkpoint()

    # ---- registration ---------------------------------------------------------------------
    def stun_socket(self) -> StunView:
        """A fresh STUN view (the previous one stops receiving)."""
        self._stun_view = StunView(self)
        return self._stun_view

    def add_stun_handler(self, handler: Callable[[bytes, Address], bool]) -> None:
        """Offer STUN datagrams to ``handler(data, addr) -> claimed`` before the STUN view."""
        self._stun_handlers.append(handler)

    def remove_stun_handler(self, handler) -> None:
        if handler in self._stun_handlers:
            self._stun_handlers.remove(handler)

    def route_cid(self, cid: bytes, handler: Callable[[bytes, Address], None],
                  batch: Optional[Callable[[list[bytes], Address], None]] = None) -> None:
        """Deliver QUIC datagrams whose DCID is ``cid`` to ``handler``; with ``batch``, a run of
        short-header datagrams for ``cid`` from one address read in one burst goes to
        ``batch(datagrams, addr)`` in a single call instead (one QUIC library call per burst)."""
        self._by_cid[bytes(cid)] = handler
        if batch is not None:
            self._batch[handler] = batch

    def unroute(self, handler) -> None:
        """Forget every route and expectation delivering to ``handler``.

        Compared by equality, not identity: a bound method (``transport._on_datagram``) is a new
        object at each access, equal to the one registered.
        """
        for cid in [c for c, h in self._by_cid.items() if h == handler]:
            del self._by_cid[cid]
        self._batch.pop(handler, None)
        for a in [a for a, h in self._expect.items() if h == handler]:
            del self._expect[a]

    def expect_quic_client(self, addr: Address, handler: Callable[[bytes, Address], None]) -> None:
        """Hand QUIC long-header datagrams with an unknown DCID from ``addr`` to ``handler``.

        Datagrams that arrived from ``addr`` before this call (a client may start as soon as its
        own check succeeds) are replayed at once.
        """
        addr = _norm(addr)
        self._expect[addr] = handler
        for data in self._stash.pop(addr, []):
            handler(data, addr)

    def cancel_expectation(self, addr: Address) -> None:
        self._expect.pop(_norm(addr), None)

    # ---- demultiplexer ------------------------------------------------------------------------
    def dispatch(self, data: bytes, addr) -> None:
        """Route one received datagram (public for tests and for drivers feeding datagrams)."""
        addr = _norm(addr)
        self.received += 1
        kind = protocol_of(data)
        if kind == "stun":
            for handler in list(self._stun_handlers):
                if handler(data, addr):
                    return
            if self._stun_view is not None:
                self._stun_view._offer(data, addr)
            else:
                self.dropped += 1
            return
        if kind != "quic":
            self.dropped += 1
            return
        cid = quic_dcid(data)
        handler = self._by_cid.get(cid) if cid is not None else None
        if handler is not None:
            handler(data, addr)
            return
        if is_long_header(data):
            handler = self._expect.get(addr)
            if handler is not None:
                handler(data, addr)
                return
            stash = self._stash.setdefault(addr, [])
            self._stash.move_to_end(addr)
            if len(stash) >= STASH_PER_ADDRESS:  # keep the newest: the oldest are likelier an earlier connection's
                del stash[0]
            stash.append(bytes(data))
            while len(self._stash) > STASH_ADDRESSES:
                self._stash.popitem(last=False)
            return
        self.dropped += 1

    def _drain(self) -> int:
        """Read up to RECV_BATCH queued datagrams, then route them, without yielding; the number read.

        A run of short-header QUIC datagrams from one address to one DCID with a batch route
        (:meth:`route_cid`) goes to its batch handler in one call.
        """
        raw = self._raw_socket()
        got: list[tuple[bytes, Address]] = []
        n = 0
        while n < RECV_BATCH:
            try:
                got.append(raw.recvfrom(RECV_BYTES))
            except BlockingIOError:
                break
            except OSError:
                pass  # ICMP errors surface here on Linux: the same as a lost datagram
            n += 1
        i = 0
        while i < len(got):
            data, addr = got[i]
            j = i + 1
            try:
                if self._batch and data and 64 <= data[0] < 128:  # a QUIC short header (RFC 9000 §17.3)
                    cid = data[1:1 + CID_BYTES]
                    batch = self._batch.get(self._by_cid.get(cid))
                    if batch is not None:
                        while (j < len(got) and got[j][1] == addr and 64 <= got[j][0][0] < 128
                               and got[j][0][1:1 + CID_BYTES] == cid):
                            j += 1
                        self.received += j - i
                        batch([d for d, _ in got[i:j]], _norm(addr))
                        i = j
                        continue
                self.dispatch(data, addr)
            except Exception:  # a bug in one handler must not stop the socket
                log.exception("udp: handler failed on %d datagram(s) from %s; dropped", j - i, addr)
                self.dropped += j - i
            i = j
        return n

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Read and route datagrams until cancelled; closes the socket on exit.

        Datagrams already queued are read in bursts of up to RECV_BATCH before the reader yields,
        so the handlers of one burst run before any consumer they wake.
        """
        self._raw_socket()
        task_status.started()
        try:
            while True:
                if self._drain() < RECV_BATCH:
                    await trio.lowlevel.wait_readable(self.sock)
                else:
                    await trio.lowlevel.checkpoint()
        finally:
            if self._raw is not None:
                self._raw.close()
            self.sock.close()
