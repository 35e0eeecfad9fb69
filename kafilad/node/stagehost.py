"""What every member does once it knows its share: build its stage, join the ring, serve it.

Shared by the host (which loads its tensors from its own model directory) and members (which
fetch theirs from the host, kafilad/node/fetch.py). DESIGN §2, §6; proto_spec 05 §2-§3.
"""

from __future__ import annotations

import logging
from typing import Optional

import trio

from kafilad.errors import HandshakeError, SessionError
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

    async def open_next():
        circuit = await rdv.open_circuit(nxt, "ring")
        link, _, _ = await secure_link(circuit, initiator=True, static_private=node.static_private,
                                       session_id=session_id, hello=hello, check_remote=expect(nxt), label="ring")
        out["next"] = link

    async def accept_prev():
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


def make_ring_member(node, *, stage, head: bool, tokenizer) -> RingMember:
    ex = executor()
    return RingMember(peer_id=node.peer_id, name=node.name, runner=ex.runner.StageRunner(stage),
                      mlx_lock=node.mlx_lock, head=head, tokenizer=tokenizer, executor=ex.runner)
