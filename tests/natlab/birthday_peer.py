"""One end of a path-level birthday test in the NAT lab (tests/natlab/test_birthday_lab.py; proto_spec 07 §7b).

Run inside a member namespace; two of them (``host`` on one member, ``join`` on the other) meet
through the real rendezvous in kf-rdv, classify their NATs against its STUN grid, and then make
``ROUNDS`` direct attempts on one edge (``try`` = 1, 2, ...; the host is the edge's sender) with
the real :class:`kafilad.node.paths.manager.PathManager` on the daemon-style UDP socket: each C–S or S–S
attempt is a birthday search on extra sockets, then ICE and a QUIC handshake over the pair
found. Each attempt prints one JSON line: {"try", "ok", "took_s" (attempt start to QUIC up),
"birthday" (the search's trace event), "reason", "nat_class"}; the path is released after it.

    python tests/natlab/birthday_peer.py host|join RDV_URL CODE_FILE ROUNDS [PAUSE_S]

PAUSE_S (default 1): the host's pause between attempts.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import trio

from kafilad.net.udp_endpoint import UdpEndpoint
from kafilad.node.paths.link import secure_link
from kafilad.node.paths.manager import open_session_paths
from kafilad.node.session.rdv_client import Signal, open_rendezvous
from kafilad.proto.identity import fingerprint, peer_id as peer_id_of
from kafilad.proto.rendezvous_proof import public_key

KEYS = {"host": bytes(range(1, 33)), "join": bytes(range(2, 34))}
IDS = {k: peer_id_of(public_key(v)) for k, v in KEYS.items()}
#: Pause between attempts (the previous path's QUIC close and agent stop settle).
BETWEEN_S = 1.0


async def main(kind: str, url: str, code_file: Path, rounds: int, pause_s: float = BETWEEN_S) -> None:
    other = "join" if kind == "host" else "host"
    key, peer = KEYS[kind], IDS[other]
    ready = trio.Event()
    async with open_rendezvous(url, static_private=key, name=kind) as rdv:
        ep = await UdpEndpoint.bind("0.0.0.0")
        async with trio.open_nursery() as nursery:
            await nursery.start(ep.serve)
            async with open_session_paths(SimpleNamespace(name=kind, static_private=key), rdv, endpoint=ep) as pm:
                async def signals() -> None:
                    async for ev in rdv.events:
                        if isinstance(ev, Signal):
                            if isinstance(ev.body, dict) and ev.body.get("t") == "lab_ready":
                                ready.set()
                            else:
                                pm.on_signal(ev.from_peer_id, ev.body)
                nursery.start_soon(signals)
                if kind == "host":
                    code_file.write_text(await rdv.register("birthday-lab", 2, {}))
                else:
                    while not code_file.exists() or not code_file.read_text():
                        await trio.sleep(0.05)
                    # the rendezvous holds the session under its whole code: the host key's fingerprint too
                    await rdv.join(code_file.read_text(), fingerprint(public_key(KEYS["host"])))
                cap = await pm.capability()
                searches: list = []
                pm.on_event = lambda k, f: searches.append(f) if k == "birthday" else None
                if kind == "join":
                    await rdv.send_signal(peer, {"t": "lab_ready"})
                else:
                    await ready.wait()
                rec = pm.record(peer, other, sender=kind == "host")
                for k in range(1, rounds + 1):
                    t0 = trio.current_time()
                    attempt = k if kind == "host" else await pm.wait_reprobe(peer_id=peer)
                    t0 = trio.current_time() if kind == "join" else t0
                    t = await pm.try_direct(rec, peer_id=peer, peer_name=other, sender=kind == "host", attempt=attempt)
                    row = {"try": attempt, "ok": t is not None, "took_s": round(trio.current_time() - t0, 3),
                           "birthday": searches[-1] if searches else None, "reason": rec.reason,
                           "nat_class": cap["nat_class"], "at": time.time()}
                    if t is not None:
                        row["remote"] = f"{t.remote[0]}:{t.remote[1]}"
                        row["local_port"] = t.endpoint.local_address[1]
                        row["daemon_port"] = ep.local_address[1]
                        row["echo"] = await _echo(t, kind, key, pm.session_id, k)
                    pm.release(t)
                    print(json.dumps(row), flush=True)
                    if kind == "host":
                        await trio.sleep(pause_s)
                await trio.sleep(2.0)  # let the peer finish its last attempt
                nursery.cancel_scope.cancel()


async def _echo(t, kind: str, key: bytes, session_id: str, n: int) -> bool:
    """Noise XX over the direct path, then one frame each way (as a ring edge would): whether it came back."""
    try:
        with trio.fail_after(10):
            link, _, _ = await secure_link(t, initiator=kind == "host", static_private=key, session_id=session_id,
                                           hello={"name": kind, "role": "ring"}, check_remote=lambda *_: "peer",
                                           label="ring", timeout_s=8)
            if kind == "host":
                await link.send({"t": "ping", "n": n})
                ok = (await link.receive()) == {"t": "pong", "n": n}
            else:
                ok = (await link.receive()) == {"t": "ping", "n": n}
                await link.send({"t": "pong", "n": n})
                await trio.sleep(0.2)
            await link.close()
            return ok
    except Exception as e:  # noqa: BLE001 - reported in the row
        print(f"echo failed: {e!r}", file=sys.stderr)
        return False


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    trio.run(main, sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]),
             float(sys.argv[5]) if len(sys.argv) > 5 else BETWEEN_S)
