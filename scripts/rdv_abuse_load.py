"""One abusive client against the rendezvous, and a group that keeps forming and relaying (issue 22 item 2).

A real rendezvous (kafilad.rendezvous.server, default limits unless flags change them) listens on
127.0.0.1. The abuser connects from 127.0.0.2 (raw WebSockets bound to that source address):
it tries to register --sessions sessions, one per connection, as fast as it can, and floods relay
data on a circuit of one of its own sessions. Meanwhile, from 127.0.0.1, a legitimate group (the
daemon's own client, kafilad.node.session.rdv_client) forms --rounds sessions one after another: host
registers, a member joins with the whole code, a circuit opens and carries --mib MiB. The script
prints what the abuser got (sessions, refusals by code, relay MiB/s) and each group round (form
time, relay MiB/s), and exits 1 if a round failed. Bounded: --seconds of abuse at most.

    python scripts/rdv_abuse_load.py --sessions 10000 --rounds 5
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import trio
import trio_websocket

from kafilad.node.session.rdv_client import open_rendezvous
from kafilad.proto.identity import fingerprint, peer_id
from kafilad.proto.rendezvous import RendezvousLimits, decode_message, encode_control, encode_relay
from kafilad.proto.rendezvous_proof import Challenge, make_proof, public_key
from kafilad.rendezvous.server import serve_rendezvous

ABUSER_ADDRESS = "127.0.0.2"


async def raw_connect(nursery, port: int):
    stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=ABUSER_ADDRESS)
    ws = await trio_websocket.wrap_client_stream(nursery, stream, "127.0.0.1", "/")
    return ws


async def raw_request(ws, private: bytes, kind: str, sid: str = "", **fields) -> dict:
    """Read the challenge, send a proven `kind` request, return the reply's fields."""
    hello = decode_message(await ws.get_message()).fields
    challenge = Challenge(hello["server_public"], hello["nonce"])
    static_public, proof = make_proof(private, challenge, kind, sid, "abuser")
    await ws.send_message(encode_control({"t": kind, "peer_id": peer_id(static_public), "name": "abuser",
                                          "static_public": static_public, "proof": proof, "req": 1, **fields}))
    return decode_message(await ws.get_message()).fields


async def abuse(port: int, n_sessions: int, stats: dict, stop: trio.Event) -> None:
    """Register sessions from one address as fast as it goes; flood relay bytes on a circuit of one."""
    async with trio.open_nursery() as nursery:
        async def register_many() -> None:
            keep = []
            for _ in range(n_sessions):
                if stop.is_set():
                    break
                try:
                    ws = await raw_connect(nursery, port)
                    reply = await raw_request(ws, os.urandom(32), "register", model_id="x", members=2, capability={})
                except (trio_websocket.ConnectionClosed, OSError) as e:
                    stats["refused"]["connection closed"] += 1
                    stats["last_refusal"] = str(getattr(e, "reason", e))
                    continue
                if reply.get("t") == "registered":
                    stats["sessions"] += 1
                    keep.append(ws)
                else:
                    stats["refused"][reply.get("code")] += 1
                    stats["last_refusal"] = reply.get("reason")
                    await ws.aclose()
            await stop.wait()
            for ws in keep:
                await ws.aclose()

        nursery.start_soon(register_many)
        nursery.start_soon(relay_flood, port, stats, stop)
        await stop.wait()
        nursery.cancel_scope.cancel()


async def relay_flood(port: int, stats: dict, stop: trio.Event) -> None:
    """A circuit between two connections of the abuser's address, written as fast as the server reads."""
    async with trio.open_nursery() as nursery:
        host_key, member_key = os.urandom(32), os.urandom(32)
        a = await raw_connect(nursery, port)
        reply = await raw_request(a, host_key, "register", model_id="x", members=2, capability={})
        if reply.get("t") != "registered":
            stats["flood"] = f"refused: {reply.get('reason')}"
            return
        b = await raw_connect(nursery, port)
        sid = reply["session_id"]
        joined = await raw_request(b, member_key, "join", sid, session_id=sid,
                                   host_fingerprint=fingerprint(public_key(host_key)))
        if joined.get("t") != "joined":
            stats["flood"] = f"join refused: {joined.get('reason')}"
            return
        await a.get_message()  # member_joined
        await a.send_message(encode_control({"t": "circuit_open", "to": peer_id(public_key(member_key)),
                                             "label": "flood", "req": 2}))
        opened = decode_message(await a.get_message()).fields
        cid = opened["circuit"]
        payload = os.urandom(60_000)

        async def drain() -> None:
            while True:
                await b.get_message()

        nursery.start_soon(drain)
        t0 = time.perf_counter()
        while not stop.is_set():
            await a.send_message(encode_relay(cid, payload))
            stats["flood_bytes"] += len(payload)
            stats["flood_s"] = time.perf_counter() - t0
        nursery.cancel_scope.cancel()


async def group_round(url: str, mib: int) -> tuple[float, float]:
    """One legitimate group forms and relays; returns (form_s, relay MiB/s)."""
    host_key = os.urandom(32)
    t0 = time.perf_counter()
    async with open_rendezvous(url, static_private=host_key, name="host") as host, \
            open_rendezvous(url, static_private=os.urandom(32), name="member") as member:
        sid = await host.register("model", 2, {})
        host_pid = await member.join(sid, fingerprint(public_key(host_key)))
        form_s = time.perf_counter() - t0
        circuit = await member.open_circuit(host_pid, "bench")
        incoming = await host.accept_circuit()
        chunk = os.urandom(60_000)
        n = mib * (1 << 20) // len(chunk)
        t1 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            async def send() -> None:
                for _ in range(n):
                    await circuit.send_message(chunk)
            nursery.start_soon(send)
            for _ in range(n):
                await incoming.receive_message()
        return form_s, n * len(chunk) / (1 << 20) / (time.perf_counter() - t1)


async def main_async(a) -> int:
    stats = {"sessions": 0, "refused": collections.Counter(), "flood_bytes": 0, "flood_s": 0.0, "last_refusal": None}
    failed = 0
    async with trio.open_nursery() as nursery:
        port = await nursery.start(lambda task_status: serve_rendezvous("127.0.0.1", 0, task_status=task_status,
                                                                         limits=RendezvousLimits()))
        url = f"ws://127.0.0.1:{port}"
        stop = trio.Event()
        nursery.start_soon(abuse, port, a.sessions, stats, stop)
        with trio.move_on_after(a.seconds):
            await trio.sleep(1.0)  # the abuse is under way
            for r in range(a.rounds):
                try:
                    with trio.fail_after(30):
                        form_s, mibps = await group_round(url, a.mib)
                    print(f"group round {r}: formed in {form_s * 1e3:.0f} ms, relayed {a.mib} MiB at {mibps:.1f} MiB/s "
                          f"(abuser so far: {stats['sessions']} sessions, refusals {dict(stats['refused'])})", flush=True)
                except Exception as e:  # noqa: BLE001 - a failed round is the finding
                    failed += 1
                    print(f"group round {r}: FAILED: {e!r}", flush=True)
        stop.set()
        nursery.cancel_scope.cancel()
    flood = stats["flood_bytes"] / (1 << 20) / stats["flood_s"] if stats["flood_s"] else 0.0
    print(f"abuser from {ABUSER_ADDRESS}: {stats['sessions']} sessions registered of {a.sessions} tried; refusals "
          f"{dict(stats['refused'])}; last: {stats['last_refusal']!r}; relay flood {flood:.1f} MiB/s "
          f"({stats.get('flood', 'ran')})")
    print(f"legitimate group rounds: {a.rounds - failed} of {a.rounds} formed and relayed")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=60.0)
    return trio.run(main_async, ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
