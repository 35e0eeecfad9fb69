#!/usr/bin/env python3
"""A userspace UDP forwarder that adds a fixed one-way delay and a rate cap (issue 24 item 2).

tc netem does not exist here, so one emulated WAN hop is: a client sends to this forwarder's
listening port, the forwarder sends from the same socket to ``upstream``; replies from upstream go
back to the last client address seen. Each direction is a :class:`kafilad.net.wan_link.WanLink`
(the pure delay queue and token bucket); this driver only feeds it, flushes it and re-arms its timer.

``--probe`` runs a ping-like check through a fresh forwarder onto a local echo socket and prints the
median round trip, which should be 2 x delay (+ loopback and scheduling time).

    python scripts/wan_forwarder.py --listen 127.0.0.1:9000 --upstream 127.0.0.1:9001 \
        --hop-delay-ms 10 [--hop-mbps 100]
    python scripts/wan_forwarder.py --probe --hop-delay-ms 10
"""

from __future__ import annotations

import argparse
import statistics
import socket
from typing import Optional

import trio

from kafilad.net.wan_link import WanLink

Address = tuple[str, int]


def _parse_addr(text: str) -> Address:
    host, _, port = text.rpartition(":")
    return host, int(port)


def links(delay_ms: float, mbps: Optional[float]) -> tuple[WanLink, WanLink]:
    """The two directions of one hop: ``delay_ms`` one way each, ``mbps`` megabits/s cap each (or None)."""
    rate_Bps = None if not mbps else mbps * 1e6 / 8
    return WanLink(delay_ms / 1000, rate_Bps), WanLink(delay_ms / 1000, rate_Bps)


async def forward(sock: trio.socket.SocketType, upstream: Address, up: WanLink, down: WanLink) -> None:
    """Forward datagrams between the clients of ``sock`` and ``upstream`` until cancelled.

    Args:
        sock: a bound trio UDP socket (the forwarder's address).
        upstream: where clients' datagrams go.
        up: the link clients -> upstream; down: upstream -> the last client seen.
    """
    client: list[Optional[Address]] = [None]
    wake = trio.Event()

    async def receiver() -> None:
        nonlocal wake
        while True:
            data, addr = await sock.recvfrom(65536)
            now = trio.current_time()
            if addr[:2] == upstream:
                if client[0] is not None:
                    down.receive_datagram(data, client[0], now)
            else:
                client[0] = addr[:2]
                up.receive_datagram(data, upstream, now)
            wake.set()

    async def sender() -> None:
        nonlocal wake
        while True:
            now = trio.current_time()
            for link in (up, down):
                for data, dest in link.datagrams_to_send(now):
                    try:
                        await sock.sendto(data, dest)
                    except OSError:
                        pass  # the peer is gone; a WAN loses datagrams too
            timers = [t for t in (up.get_timer(), down.get_timer()) if t is not None]
            wake = trio.Event()
            with trio.move_on_at(min(timers) if timers else float("inf")):
                await wake.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receiver)
        nursery.start_soon(sender)


async def _udp_socket(host: str = "127.0.0.1", port: int = 0) -> trio.socket.SocketType:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    await sock.bind((host, port))
    return sock


async def probe_rtt_ms(delay_ms: float, mbps: Optional[float] = None, count: int = 20,
                       size_bytes: int = 64) -> list[float]:
    """Round trips (ms) of ``count`` datagrams through a forwarder onto a local echo socket."""
    echo = await _udp_socket()
    fwd = await _udp_socket()
    client = await _udp_socket()
    up, down = links(delay_ms, mbps)
    rtts: list[float] = []

    async def echo_loop() -> None:
        while True:
            data, addr = await echo.recvfrom(65536)
            await echo.sendto(data, addr)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo_loop)
        nursery.start_soon(forward, fwd, echo.getsockname(), up, down)
        for i in range(count):
            payload = i.to_bytes(4, "big") + b"\0" * (size_bytes - 4)
            t0 = trio.current_time()
            await client.sendto(payload, fwd.getsockname())
            while True:
                data, _ = await client.recvfrom(65536)
                if data == payload:
                    break
            rtts.append((trio.current_time() - t0) * 1000)
        nursery.cancel_scope.cancel()
    for s in (echo, fwd, client):
        s.close()
    return rtts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--upstream")
    ap.add_argument("--hop-delay-ms", type=float, default=10.0, help="one-way delay per direction")
    ap.add_argument("--hop-mbps", type=float, default=None, help="rate cap per direction, Mbit/s")
    ap.add_argument("--probe", action="store_true", help="ping through a fresh forwarder and print RTTs")
    args = ap.parse_args()
    if args.probe:
        rtts = trio.run(probe_rtt_ms, args.hop_delay_ms, args.hop_mbps)
        print(f"probe: one-way delay {args.hop_delay_ms} ms; RTT median {statistics.median(rtts):.2f} ms "
              f"(expected {2 * args.hop_delay_ms:.2f}), min {min(rtts):.2f}, max {max(rtts):.2f}")
        return
    if not args.upstream:
        ap.error("--upstream HOST:PORT is required unless --probe")

    async def run() -> None:
        host, port = _parse_addr(args.listen)
        sock = await _udp_socket(host, port)
        print(f"wan forwarder listening on {sock.getsockname()[0]}:{sock.getsockname()[1]}", flush=True)
        await forward(sock, _parse_addr(args.upstream), *links(args.hop_delay_ms, args.hop_mbps))

    trio.run(run)


if __name__ == "__main__":
    main()
