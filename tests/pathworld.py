"""Session paths over the in-memory NAT network (tests/netsim.py): peers, their PathManagers, edge pairs.

Shared by tests/node/test_edge*.py and test_paths*.py. Nothing here opens a socket; run it under
``trio.testing.MockClock(autojump_threshold=0)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import trio

from kafilad.node.paths.edge import RingEdge
from kafilad.node.paths.manager import PathManager, open_session_paths
from kafilad.proto.identity import peer_id as peer_id_of
from kafilad.proto.rendezvous_proof import public_key
from netsim import MemoryRendezvous, MemoryRendezvousClient, SimEndpoint, SimNet


@dataclass
class Peer:
    name: str
    key: bytes
    endpoint: SimEndpoint
    rdv: MemoryRendezvousClient
    paths: Optional[PathManager] = None
    leave: trio.Event = field(default_factory=trio.Event)
    left: trio.Event = field(default_factory=trio.Event)
    left_at_s: Optional[float] = None

    @property
    def public(self) -> bytes:
        return public_key(self.key)

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.public)


async def hold_paths(peer: Peer, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A session's paths: open until ``peer.leave``; signals routed to them as the events loop does."""
    node = SimpleNamespace(name=peer.name, static_private=peer.key)
    async with open_session_paths(node, peer.rdv, endpoint=peer.endpoint) as pm:
        peer.rdv.on_signal = pm.on_signal
        peer.paths = pm
        task_status.started(pm)
        await peer.leave.wait()
        peer.left_at_s = trio.current_time()
    peer.left.set()


async def world(nursery, classes: dict, *, drop=None, classify=True):
    """Hosts behind NATs of ``classes`` ({name: "O" | "C" | "S"}), each with its session's paths open."""
    net = SimNet(drop=drop)
    await nursery.start(net.run)
    hub = MemoryRendezvous(stun_servers=net.stun_servers())
    await nursery.start(hub.run)
    peers = {}
    for i, (name, cls) in enumerate(classes.items()):
        key = bytes([i + 1]) * 32
        pid = peer_id_of(public_key(key))
        peer = peers[name] = Peer(name, key, net.host(name, cls, public_ip=f"203.0.113.{i + 1}"), hub.client(pid, name))
        await nursery.start(hold_paths, peer)
        if classify:
            assert (await peer.paths.capability())["nat_class"] == cls
    roster = {p.peer_id: {"name": p.name, "public_key": p.public} for p in peers.values()}
    return net, hub, peers, roster


def edge_pair(a: Peer, b: Peer, roster: dict) -> tuple[RingEdge, RingEdge]:
    return (RingEdge(a.paths, peer_id=b.peer_id, roster=roster, sender=True, session_id="s1"),
            RingEdge(b.paths, peer_id=a.peer_id, roster=roster, sender=False, session_id="s1", incoming=b.rdv.incoming))


async def form_edges(*edges: RingEdge, delays_s: tuple = ()) -> None:
    async def one(e, delay_s):
        await trio.sleep(delay_s)
        await e.form()
    async with trio.open_nursery() as n:
        for i, e in enumerate(edges):
            n.start_soon(one, e, delays_s[i] if i < len(delays_s) else 0)
