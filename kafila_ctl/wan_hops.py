"""Emulated WAN hops between loopback daemons: a UDP forwarder per daemon (issue 24 item 2).

tc netem does not exist on this machine, so a hop's one-way delay and rate cap are added in
userspace. Each daemon of a :class:`kafila_ctl.demo.LoopbackCluster` started with ``hop_delay_ms``
binds its UDP socket to a fixed port (``KAFILA_UDP_BIND``) and offers, as its only ICE candidate,
the address of its own forwarder (the ``KAFILA_TEST_ADVERTISE`` test hook,
kafilad/node/paths/manager.py). A peer's datagrams to that address are relayed by the forwarder,
from a socket of their own, to the daemon; the daemon's answers to that socket go back to the
peer. So every datagram of a direct ring edge crosses exactly one forwarder, each direction
delayed by the hop's one-way time (the pure queue is :class:`kafilad.net.wan_link.WanLink`).

Like a NAT's mapping (RFC 4787 §4.1), each client address gets its own upstream socket, so
several peers reach one daemon through one forwarder and every answer finds its peer.

    python -m kafila_ctl.wan_hops --listen 127.0.0.1:9000 --upstream 127.0.0.1:9001 --hop-delay-ms 20
    python -m kafila_ctl.wan_hops --probe --hop-delay-ms 20        # RTT through a fresh forwarder

The command prints ``wan hop listening on IP:PORT`` once bound.
"""

from __future__ import annotations

import argparse
import socket
import statistics
from typing import Optional

import attrs
import trio

from kafilad.net.wan_link import WanLink

Address = tuple[str, int]

#: bytes of the largest datagram read (a QUIC datagram is far smaller)
RECEIVE_BYTES = 65536


def parse_address(text: str) -> Address:
    """``"IP:PORT"`` as (IP, PORT). Raises ValueError for text that is not one."""
    host, _, port = text.rpartition(":")
    if not host:
        raise ValueError(f"{text!r} is not IP:PORT")
    return host, int(port)


def hop_links(delay_ms: float, mbps: Optional[float]) -> tuple[WanLink, WanLink]:
    """The two directions of one hop: ``delay_ms`` one way each, capped at ``mbps`` Mbit/s each (None: no cap)."""
    rate_Bps = None if not mbps else mbps * 1e6 / 8
    return WanLink(delay_ms / 1000, rate_Bps), WanLink(delay_ms / 1000, rate_Bps)


async def udp_socket(host: str = "127.0.0.1", port: int = 0) -> trio.socket.SocketType:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    await sock.bind((host, port))
    return sock


@attrs.define
class _Mapping:
    """One client's way through the forwarder: its own upstream socket and the hop's two directions."""
    client: Address
    sock: trio.socket.SocketType
    up: WanLink  # client -> upstream
    down: WanLink  # upstream -> client


async def forward(listen: trio.socket.SocketType, upstream: Address, *, delay_ms: float,
                  mbps: Optional[float] = None, max_clients: int = 64) -> None:
    """Relay datagrams between the clients of ``listen`` and ``upstream`` until cancelled.

    Each client address gets a mapping (its own upstream socket and two :class:`WanLink` s of
    ``delay_ms`` one way, ``mbps`` cap); at most ``max_clients`` mappings (a new client past them
    is dropped, as a full NAT table drops). A datagram that cannot be sent is lost, as on a WAN.
    """
    mappings: dict[Address, _Mapping] = {}
    wake = trio.Event()

    async with trio.open_nursery() as nursery:
        async def from_upstream(m: _Mapping) -> None:
            while True:
                data, _addr = await m.sock.recvfrom(RECEIVE_BYTES)
                m.down.receive_datagram(data, m.client, trio.current_time())
                wake.set()

        async def from_clients() -> None:
            while True:
                data, addr = await listen.recvfrom(RECEIVE_BYTES)
                client = (addr[0], addr[1])
                m = mappings.get(client)
                if m is None:
                    if len(mappings) >= max_clients:
                        continue
                    up, down = hop_links(delay_ms, mbps)
                    m = mappings[client] = _Mapping(client, await udp_socket(upstream[0]), up, down)
                    nursery.start_soon(from_upstream, m)
                m.up.receive_datagram(data, upstream, trio.current_time())
                wake.set()

        async def sender() -> None:
            nonlocal wake
            while True:
                now = trio.current_time()
                timers = []
                for m in list(mappings.values()):
                    for link, sock in ((m.up, m.sock), (m.down, listen)):
                        for data, dest in link.datagrams_to_send(now):
                            try:
                                await sock.sendto(data, dest)
                            except OSError:
                                pass  # the peer is gone; a WAN loses datagrams too
                        t = link.get_timer()
                        if t is not None:
                            timers.append(t)
                wake = trio.Event()
                with trio.move_on_at(min(timers) if timers else float("inf")):
                    await wake.wait()

        nursery.start_soon(from_clients)
        nursery.start_soon(sender)
        try:
            await trio.sleep_forever()
        finally:
            for m in mappings.values():
                m.sock.close()


async def probe_rtt_ms(delay_ms: float, mbps: Optional[float] = None, count: int = 20,
                       size_bytes: int = 64, *, forwarder: Optional[Address] = None) -> list[float]:
    """Round trips (ms) of ``count`` datagrams of ``size_bytes`` through a forwarder onto an echo socket.

    ``forwarder``: an address of a running forwarder whose upstream echoes (None: a fresh forwarder of
    ``delay_ms`` / ``mbps`` in front of a local echo socket, so the figure checks this module).
    """
    echo = await udp_socket()
    client = await udp_socket()
    rtts: list[float] = []

    async def echo_loop() -> None:
        while True:
            data, addr = await echo.recvfrom(RECEIVE_BYTES)
            await echo.sendto(data, addr)

    async with trio.open_nursery() as nursery:
        if forwarder is None:
            fwd = await udp_socket()
            nursery.start_soon(echo_loop)
            nursery.start_soon(lambda: forward(fwd, echo.getsockname(), delay_ms=delay_ms, mbps=mbps))
            target = fwd.getsockname()
        else:
            target = forwarder
        for i in range(count):
            payload = i.to_bytes(4, "big") + b"\0" * (size_bytes - 4)
            t0 = trio.current_time()
            await client.sendto(payload, target)
            while True:
                data, _ = await client.recvfrom(RECEIVE_BYTES)
                if data == payload:
                    break
            rtts.append((trio.current_time() - t0) * 1000)
        nursery.cancel_scope.cancel()
    echo.close()
    client.close()
    return rtts


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--upstream", help="IP:PORT the clients' datagrams go to")
    ap.add_argument("--hop-delay-ms", type=float, default=10.0, help="one-way delay per direction")
    ap.add_argument("--hop-mbps", type=float, default=None, help="rate cap per direction, Mbit/s")
    ap.add_argument("--probe", action="store_true", help="ping through a fresh forwarder and print RTTs")
    args = ap.parse_args(argv)
    if args.probe:
        rtts = trio.run(probe_rtt_ms, args.hop_delay_ms, args.hop_mbps)
        print(f"probe: one-way delay {args.hop_delay_ms} ms; RTT median {statistics.median(rtts):.2f} ms "
              f"(expected {2 * args.hop_delay_ms:.2f}), min {min(rtts):.2f}, max {max(rtts):.2f}")
        return
    if not args.upstream:
        ap.error("--upstream IP:PORT is required unless --probe")

    async def run() -> None:
        sock = await udp_socket(*parse_address(args.listen))
        host, port = sock.getsockname()[:2]
        print(f"wan hop listening on {host}:{port}", flush=True)
        await forward(sock, parse_address(args.upstream), delay_ms=args.hop_delay_ms, mbps=args.hop_mbps)

    trio.run(run)


if __name__ == "__main__":
    main()
