"""The birthday driver's extra sockets on loopback: bounded, all but one closed after a search,
all closed when it fails (kafilad/node/paths/birthday.py; proto_spec 07 §7b). The search itself runs
end to end in tests/natlab/test_birthday_lab.py; the pure machine in tests/proto/test_birthday.py."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from trio.testing import trio_test

from kafilad.net.udp_endpoint import UdpEndpoint
from kafilad.node.paths import birthday
from kafilad.node.paths.manager import open_session_paths
from kafilad.proto import birthday as bd
from kafilad.proto import ice

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="counts open descriptors in /proc/self/fd")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@trio_test
async def test_a_pool_keeps_the_chosen_socket_serving_and_closes_the_others():
    before = _open_fds()
    ended = trio.Event()
    async with trio.open_nursery() as nursery:
        pool = birthday.SocketPool()

        async def run(task_status=trio.TASK_STATUS_IGNORED):
            await pool.run(8, "127.0.0.1", task_status=task_status)
            ended.set()
        await nursery.start(run)
        assert len(pool.endpoints) == 8 and pool.open_count == 8
        assert len({ep.local_address[1] for ep in pool.endpoints}) == 8
        kept = pool.keep_only(5)
        await trio.testing.wait_all_tasks_blocked()
        assert pool.open_count == 1 and kept is pool.endpoints[5]
        assert [ep.sock.fileno() == -1 for ep in pool.endpoints] == [True] * 5 + [False] + [True] * 2
        probe = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
        await probe.bind(("127.0.0.1", 0))
        await probe.sendto(b"\x40" + bytes(20), kept.local_address)  # a QUIC short header nobody routes
        with trio.fail_after(5):
            while kept.received == 0:
                await trio.sleep(0.01)
        probe.close()
        pool.close()
        with trio.fail_after(5):
            await ended.wait()  # the pool's task ends with its last socket
        assert kept.sock.fileno() == -1
    assert _open_fds() == before


async def _search_fails() -> None:
    silent = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)  # the "C end": never answers
    await silent.bind(("127.0.0.1", 0))
    ep = await UdpEndpoint.bind("127.0.0.1")
    seen: list = []
    async with trio.open_nursery() as nursery:
        await nursery.start(ep.serve)

        async def read():
            while True:
                data, addr = await silent.recvfrom(2048)
                seen.append(addr[1])
        nursery.start_soon(read)
        before = _open_fds()
        node = SimpleNamespace(name="s", static_private=bytes(32))
        async with open_session_paths(node, SimpleNamespace(peer_id="p", session_id="x"), endpoint=ep) as pm:
            rec = pm.record("peer", "c", sender=False)
            t0 = trio.current_time()
            out = await birthday.search(pm, rec, role=bd.Role.POOL, controlling=False, local=ice.new_credentials(),
                                        remote=ice.new_credentials(), peer=silent.getsockname(), sockets=8)
            assert out.verified is None and out.pool is None
            assert out.reason == "no birthday probe answered within 8 s (24 checks from 8 sockets, role pool)"
            assert out.stats["probes"] == 24 and out.stats["sockets"] == 8 and out.stats["answers"] == 0
            assert trio.current_time() - t0 == pytest.approx(bd.SEARCH_TIMEOUT_S, abs=0.1)
            await trio.testing.wait_all_tasks_blocked()
            assert _open_fds() == before  # every extra socket closed
            assert ep._stun_handlers == []
        assert len(seen) == 24 and len(set(seen)) == 8  # three rounds from eight sockets
        nursery.cancel_scope.cancel()
    silent.close()


def test_a_search_that_finds_nothing_spends_its_budget_and_closes_every_extra_socket():
    trio.run(_search_fails, clock=trio.testing.MockClock(autojump_threshold=0))
