"""What every member does once it knows its share: build its stage, join the ring, serve it.

Shared by the host (which loads its tensors from its own model directory) and members (which
fetch theirs from the host, kafilad/node/fetch.py). DESIGN §2, §6; proto_spec 05 §2-§3.
"""

from __future__ import annotations

import logging
from typing import Optional

import trio

from kafilad.errors import HandshakeError, SessionError
from kafilad.node import paths
from kafilad.node.link import Link, secure_link
from kafilad.node.ring import RingMember

log = logging.getLogger("kafilad.stage")

RING_FORM_TIMEOUT_S = 60.0


def executor():
    """kafilad.executor, imported on first use (only it imports mlx)."""
    import kafilad.executor as ex  # noqa: PLC0415
    from kafilad.executor import probe, runner, stage, synth  # noqa: F401,PLC0415
    return ex


def measure_capability(model_dir: Optional[str]) -> dict:
    """This device's capability report (DESIGN §5.1): memory_bytes, bandwidth_Bps, step_overhead_s."""
    ex = executor()
    return ex.probe.measure_capability(model_dir)


async def connect_ring(*, node, rdv, session_id: str, ring: list[str], roster: dict,
                       incoming: trio.MemoryReceiveChannel) -> tuple[Optional[Link], Optional[Link]]:
    """Open the ring edge to our next member and accept the one from our previous member.

    Each edge is tried direct first (kafilad/node/paths.py: candidates over rendezvous signals,
    ICE-style checks, QUIC; DESIGN §3 step 5) and falls back to a relayed circuit. The Noise
    handshake and the roster check are the same on either path.

    Args:
        ring: peer ids in ring order, head first.
        roster: {peer_id: {"name": str, "public_key": bytes}} of the session.
        incoming: channel of incoming circuits labelled "ring" (from the session's accept loop).
    Returns:
        (next_link, prev_link); both None when the ring is this member alone.
    Raises:
        SessionError: an edge did not form in RING_FORM_TIMEOUT_S or a key did not match the roster.
    """
    me = node.peer_id
    m = len(ring)
    if m == 1:
        return None, None
    i = ring.index(me)
    nxt, prv = ring[(i + 1) % m], ring[(i - 1) % m]
    hello = {"peer_id": me, "name": node.name, "role": "ring"}

    def expect(peer: str):
        def check(remote_static: bytes, remote_hello: dict) -> str:
            if remote_static != roster[peer]["public_key"]:
                raise HandshakeError(f"ring neighbour {roster[peer]['name']} presented a key not in the session roster")
            return roster[peer]["name"]
        return check

    out: dict = {}
    pm = await paths.paths_of(node, rdv)

    async def open_next():
        direct = await pm.direct(peer_id=nxt, peer_name=roster[nxt]["name"], me_name=node.name, sender=True)
        link = None
        if direct is not None:
            link = await _secure_direct(direct, initiator=True, peer=nxt)
        if link is None:
            circuit = await rdv.open_circuit(nxt, "ring")
            link, _, _ = await secure_link(circuit, initiator=True, static_private=node.static_private,
                                           session_id=session_id, hello=hello, check_remote=expect(nxt), label="ring")
        rec = pm.edge_from_me(nxt)
        if rec is not None:
            rec.link = link
        out["next"] = link

    async def _secure_direct(transport, *, initiator: bool, peer: str) -> Optional[Link]:
        try:
            link, _, _ = await secure_link(transport, initiator=initiator, static_private=node.static_private,
                                           session_id=session_id, hello=hello, check_remote=expect(peer),
                                           label="ring", timeout_s=10.0)
            return link
        except HandshakeError as e:
            if "did not finish" not in str(e) and "closed during" not in str(e):
                raise  # a wrong key is an error on any path
            log.warning("ring: Noise over the direct path to %s failed (%s); relaying", roster[peer]["name"], e)
            pm.mark_relayed(peer, initiator, f"Noise over the direct path failed: {e}")
            return None

    async def accept_prev():
        direct = await pm.direct(peer_id=prv, peer_name=roster[prv]["name"], me_name=node.name, sender=False)
        if direct is not None:
            link = await _secure_direct(direct, initiator=False, peer=prv)
            if link is not None:
                out["prev"] = link
                return
        while True:
            circuit = await incoming.receive()
            if circuit.peer_id != prv:
                log.warning("ring: refusing a ring circuit from %s (expected %s)", circuit.peer_id, prv)
                await circuit.aclose()
                continue
            link, _, _ = await secure_link(circuit, initiator=False, static_private=node.static_private,
                                           session_id=session_id, hello=hello, check_remote=expect(prv), label="ring")
            out["prev"] = link
            return

    try:
        with trio.fail_after(RING_FORM_TIMEOUT_S):
            async with trio.open_nursery() as n:
                n.start_soon(open_next)
                n.start_soon(accept_prev)
    except trio.TooSlowError:
        raise SessionError(f"the ring edges to {roster[nxt]['name']} / from {roster[prv]['name']} did not form "
                           f"within {RING_FORM_TIMEOUT_S:g} s") from None
    except HandshakeError as e:
        raise SessionError(f"ring edge refused: {e}") from None
    return out["next"], out["prev"]


async def nat_capability(node, rdv) -> dict:
    """{"nat_class", "rendezvous_rtt_ms"} for the capability frame (DESIGN §3 step 3); None values if unknown."""
    pm = await paths.paths_of(node, rdv)
    if pm.report is None:
        return await pm.classify()
    return {"nat_class": pm.nat_class, "rendezvous_rtt_ms": pm.rendezvous_rtt_ms}


def on_signal(node, ev) -> None:
    """Route a rendezvous `Signal` event to the path machinery (proto_spec 07 §2)."""
    paths.deliver_signal(node, ev.from_peer_id, ev.body)


def edges_of(node) -> list[dict]:
    """This daemon's ring edges as status records (proto_spec 07 §5)."""
    pm = getattr(node, "_kafila_paths", None)
    return pm.edge_list() if pm is not None else []


def session_edges(session) -> list[dict]:
    """The host's view of every ring edge, in ring order (proto_spec 07 §5; `status --json` "edges").

    Each member reports its own edges in its `ready` frame; the sender's record of an edge wins
    (it measured the RTT). Edges nobody reported yet come from the plan's prediction.
    """
    names = {r.peer_id: r.name for r in session.members.values()}
    reports: dict[tuple, dict] = {}
    sources = [(session.node.name, edges_of(session.node))]
    sources += [(r.name, (r.load or {}).get("edges") or []) for r in session.members.values() if r.link is not None]
    for reporter, edges in sources:
        for e in edges:
            if not isinstance(e, dict):
                continue
            key = (e.get("from"), e.get("to"))
            if key not in reports or e.get("from") == reporter:
                reports[key] = dict(e)
    order = [names.get(p, p) for p in session.ring_order]
    predicted = {(a, b): p for a, b, p in (session.plan.edges if session.plan else [])}
    out = []
    for i, a in enumerate(order if len(order) > 1 else []):
        b = order[(i + 1) % len(order)]
        e = reports.get((a, b)) or {"from": a, "to": b, "path": "pending", "rtt_ms": None}
        e.setdefault("predicted_path", predicted.get((a, b)))
        if e.get("predicted_path") is None:
            e["predicted_path"] = predicted.get((a, b))
        out.append(e)
    return out


def edge_paths(session) -> dict:
    """{sender name: "direct" | "relayed" | "pending"} for the trace's generation records."""
    return {e["from"]: e.get("path") for e in session_edges(session)}


def make_ring_member(node, *, stage, head: bool, tokenizer) -> RingMember:
    ex = executor()
    return RingMember(peer_id=node.peer_id, name=node.name, runner=ex.runner.StageRunner(stage),
                      mlx_lock=node.mlx_lock, head=head, tokenizer=tokenizer, executor=ex.runner)
