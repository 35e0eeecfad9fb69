#!/usr/bin/env python3
"""Direct vs relayed vs plain TCP on loopback, in one run (issue 3 "Done when"; DESIGN §4, §8).

    python scripts/bench_paths.py [--pings 200] [--mib 16]

- direct:  Noise (kafilad/node/paths/link.py) inside a QUIC stream on two UDP endpoints (kafilad.net.quic_transport),
           with the datagram size QUIC picks for a same-host path (SAME_HOST_DATAGRAM_BYTES)
- direct-1350: the same with Internet-sized datagrams (MAX_DATAGRAM_BYTES), as on a punched path
- relayed: Noise over a relayed circuit through a rendezvous on 127.0.0.1 (kafilad.rendezvous)
- tcp:     plain TCP, no encryption, the same bytes

Workloads: an 8 KiB activation ping-pong (median round trip of ``--pings``) and a ``--mib`` MiB
transfer (1 MiB frames, time until the receiver has every byte). Prints absolute numbers and
ratios to plain TCP (lower is better for times).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import trio

from kafilad.net.quic_open import quic_accept, quic_connect
from kafilad.net.quic_transport import MAX_DATAGRAM_BYTES
from kafilad.net.udp_endpoint import UdpEndpoint
from kafilad.node.paths.link import secure_link
from kafilad.node.session.rdv_client import open_rendezvous
from kafilad.proto.identity import fingerprint
from kafilad.proto.noise import generate_keypair
from kafilad.proto.rendezvous_proof import public_key
from kafilad.rendezvous.server import serve_rendezvous

PING_BYTES = 8 * 1024
CHUNK_BYTES = 1024 * 1024


async def noise_pair(t_a, t_b):
    (ka, _), (kb, _) = generate_keypair(), generate_keypair()
    out = {}

    async def resp():
        out["b"], _, _ = await secure_link(t_b, initiator=False, static_private=kb, session_id="benchxyz",
                                           hello={"peer_id": "b", "name": "b"}, check_remote=lambda s, h: "a",
                                           label="bench")
    async with trio.open_nursery() as n:
        n.start_soon(resp)
        out["a"], _, _ = await secure_link(t_a, initiator=True, static_private=ka, session_id="benchxyz",
                                           hello={"peer_id": "a", "name": "a"}, check_remote=lambda s, h: "b",
                                           label="bench")
    return out["a"], out["b"]


async def bench_links(a, b, pings: int, mib: int) -> tuple[float, float]:
    """(median ping-pong s, transfer s) over two Links."""
    payload = bytes(PING_BYTES)

    async def echo():
        while True:
            f = await b.receive()
            if f.get("t") == "ping":
                await b.send(f)
            elif f.get("t") == "bulk_end":
                await b.send({"t": "bulk_done"})
    rtts = []
    async with trio.open_nursery() as n:
        n.start_soon(echo)
        for _ in range(pings):
            t0 = time.perf_counter()
            await a.send({"t": "ping", "h": payload})
            await a.receive()
            rtts.append(time.perf_counter() - t0)
        chunk = bytes(CHUNK_BYTES)
        t0 = time.perf_counter()
        for _ in range(mib):
            await a.send({"t": "bulk", "h": chunk})
        await a.send({"t": "bulk_end"})
        while (await a.receive()).get("t") != "bulk_done":
            pass
        transfer = time.perf_counter() - t0
        n.cancel_scope.cancel()
    return statistics.median(rtts[5:]), transfer


async def direct(pings, mib, datagram_bytes=None):
    async with trio.open_nursery() as n:
        ea, eb = await UdpEndpoint.bind("127.0.0.1"), await UdpEndpoint.bind("127.0.0.1")
        await n.start(ea.serve)
        await n.start(eb.serve)
        got = {}

        async def acc():
            got["s"] = await quic_accept(eb, ea.local_address, n, datagram_bytes=datagram_bytes)
        async with trio.open_nursery() as inner:
            inner.start_soon(acc)
            got["c"] = await quic_connect(ea, eb.local_address, n, datagram_bytes=datagram_bytes)
        a, b = await noise_pair(got["c"], got["s"])
        out = await bench_links(a, b, pings, mib)
        n.cancel_scope.cancel()
    return out


async def relayed(pings, mib):
    async with trio.open_nursery() as n:
        port = await n.start(lambda task_status: serve_rendezvous("127.0.0.1", 0, task_status=task_status))
        url = f"ws://127.0.0.1:{port}"
        host_key = os.urandom(32)
        async with open_rendezvous(url, static_private=host_key, name="a") as ra, \
                open_rendezvous(url, static_private=os.urandom(32), name="b") as rb:  # [rdv-proof]
            sid = await ra.register("bench", 2, {})
            await rb.join(sid, fingerprint(public_key(host_key)))
            got = {}

            async def acc():
                got["b"] = await rb.accept_circuit()
            async with trio.open_nursery() as inner:
                inner.start_soon(acc)
                got["a"] = await ra.open_circuit(rb.peer_id, "ring")  # [rdv-proof]
            a, b = await noise_pair(got["a"], got["b"])
            out = await bench_links(a, b, pings, mib)
        n.cancel_scope.cancel()
    return out


async def tcp(pings, mib):
    async with trio.open_nursery() as n:
        ready = {}

        async def handler(stream):
            buf = 0
            while True:
                data = await stream.receive_some(1 << 20)
                if not data:
                    return
                buf += len(data)
                while buf >= PING_BYTES and "bulk" not in ready:
                    buf -= PING_BYTES
                    await stream.send_all(bytes(PING_BYTES))
                if "bulk" in ready and buf >= mib * CHUNK_BYTES:
                    await stream.send_all(b"d")
                    buf = 0
        listeners = await n.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        s = await trio.open_tcp_stream("127.0.0.1", port)
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            await s.send_all(bytes(PING_BYTES))
            got = 0
            while got < PING_BYTES:
                got += len(await s.receive_some(1 << 20))
            rtts.append(time.perf_counter() - t0)
        ready["bulk"] = True
        t0 = time.perf_counter()
        for _ in range(mib):
            await s.send_all(bytes(CHUNK_BYTES))
        await s.receive_some(1)
        transfer = time.perf_counter() - t0
        await s.aclose()
        n.cancel_scope.cancel()
    return statistics.median(rtts[5:]), transfer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pings", type=int, default=200)
    ap.add_argument("--mib", type=int, default=16)
    args = ap.parse_args()
    results = {}
    paths = (("tcp", tcp), ("direct", direct),
             ("direct-1350", functools.partial(direct, datagram_bytes=MAX_DATAGRAM_BYTES)), ("relayed", relayed))
    for name, fn in paths:
        results[name] = trio.run(fn, args.pings, args.mib)
    base_rtt, base_xfer = results["tcp"]
    print(f"{'path':<12}{'8 KiB ping-pong':>18}{'ratio':>8}{f'{args.mib} MiB transfer':>20}{'ratio':>8}{'MB/s':>9}")
    for name, (rtt, xfer) in results.items():
        print(f"{name:<12}{rtt * 1e3:>15.3f} ms{rtt / base_rtt:>8.2f}{xfer:>18.3f} s{xfer / base_xfer:>8.2f}"
              f"{args.mib * CHUNK_BYTES / xfer / 1e6:>9.1f}")
    r = results["relayed"]
    for name in ("direct", "direct-1350"):
        d = results[name]
        print(f"{name} / relayed: ping-pong {d[0] / r[0]:.2f}, transfer {d[1] / r[1]:.2f}")


if __name__ == "__main__":
    main()
