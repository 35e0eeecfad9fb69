"""What every member does once it knows its share: build its stage, join the ring, serve it.

Shared by the host (which loads its tensors from its own model directory) and members (which
fetch theirs from the host, kafilad/node/fetch.py). DESIGN §2, §6; proto_spec 05 §2-§3.
"""

from __future__ import annotations

import inspect
import logging
from typing import Awaitable, Callable, Optional

import trio

from kafilad.errors import HandshakeError, KafilaError, SessionError, collapse_groups
from kafilad.node import paths
from kafilad.node.link import Link, LinkClosed, secure_link
from kafilad.node.ring import RingMember

log = logging.getLogger("kafilad.stage")

RING_FORM_TIMEOUT_S = 60.0
#: How long the sender of an upgraded edge waits for the receiver to close the old path.
DRAIN_TIMEOUT_S = 10.0
#: How long the sender of an upgrade waits for the receiver's `path_ready` on the new link.
CONFIRM_TIMEOUT_S = 10.0


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
                       incoming: trio.MemoryReceiveChannel, member: Optional[RingMember] = None,
                       on_edges: Optional[Callable[[], Awaitable[None]]] = None,
                       ) -> tuple[Optional[Link], Optional[Link]]:
    """Open the ring edge to our next member and accept the one from our previous member.

    Each edge is tried direct first (kafilad/node/paths.py: candidates over rendezvous signals,
    ICE-style checks, QUIC; DESIGN §3 step 5) and falls back to a relayed circuit. The Noise
    handshake and the roster check are the same on either path.

    With ``member`` given, its ``next_link`` is set here, and each relayed edge is re-probed in
    the background and upgraded to direct without interrupting generation (DESIGN §3 step 6,
    proto_spec 07 §7): see :func:`_upgrade_next` and :func:`_upgrade_prev`.

    Args:
        ring: peer ids in ring order, head first.
        roster: {peer_id: {"name": str, "public_key": bytes}} of the session.
        incoming: channel of incoming circuits labelled "ring" (from the session's accept loop).
        member: this daemon's RingMember, for upgrades.
        on_edges: awaited after an upgrade changed one of our edges (report it to the host).
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
        out["prev_relayed"] = True
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
        with trio.fail_after(RING_FORM_TIMEOUT_S), collapse_groups():
            async with trio.open_nursery() as n:
                n.start_soon(open_next)
                n.start_soon(accept_prev)
    except trio.TooSlowError:
        raise SessionError(f"the ring edges to {roster[nxt]['name']} / from {roster[prv]['name']} did not form "
                           f"within {RING_FORM_TIMEOUT_S:g} s") from None
    except HandshakeError as e:
        raise SessionError(f"ring edge refused: {e}") from None
    if member is not None:
        member.next_link = out["next"]
        if paths.direct_enabled():
            nxt_rec = pm.edge_from_me(nxt)
            if nxt_rec is not None and nxt_rec.path == "relayed":
                pm.nursery.start_soon(_upgrade_next, pm, member, nxt, roster[nxt]["name"], node.name,
                                      lambda t: _confirmed(_secure_direct(t, initiator=True, peer=nxt)), on_edges)
            if out.get("prev_relayed"):
                pm.nursery.start_soon(_upgrade_prev, pm, member, prv, roster[prv]["name"], node.name,
                                      lambda t: _confirming(_secure_direct(t, initiator=False, peer=prv)), on_edges)
    return out["next"], out["prev"]


async def _confirmed(securing) -> Optional[Link]:
    """Sender: the new link once the receiver said `path_ready` on it (it reads it), else None."""
    link = await securing
    if link is None:
        return None
    with trio.move_on_after(CONFIRM_TIMEOUT_S):
        try:
            if (await link.receive()).get("t") == "path_ready":
                return link
        except LinkClosed:
            pass
    await link.close()
    return None


async def _confirming(securing) -> Optional[Link]:
    """Receiver: after Noise, tell the sender we read the new link (`path_ready`)."""
    link = await securing
    if link is None:
        return None
    try:
        await link.send({"t": "path_ready"})
    except LinkClosed:
        return None
    return link


async def _upgrade_next(pm, member: RingMember, peer: str, peer_name: str, me_name: str, secure, on_edges) -> None:
    """Sender side of an upgrade (proto_spec 07 §7): re-probe, switch at a frame boundary, drain the old path.

    Switching is safe between any two frames: frames of one request travel round the ring in
    causal order, so a request never has frames on both paths at once; ``Link.send`` holds a lock
    per frame, so the `path_switched` marker follows every frame already on the old path.
    """
    link = await _reprobe_while_serving(pm, member, peer=peer, peer_name=peer_name, me_name=me_name, sender=True,
                                        secure=secure)
    old = member.next_link
    if link is None:
        return
    if member.broken or old is None:
        await link.close()
        return
    member.next_link = link  # the next frame goes on the direct path
    pm.mark_upgraded(peer, True, link)
    await _report(on_edges)
    try:
        await old.send({"t": "path_switched"})
        with trio.move_on_after(DRAIN_TIMEOUT_S):  # the receiver closes the old path once it read the marker
            while True:
                await old.receive()
    except LinkClosed:
        pass
    await old.close()
    log.info("ring: the relayed path to %s drained and closed (%d bytes sent on it)", peer_name, old.bytes_sent)


async def _upgrade_prev(pm, member: RingMember, peer: str, peer_name: str, me_name: str, secure, on_edges) -> None:
    """Receiver side of an upgrade: answer re-probes, then read the new link beside the old one."""
    link = await _reprobe_while_serving(pm, member, peer=peer, peer_name=peer_name, me_name=me_name, sender=False,
                                        secure=secure)
    if link is None:
        return
    pm.mark_upgraded(peer, False)
    await _report(on_edges)
    await member.feed_from(_UpgradeLink(link))


async def _reprobe_while_serving(pm, member: RingMember, *, peer: str, peer_name: str, me_name: str, sender: bool,
                                 secure) -> Optional[Link]:
    """``pm.reprobe`` until it gives a link, the ring breaks (None) or a re-probe errs (None, logged)."""
    out: dict = {}
    with collapse_groups():
        async with trio.open_nursery() as n:
            async def watch() -> None:
                await member.broken_event.wait()
                n.cancel_scope.cancel()

            n.start_soon(watch)
            try:
                out["link"] = await pm.reprobe(peer_id=peer, peer_name=peer_name, me_name=me_name, sender=sender,
                                               secure=secure)
            except (KafilaError, LinkClosed, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                log.warning("ring: stopped re-probing the edge %s %s: %s", "to" if sender else "from", peer_name, e)
            n.cancel_scope.cancel()
    return out.get("link")


class _UpgradeLink:
    """A new incoming link as RingMember.feed_from reads it: if it closes before carrying any frame
    (the sender's side of the upgrade did not finish), that is not a ring failure; it is ignored."""

    def __init__(self, link: Link):
        self.link = link
        self.peer_name = link.peer_name
        self._used = False

    async def receive(self) -> dict:
        try:
            frame = await self.link.receive()
        except LinkClosed as e:
            if self._used:
                raise
            log.info("ring: an upgraded link from %s closed before use (%s); the relayed path stays", self.peer_name,
                     e.reason)
            await trio.sleep_forever()
        self._used = True
        return frame

    async def close(self, reason: str = "closed") -> None:
        await self.link.close(reason)


async def _report(on_edges) -> None:
    if on_edges is None:
        return
    try:
        out = on_edges()
        if inspect.isawaitable(out):
            await out
    except (KafilaError, LinkClosed, trio.BrokenResourceError, trio.ClosedResourceError) as e:
        log.warning("ring: could not report the upgraded edge: %s", e)


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
    """The host's view of every ring edge, in ring order (proto_spec 07 §6; `status --json` "edges").

    Each member reports its own edges in its `ready` frame and again after an upgrade (`edges`
    frame); the sender's record of an edge wins (it measured the RTT). Edges nobody reported yet
    come from the plan's prediction. ``bytes_sent`` is live: the frame bytes the edge's sender
    sent for the session's finished requests (the sum of its `ring_bytes_sent` over every
    generation so far), kept by :func:`generation_edges`.
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
    sent = getattr(session, "_paths_bytes_sent", {})
    out = []
    for i, a in enumerate(order if len(order) > 1 else []):
        b = order[(i + 1) % len(order)]
        e = reports.get((a, b)) or {"from": a, "to": b, "path": "pending", "rtt_ms": None}
        e.setdefault("predicted_path", predicted.get((a, b)))
        if e.get("predicted_path") is None:
            e["predicted_path"] = predicted.get((a, b))
        e["bytes_sent"] = sent.get(a, 0)
        out.append(e)
    return out


def generation_edges(session, result: dict) -> list[dict]:
    """Add a finished request's per-sender ring bytes to the edges' totals; the edges now (trace)."""
    names = {r.peer_id: r.name for r in session.members.values()}
    sent = session.__dict__.setdefault("_paths_bytes_sent", {})
    for row in result.get("stats", []):
        name = names.get(row[0], row[0])
        sent[name] = sent.get(name, 0) + int(row[4] or 0)
    return session_edges(session)


def note_edges(session, rec, edges) -> None:
    """A member (or the host itself: ``rec.link`` None) reports its edges after an upgrade.

    The report replaces its ready-time one; the host writes an `edges` trace event with
    ``"cause": "upgrade"`` (proto_spec 07 §7) and tells status watchers.
    """
    if rec.link is not None and isinstance(edges, list):
        rec.load = {**(rec.load or {}), "edges": edges}
    if session.trace is not None:
        session.trace.write("edges", edges=session_edges(session), cause="upgrade", reporter=rec.name)
    session.node.changed()


def edge_paths(session) -> dict:
    """{sender name: "direct" | "relayed" | "pending"} for the trace's generation records."""
    return {e["from"]: e.get("path") for e in session_edges(session)}


def make_ring_member(node, *, stage, head: bool, tokenizer) -> RingMember:
    ex = executor()
    return RingMember(peer_id=node.peer_id, name=node.name, runner=ex.runner.StageRunner(stage),
                      mlx_lock=node.mlx_lock, head=head, tokenizer=tokenizer, executor=ex.runner)


def attach_ring(ring: RingMember, *, nursery, me: str, ring_order: list[str], names: dict, next_link, prev_link,
                watch) -> None:
    """Wire a built RingMember into its ring edges and start its tasks in `nursery`.

    Args:
        me: this member's peer id; ring_order: peer ids, head first; names: peer id -> name.
        next_link, prev_link: from connect_ring (None when the ring is this member alone).
        watch: async callable(ring) run to report a broken ring to the session.
    """
    ring.next_link = next_link
    i = ring_order.index(me)
    nxt_pid = ring_order[(i + 1) % len(ring_order)]
    ring.next_is_head = nxt_pid == ring_order[0]
    ring.next_name = names[nxt_pid]
    ring.prev_name = names[ring_order[(i - 1) % len(ring_order)]]
    nursery.start_soon(ring.run)
    nursery.start_soon(watch, ring)
    if prev_link is not None:
        nursery.start_soon(ring.feed_from, prev_link)


async def accept_circuits(rdv, route: dict) -> None:
    """Hand each incoming relayed circuit to `route[label]` (an async callable); close the others.

    Returns quietly when the rendezvous connection ends (the session's events loop gets its
    Disconnected and decides what that means).
    """
    while True:
        try:
            circuit = await rdv.accept_circuit()
        except trio.BrokenResourceError:
            return
        handler = route.get(circuit.label)
        if handler is None:
            await circuit.aclose()
        else:
            await handler(circuit)
