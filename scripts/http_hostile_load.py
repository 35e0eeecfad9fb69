#!/usr/bin/env python3
"""Load test: hostile body-phase connections against the API's HTTP server, and the latency a
legitimate client sees meanwhile (issue 22 §4; loopback only, bounded).

A real HttpServer (kafilad/control/http_server.py, default limits unless flags say otherwise) on
127.0.0.1 serves an echo handler. Each round opens the hostile connections from 127.0.0.2: they
send headers declaring `--declared` bytes and 1 byte of body, then nothing. Then `--requests`
legitimate POSTs are sent one after another, from 127.0.0.1 (another address) and from 127.0.0.2
(the attacker's own), and their latency and statuses are printed. The hostile connections are
closed at the end of each round.

    python scripts/http_hostile_load.py [--hostile 16,300,1000] [--declared 10] [--requests 20]

Printed per round: how many hostile connections got 503 / were closed / stayed open / were reset,
and the legitimate requests' statuses and p50 / max latency in ms. Before issue 22 §4: 16
connections declaring 4194304 bytes turned every POST into a 413, and 300 declaring 10 bytes got
every new connection reset.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import trio

from kafilad.control.http_server import HttpLimits, HttpServer, Request, Responder


async def echo(request: Request, res: Responder) -> None:
    await res.send(200, json.dumps({"n": len(request.body)}).encode())


async def one_post(port: int, local: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    s = await trio.open_tcp_stream("127.0.0.1", port, local_address=local)
    await s.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}")
    data = bytearray()
    try:
        while chunk := await s.receive_some(65536):
            data += chunk
    except trio.BrokenResourceError:
        return -1, time.perf_counter() - t0  # reset
    await s.aclose()
    return (int(data.split(b" ", 2)[1]) if data else 0), time.perf_counter() - t0


async def round_(port: int, n_hostile: int, declared: int, n_requests: int) -> None:
    hostile = []
    for _ in range(n_hostile):
        s = await trio.open_tcp_stream("127.0.0.1", port, local_address="127.0.0.2")
        await s.send_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n{" % declared)
        hostile.append(s)
    for local in ("127.0.0.1", "127.0.0.2"):
        results = [await one_post(port, local) for _ in range(n_requests)]
        ms = [r[1] * 1000 for r in results]
        statuses: dict[int, int] = {}
        for status, _ in results:
            statuses[status] = statuses.get(status, 0) + 1
        print(f"  {n_hostile} hostile (declared {declared} B), legitimate from {local}: statuses {statuses} "
              f"(-1: reset), latency p50 {statistics.median(ms):.1f} ms, max {max(ms):.1f} ms")
    fates = {"503": 0, "closed": 0, "open": 0, "reset": 0}

    async def fate(s: trio.SocketStream) -> None:
        with trio.move_on_after(1.0):
            try:
                data = await s.receive_some(65536)
            except trio.BrokenResourceError:
                fates["reset"] += 1
                return
            fates["503" if data.startswith(b"HTTP/1.1 503") else "closed"] += 1
            return
        fates["open"] += 1

    async with trio.open_nursery() as nursery:
        for s in hostile:
            nursery.start_soon(fate, s)
    for s in hostile:
        await s.aclose()
    print(f"  hostile connections: {fates}")


async def main(args) -> None:
    server = HttpServer(echo, HttpLimits())
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, listeners)
        for n in args.hostile:
            print(f"round: {n} hostile connections")
            await round_(port, n, args.declared, args.requests)
            await trio.sleep(0.5)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hostile", type=lambda s: [int(x) for x in s.split(",")], default=[16, 300, 1000])
    p.add_argument("--declared", type=int, default=10)
    p.add_argument("--requests", type=int, default=20)
    trio.run(main, p.parse_args())
