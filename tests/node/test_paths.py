"""PathManager (kafilad.node.paths.manager): offers over a real rendezvous, checks and QUIC on loopback sockets."""

from __future__ import annotations

import pytest
import trio
from trio.testing import trio_test

from kafilad.net.udp_endpoint import UdpEndpoint
from kafilad.node.paths.manager import OfferInbox, PathManager
from kafilad.proto.ring_frames import IceOffer
from kafilad.node.session.rdv_client import Signal, open_rendezvous
from kafilad.proto.identity import fingerprint, peer_id as peer_id_of  # [rdv-proof]
from kafilad.proto.rendezvous_proof import public_key  # [rdv-proof]
from kafilad.rendezvous.server import serve_rendezvous
from kafilad.rendezvous.stun_server import serve_stun

KEY_A, KEY_B = bytes(range(1, 33)), bytes(range(2, 34))  # [rdv-proof] static keys of a and b
PEER_A, PEER_B = (peer_id_of(public_key(k)) for k in (KEY_A, KEY_B))  # [rdv-proof]


async def _route_signals(rdv, pm: PathManager) -> None:
    async for ev in rdv.events:
        if isinstance(ev, Signal):
            pm.on_signal(ev.from_peer_id, ev.body)


async def _session(nursery, *, stun: bool):
    stun_addrs = await nursery.start(serve_stun, [("127.0.0.1", 0)]) if stun else []
    port = await nursery.start(lambda task_status: serve_rendezvous("127.0.0.1", 0, stun_addresses=stun_addrs,
                                                                    task_status=task_status))
    return f"ws://127.0.0.1:{port}", stun_addrs


async def _two_managers(nursery, url):
    out = []
    for peer, name in ((KEY_A, "a"), (KEY_B, "b")):  # [rdv-proof]
        rdv = await nursery.start(_hold_rdv, url, peer, name)
        pm = PathManager(await UdpEndpoint.bind("127.0.0.1"), rdv, nursery)
        await nursery.start(pm.endpoint.serve)
        nursery.start_soon(_route_signals, rdv, pm)
        out.append(pm)
    sid = await out[0].rdv.register("m", 2, {})
    await out[1].rdv.join(sid, fingerprint(public_key(KEY_A)))
    return out


async def _hold_rdv(url, peer, name, *, task_status=trio.TASK_STATUS_IGNORED):
    async with open_rendezvous(url, static_private=peer, name=name) as rdv:  # [rdv-proof]
        task_status.started(rdv)
        await trio.sleep_forever()


@trio_test
async def test_an_edge_goes_direct_over_quic_and_is_recorded():
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            url, stun = await _session(nursery, stun=True)
            a, b = await _two_managers(nursery, url)
            assert a.rdv.stun_servers == [f"127.0.0.1:{stun[0][1]}"]
            assert (await a.classify())["nat_class"] == "O"  # no NAT on loopback
            await b.classify()
            got = {}

            async def side(pm, **kw):
                got[pm.rdv.name] = await pm.direct(**kw)
            async with trio.open_nursery() as inner:
                inner.start_soon(lambda: side(a, peer_id=PEER_B, peer_name="b", me_name="a", sender=True))
                inner.start_soon(lambda: side(b, peer_id=PEER_A, peer_name="a", me_name="b", sender=False))
            assert got["a"].is_client and not got["b"].is_client
            await got["a"].send_message(b"over quic")
            assert await got["b"].receive_message() == b"over quic"
            (rec,) = a.edge_list()
            assert rec["from"] == "a" and rec["to"] == "b" and rec["path"] == "direct"
            assert rec["predicted_path"] == "direct" and rec["rtt_ms"] > 0 and rec["verify_s"] > 0
            assert rec["remote"] == "127.0.0.1:%d" % b.endpoint.local_address[1]
            nursery.cancel_scope.cancel()


@trio_test
async def test_disabled_direct_paths_and_a_silent_peer_fall_back_to_relay(monkeypatch):
    import kafilad.node.paths.manager as paths_mod
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            url, _ = await _session(nursery, stun=False)
            a, b = await _two_managers(nursery, url)
            assert a.rdv.stun_servers == []
            assert await a.classify() == {"nat_class": None, "rendezvous_rtt_ms": None}
            monkeypatch.setenv("KAFILA_DIRECT", "0")
            assert await a.direct(peer_id=PEER_B, peer_name="b", me_name="a", sender=True) is None  # [rdv-proof]
            assert a.edge_list()[0]["reason"] == "direct paths are disabled (KAFILA_DIRECT=0)"
            monkeypatch.delenv("KAFILA_DIRECT")
            monkeypatch.setattr(paths_mod, "OFFER_TIMEOUT_S", 0.3)
            # b never calls direct(), so no offer arrives
            assert await a.direct(peer_id=PEER_B, peer_name="b", me_name="a", sender=True, attempt=1) is None
            rec = a.edge_list()[0]
            assert rec["path"] == "relayed" and rec["reason"] == "no candidate offer from b within 0.3 s"
            nursery.cancel_scope.cancel()


def test_malformed_offers_are_dropped():
    inbox = OfferInbox()
    for body in (None, 7, {"t": "other"}, {"t": "ice_offer"}, {"t": "ice_offer", "edge": 1, "ufrag": "a", "pwd": "b"},
                 {"t": "ice_offer", "edge": "e", "try": "x", "ufrag": "a", "pwd": "b"},
                 {"t": "ice_offer", "edge": "e", "ufrag": 3, "pwd": "b"}):
        assert inbox.store("p", body, now=0.0) is False
    assert inbox.offers == {}
    assert inbox.store("p", {"t": "ice_offer", "edge": "e", "ufrag": "abcd", "pwd": "x" * 22}, now=1.5)
    assert list(inbox.offers) == [("e", 0)] and inbox.offers[("e", 0)].from_peer == "p"
    assert inbox.offers[("e", 0)].received_at == 1.5
    assert inbox.offers[("e", 0)].offer == IceOffer(edge="e", attempt=0, ufrag="abcd", pwd="x" * 22)


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
