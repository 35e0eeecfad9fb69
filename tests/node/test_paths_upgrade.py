"""PathManager re-probes of a relayed edge (proto_spec 07 §7) over a real rendezvous and loopback UDP.

The first attempt is made to fail with the documented hook ``KAFILA_TEST_DROP_CHECKS=1`` (the
agent of attempt 0 hears nothing, so its checks time out after 5 s as behind a firewall).
"""

from __future__ import annotations

import time

import pytest
import trio
from trio.testing import trio_test

from kafilad.net.udp_endpoint import UdpEndpoint
from kafilad.node.paths import PathManager, bind_address, dropped_check_attempts, reprobe_initial_s
from kafilad.node.rdv_client import Signal, open_rendezvous
from kafilad.proto.identity import peer_id as peer_id_of  # [rdv-proof]
from kafilad.proto.rendezvous_proof import public_key  # [rdv-proof]
from kafilad.rendezvous.server import serve_rendezvous

KEY_A, KEY_B = bytes(range(1, 33)), bytes(range(2, 34))  # [rdv-proof] static keys of a and b
PEER_A, PEER_B = (peer_id_of(public_key(k)) for k in (KEY_A, KEY_B))  # [rdv-proof]

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


async def _hold_rdv(url, peer, name, *, task_status=trio.TASK_STATUS_IGNORED):
    async with open_rendezvous(url, static_private=peer, name=name) as rdv:  # [rdv-proof]
        task_status.started(rdv)
        await trio.sleep_forever()


async def _route_signals(rdv, pm: PathManager) -> None:
    async for ev in rdv.events:
        if isinstance(ev, Signal):
            pm.on_signal(ev.from_peer_id, ev.body)


async def _pair(nursery):
    port = await nursery.start(lambda task_status: serve_rendezvous("127.0.0.1", 0, task_status=task_status))
    out = []
    for peer, name in ((KEY_A, "a"), (KEY_B, "b")):  # [rdv-proof]
        rdv = await nursery.start(_hold_rdv, f"ws://127.0.0.1:{port}", peer, name)
        pm = PathManager(await UdpEndpoint.bind("127.0.0.1"), rdv, nursery)
        await nursery.start(pm.endpoint.serve)
        nursery.start_soon(_route_signals, rdv, pm)
        out.append(pm)
    await out[1].rdv.join(await out[0].rdv.register("m", 2, {}))
    return out


async def _formation_fails(a: PathManager, b: PathManager) -> None:
    res = {}

    async def run(pm, key, **kw):
        res[key] = await pm.direct(**kw)
    async with trio.open_nursery() as n:
        n.start_soon(lambda: run(a, "a", peer_id=PEER_B, peer_name="b", me_name="a", sender=True))  # [rdv-proof]
        n.start_soon(lambda: run(b, "b", peer_id=PEER_A, peer_name="a", me_name="b", sender=False))  # [rdv-proof]
    assert res == {"a": None, "b": None}
    for pm in (a, b):
        (rec,) = pm.edge_list()
        assert rec["path"] == "relayed" and rec["tries"] == 0
        assert rec["reason"].startswith("no direct path answered within 5 s"), rec


@trio_test
async def test_a_relayed_edge_is_reprobed_then_upgraded(monkeypatch):
    monkeypatch.setenv("KAFILA_TEST_DROP_CHECKS", "1")
    monkeypatch.setenv("KAFILA_REPROBE_S", "0.2")
    assert dropped_check_attempts() == 1 and reprobe_initial_s() == 0.2
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            a, b = await _pair(nursery)
            await _formation_fails(a, b)

            async def identity(t):
                return t
            links = {}

            async def side(pm, key, **kw):
                links[key] = await pm.reprobe(secure=identity, **kw)
            async with trio.open_nursery() as n:
                n.start_soon(lambda: side(a, "a", peer_id=PEER_B, peer_name="b", me_name="a", sender=True))
                n.start_soon(lambda: side(b, "b", peer_id=PEER_A, peer_name="a", me_name="b", sender=False))
            # verified and secured, but not yet switched: still relayed, measurements pending
            assert a.edge_list()[0]["path"] == "relayed" and a.edges[next(iter(a.edges))].pending["rtt_ms"] > 0
            await links["a"].send_message(b"over the new path")
            assert await links["b"].receive_message() == b"over the new path"
            t0 = time.time()
            a.mark_upgraded(PEER_B, True, links["a"])  # [rdv-proof]
            b.mark_upgraded(PEER_A, False)  # [rdv-proof]
            (ra,), (rb,) = a.edge_list(), b.edge_list()
            assert ra["path"] == rb["path"] == "direct" and ra["upgraded_from"] == "relayed"
            assert ra["tries"] == rb["tries"] == 1 and "reason" not in ra
            assert t0 <= ra["upgraded_at"] <= time.time()
            assert ra["remote"] == "127.0.0.1:%d" % b.endpoint.local_address[1]
            assert ra["rtt_ms"] > 0 and 0 < ra["verify_s"] < 5
            nursery.cancel_scope.cancel()


@trio_test
async def test_a_reprobe_refused_after_quic_is_retried_with_the_next_attempt(monkeypatch):
    monkeypatch.setenv("KAFILA_TEST_DROP_CHECKS", "1")
    monkeypatch.setenv("KAFILA_REPROBE_S", "0.1")
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            a, b = await _pair(nursery)
            await _formation_fails(a, b)
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
            secure = {"a": sender_secure, "b": receiver_secure}
            links = {}

            async def side(pm, key, **kw):
                links[key] = await pm.reprobe(secure=secure[key], **kw)
            async with trio.open_nursery() as n:
                n.start_soon(lambda: side(a, "a", peer_id=PEER_B, peer_name="b", me_name="a", sender=True))
                n.start_soon(lambda: side(b, "b", peer_id=PEER_A, peer_name="a", me_name="b", sender=False))
            assert calls["a"] == 2 and 1 <= calls["b"] <= 2
            assert a.edge_list()[0]["tries"] == b.edge_list()[0]["tries"] >= 2
            assert a.edges[next(iter(a.edges))].pending["remote"] == "127.0.0.1:%d" % b.endpoint.local_address[1]
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
