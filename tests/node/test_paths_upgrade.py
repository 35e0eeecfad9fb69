"""Re-probes and the upgrade of a relayed edge (proto_spec 07 §7) over a real rendezvous and loopback UDP.

The integration twin of tests/node/test_edge.py (in-memory NAT network, mock clock): real
WebSocket rendezvous, relayed circuits through it, the daemon's UDP socket on 127.0.0.1. The
first attempt is made to fail with the documented hook ``KAFILA_TEST_DROP_CHECKS=1`` (the agent
of attempt 0 hears nothing, so its checks time out after 5 s as behind a firewall).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import trio
from trio.testing import trio_test

from kafilad.net.udp_endpoint import UdpEndpoint
from kafilad.node.serving import stagehost
from kafilad.node.paths.edge import RingEdge
from kafilad.node.paths.manager import bind_address, dropped_check_attempts, open_session_paths, reprobe_initial_s
from kafilad.node.session.rdv_client import Signal, open_rendezvous
from kafilad.node.serving.ring import RingMember
from kafilad.proto.identity import fingerprint, peer_id as peer_id_of  # [rdv-proof]
from kafilad.proto.rendezvous_proof import public_key  # [rdv-proof]
from kafilad.rendezvous.server import serve_rendezvous

KEY_A, KEY_B = bytes(range(1, 33)), bytes(range(2, 34))  # [rdv-proof] static keys of a and b
PEER_A, PEER_B = (peer_id_of(public_key(k)) for k in (KEY_A, KEY_B))  # [rdv-proof]
ROSTER = {PEER_A: {"name": "a", "public_key": public_key(KEY_A)}, PEER_B: {"name": "b", "public_key": public_key(KEY_B)}}

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


async def _session_end(url, key, name, *, task_status=trio.TASK_STATUS_IGNORED):
    """One daemon's session: rendezvous connection, UDP endpoint, paths, ring circuits, signals."""
    async with open_rendezvous(url, static_private=key, name=name) as rdv:  # [rdv-proof]
        ep = await UdpEndpoint.bind("127.0.0.1")
        incoming_send, incoming = trio.open_memory_channel(8)
        async with trio.open_nursery() as nursery:
            await nursery.start(ep.serve)
            async with open_session_paths(SimpleNamespace(name=name, static_private=key), rdv, endpoint=ep) as pm:
                nursery.start_soon(stagehost.accept_circuits, rdv, {"ring": incoming_send.send})

                async def signals():
                    async for ev in rdv.events:
                        if isinstance(ev, Signal):
                            pm.on_signal(ev.from_peer_id, ev.body)
                nursery.start_soon(signals)
                task_status.started((pm, incoming))
                await trio.sleep_forever()


async def _pair(nursery):
    port = await nursery.start(lambda task_status: serve_rendezvous("127.0.0.1", 0, task_status=task_status))
    url = f"ws://127.0.0.1:{port}"
    a, a_in = await nursery.start(_session_end, url, KEY_A, "a")
    b, b_in = await nursery.start(_session_end, url, KEY_B, "b")
    await b.rdv.join(await a.rdv.register("m", 2, {}), fingerprint(public_key(KEY_A)))
    out = RingEdge(a, peer_id=PEER_B, roster=ROSTER, sender=True, session_id=a.session_id)
    into = RingEdge(b, peer_id=PEER_A, roster=ROSTER, sender=False, session_id=b.session_id, incoming=b_in)
    return out, into


async def _formation_relays(out: RingEdge, into: RingEdge) -> None:
    async with trio.open_nursery() as n:
        n.start_soon(out.form)
        n.start_soon(into.form)
    for e in (out, into):
        rec = e.record.to_json()
        assert rec["path"] == "relayed" and rec["tries"] == 0
        assert rec["reason"].startswith("no direct path answered within 5 s"), rec


@trio_test
async def test_a_relayed_edge_is_reprobed_then_upgraded(monkeypatch):
    monkeypatch.setenv("KAFILA_TEST_DROP_CHECKS", "1")
    monkeypatch.setenv("KAFILA_REPROBE_S", "0.2")
    assert dropped_check_attempts() == 1 and reprobe_initial_s() == 0.2
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            out, into = await _pair(nursery)
            await _formation_relays(out, into)
            relayed = out.path_link
            await out.link.send({"t": "act", "n": 1})
            assert await into.link.receive() == {"t": "act", "n": 1}
            sender = RingMember(peer_id=PEER_A, name="a", runner=None, mlx_lock=trio.Lock(), head=True)
            receiver = RingMember(peer_id=PEER_B, name="b", runner=None, mlx_lock=trio.Lock(), head=False)
            sender.next_link = out.link
            nursery.start_soon(receiver.feed_from, into.link)
            t0 = time.time()
            assert out.start_upgrades(sender) and into.start_upgrades(receiver)
            while not (out.record.path == into.record.path == "direct"):
                await trio.sleep(0.05)
            assert sender.next_link is out.link and out.path_link is not relayed  # same end, new path
            await sender.next_link.send({"t": "act", "n": 2})
            assert (await receiver._inbox_recv.receive()) == {"t": "act", "n": 2}  # read as RingMember.run does
            ra, rb = out.record.to_json(), into.record.to_json()
            assert ra["upgraded_from"] == "relayed" and ra["tries"] == rb["tries"] >= 1 and "reason" not in ra
            assert t0 <= ra["upgraded_at"] <= time.time()
            assert ra["remote"] == "127.0.0.1:%d" % into.paths.endpoint.local_address[1]
            assert ra["rtt_ms"] > 0 and ra["verify_s"] > 0
            assert ra["link_bytes_sent"] == relayed.bytes_sent + out.path_link.bytes_sent
            with trio.fail_after(10):  # the relayed circuit is drained and closed
                while relayed.closed_reason is None:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()


@trio_test
async def test_a_reprobe_refused_after_quic_is_retried_with_the_next_attempt(monkeypatch):
    monkeypatch.setenv("KAFILA_TEST_DROP_CHECKS", "1")
    monkeypatch.setenv("KAFILA_REPROBE_S", "0.1")
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            out, into = await _pair(nursery)
            await _formation_relays(out, into)
            calls = {"a": 0, "b": 0}

            async def sender_secure(t):  # the first verified path is refused after QUIC connected
                calls["a"] += 1
                if calls["a"] == 1:
                    await t.aclose()
                    return None
                await t.send_message(b"ready")
                return t

            async def receiver_secure(t):  # accepts only a path its peer confirms (as `path_ready` does)
                calls["b"] += 1
                with trio.move_on_after(3):
                    try:
                        if await t.receive_message() == b"ready":
                            return t
                    except (trio.BrokenResourceError, trio.EndOfChannel, trio.ClosedResourceError):
                        pass
                await t.aclose()
                return None
            links = {}

            async def side(edge, key, secure):
                links[key] = await edge.reprobe(secure)
            async with trio.open_nursery() as n:
                n.start_soon(side, out, "a", sender_secure)
                n.start_soon(side, into, "b", receiver_secure)
            assert calls["a"] == 2 and 1 <= calls["b"] <= 2
            assert out.record.tries == into.record.tries >= 2
            assert out.record.path == "relayed"  # verified and secured, not switched: measurements pending
            assert out.record.pending["remote"] == "127.0.0.1:%d" % into.paths.endpoint.local_address[1]
            await links["a"].send_message(b"second try")  # the client opens the stream (proto_spec 07 §4)
            assert await links["b"].receive_message() == b"second try"
            nursery.cancel_scope.cancel()


def test_udp_bind_spec():
    assert bind_address("") == ("0.0.0.0", 0)
    assert bind_address("10.0.1.2") == ("10.0.1.2", 0)
    assert bind_address("127.0.0.1:40123") == ("127.0.0.1", 40123)
    assert bind_address("[::1]:5000") == ("::1", 5000)
    assert bind_address("::") == ("::", 0)


def test_hooks_default_off(monkeypatch):
    monkeypatch.delenv("KAFILA_TEST_DROP_CHECKS", raising=False)
    monkeypatch.delenv("KAFILA_REPROBE_S", raising=False)
    assert dropped_check_attempts() == 0 and reprobe_initial_s() == 10.0
    monkeypatch.setenv("KAFILA_REPROBE_S", "soon")
    assert reprobe_initial_s() == 10.0
