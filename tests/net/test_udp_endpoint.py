"""The daemon's one UDP socket and its first-byte demultiplexer (kafilad.net.udp_endpoint), real loopback sockets."""

from __future__ import annotations

import os

import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import trio_test

from kafilad.net.stun_client import classify_nat
from kafilad.net.udp_endpoint import RECV_BATCH, UdpEndpoint
from kafilad.proto.ice import IceAgent, PathVerified, make_candidate, new_credentials
from kafilad.rendezvous.stun_server import serve_stun


@trio_test
async def test_classification_runs_on_the_endpoint_while_it_demultiplexes():
    async with trio.open_nursery() as nursery:
        servers = await nursery.start(serve_stun, [("127.0.0.1", 0)])
        ep = await UdpEndpoint.bind("127.0.0.1")
        await nursery.start(ep.serve)
        report = await classify_nat(ep.stun_socket(), servers, timeout_s=5)
        assert report.mapped_address == ep.local_address
        assert report.behind_nat is False and report.nat_class == "O"
        assert report.rtt_ms is not None and report.rtt_ms > 0
        nursery.cancel_scope.cancel()


@trio_test
async def test_quic_datagrams_route_by_connection_id_and_junk_is_dropped():
    a, b = await UdpEndpoint.bind("127.0.0.1"), await UdpEndpoint.bind("127.0.0.1")
    got: dict[str, list] = {"one": [], "two": [], "server": []}
    cid1, cid2 = os.urandom(8), os.urandom(8)
    b.route_cid(cid1, lambda d, addr: got["one"].append(d))
    b.route_cid(cid2, lambda d, addr: got["two"].append(d))
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        initial = bytes([0xC0, 0, 0, 0, 1, 8]) + os.urandom(8) + b"initial"
        await a.sendto(initial, b.local_address)  # before anyone expects it: stashed
        await a.sendto(bytes([0x40]) + cid2 + b"short", b.local_address)
        await a.sendto(bytes([0x80]) + b"not ours", b.local_address)
        await a.sendto(bytes([0x40]) + cid1 + b"short", b.local_address)
        with trio.fail_after(5):
            while len(got["one"]) + len(got["two"]) < 2:
                await trio.sleep(0.01)
        b.expect_quic_client(a.local_address, lambda d, addr: got["server"].append((d, addr)))
        assert got["server"] == [(initial, a.local_address)]
        assert got["one"] == [bytes([0x40]) + cid1 + b"short"] and got["two"] == [bytes([0x40]) + cid2 + b"short"]
        assert b.dropped == 1
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_burst_longer_than_one_read_batch_arrives_whole_and_in_order():
    a, b = await UdpEndpoint.bind("127.0.0.1"), await UdpEndpoint.bind("127.0.0.1")
    cid = os.urandom(8)
    got: list[bytes] = []
    b.route_cid(cid, lambda d, addr: got.append(d))
    burst = [bytes([0x40]) + cid + i.to_bytes(4, "big") + bytes(1200) for i in range(3 * RECV_BATCH + 5)]
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        for data in burst:  # back to back, no yield between them: the reader finds them queued
            assert a.send_nowait(data, b.local_address) is True
        with trio.fail_after(5):
            while len(got) < len(burst):
                await trio.sleep(0.01)
        assert got == burst and b.received == len(burst) and b.dropped == 0
        nursery.cancel_scope.cancel()


@trio_test
async def test_two_ice_agents_verify_over_two_endpoints():
    a, b = await UdpEndpoint.bind("127.0.0.1"), await UdpEndpoint.bind("127.0.0.1")
    ca, cb = new_credentials(), new_credentials()
    now = trio.current_time()
    agents = {
        "a": (a, IceAgent(controlling=True, local=ca, remote=cb, now=now,
                          remote_candidates=[make_candidate("host", b.local_address)])),
        "b": (b, IceAgent(controlling=False, local=cb, remote=ca, now=now,
                          remote_candidates=[make_candidate("host", a.local_address)])),
    }
    events: dict[str, object] = {}
    addr_a, addr_b = a.local_address, b.local_address

    async def drive(name):
        ep, agent = agents[name]
        wake = trio.Event()

        def on_stun(data, addr):
            claimed = agent.receive_datagram(data, addr, trio.current_time())
            wake.set()
            return claimed
        ep.add_stun_handler(on_stun)
        while name not in events:
            for data, dst in agent.datagrams_to_send(trio.current_time()):
                await ep.sendto(data, dst)
            ev = agent.next_event()
            if ev is not None:
                events[name] = ev
                break
            with trio.move_on_at(agent.get_timer()):
                await wake.wait()
            wake = trio.Event()
            if trio.current_time() >= agent.get_timer():
                agent.handle_timer(trio.current_time())
        for data, dst in agent.datagrams_to_send(trio.current_time()):
            await ep.sendto(data, dst)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.serve)
            await nursery.start(b.serve)
            async with trio.open_nursery() as inner:
                inner.start_soon(drive, "a")
                inner.start_soon(drive, "b")
            nursery.cancel_scope.cancel()
    assert events["a"] == PathVerified(addr_b, events["a"].rtt_ms)
    assert isinstance(events["b"], PathVerified) and events["b"].remote == addr_a


@settings(max_examples=300, deadline=None)
@given(datagrams=st.lists(st.binary(max_size=120), max_size=20), prefix=st.sampled_from([b"", b"\x00\x01", b"\x01\x01",
                                                                                          b"\x40", b"\xc0"]))
def test_fuzz_any_datagram_is_routed_or_dropped_never_raises(datagrams, prefix):
    import socket as pysocket

    raw = pysocket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM)
    ep = UdpEndpoint(trio.socket.from_stdlib_socket(raw))
    ca, cb = new_credentials(), new_credentials()
    agent = IceAgent(controlling=False, local=ca, remote=cb, now=0.0, remote_candidates=[])
    ep.add_stun_handler(lambda d, a: agent.receive_datagram(d, a, 1.0))
    ep.route_cid(bytes(8), lambda d, a: None)
    for data in datagrams:
        ep.dispatch(prefix + data, ("198.51.100.7", 4000))
    assert ep.received == len(datagrams)
    assert agent.state.value == "checking"
    raw.close()


@trio_test
async def test_a_burst_for_one_connection_id_reaches_its_batch_route_in_one_call_in_order():
    a, b = await UdpEndpoint.bind("127.0.0.1"), await UdpEndpoint.bind("127.0.0.1")
    cid, other = os.urandom(8), os.urandom(8)
    calls: list[tuple[list[bytes], tuple]] = []
    singles: list[bytes] = []
    b.route_cid(cid, lambda d, addr: singles.append(d), lambda ds, addr: calls.append((ds, addr)))
    b.route_cid(other, lambda d, addr: singles.append(d))  # no batch route: one call per datagram
    burst = [bytes([0x41]) + cid + i.to_bytes(2, "big") + bytes(100) for i in range(10)]
    for d in burst[:6] + [bytes([0x41]) + other + b"x"] + burst[6:]:
        a.send_nowait(d, b.local_address)  # queued in b's socket before b reads: one burst
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        with trio.fail_after(5):
            while sum(len(ds) for ds, _ in calls) < 10:
                await trio.sleep(0.01)
        assert [len(ds) for ds, _ in calls] == [6, 4]  # the datagram for `other` splits the run
        assert [d for ds, _ in calls for d in ds] == burst and calls[0][1] == a.local_address
        assert singles == [bytes([0x41]) + other + b"x"] and b.received == 11
        b.unroute(b._by_cid[cid])
        assert b._batch == {}
        nursery.cancel_scope.cancel()


@trio_test
async def test_send_many_cuts_equal_runs_into_the_same_datagrams_with_or_without_segmentation_offload():
    for gso in (True, False):
        a, b = await UdpEndpoint.bind("127.0.0.1"), await UdpEndpoint.bind("127.0.0.1")
        a.gso = a.gso and gso
        got: list[bytes] = []
        b.route_cid(b"\x07" * 8, lambda d, addr: got.append(d))
        out = [bytes([0x41]) + b"\x07" * 8 + os.urandom(1312) for _ in range(100)]
        out += [bytes([0x41]) + b"\x07" * 8 + b"short", bytes([0x41]) + b"\x07" * 8 + os.urandom(1400)]
        async with trio.open_nursery() as nursery:
            await nursery.start(b.serve)
            assert a.send_many_nowait([(d, b.local_address) for d in out]) == len(out)
            with trio.fail_after(5):
                while len(got) < len(out):
                    await trio.sleep(0.01)
            assert got == out  # the same datagrams, in order: a shorter one ends a run, a longer one starts one
            nursery.cancel_scope.cancel()
