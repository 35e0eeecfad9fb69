"""The WAN forwarder on real loopback UDP sockets, timed by trio's MockClock (issue 24 item 2)."""

import sys
from pathlib import Path

import pytest
import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from wan_forwarder import probe_rtt_ms  # noqa: E402


@pytest.mark.parametrize("delay_ms", [0.0, 10.0, 40.0])
def test_probe_round_trip_is_twice_the_one_way_delay(delay_ms):
    clock = trio.testing.MockClock(autojump_threshold=0)
    rtts = trio.run(probe_rtt_ms, delay_ms, None, 5, clock=clock)
    assert len(rtts) == 5
    assert rtts == pytest.approx([2 * delay_ms] * 5, abs=1e-6)


def test_probe_through_rate_cap_waits_for_the_bucket_once_the_burst_is_spent():
    # 1 Mbit/s = 125000 B/s, 64 KiB bucket, 20000-byte probes one at a time, 10 ms each way.
    # Up link: probes 0-2 ride the burst (65536 -> 10536 B, +2500 B refill per 20 ms RTT);
    # probe 3 finds 13036 B and waits 6964/125000 s = 55.712 ms; probe 4 finds 2500 B and waits
    # 140 ms. The down link's bucket has refilled to 20000 B by each late arrival, so adds nothing.
    clock = trio.testing.MockClock(autojump_threshold=0)
    rtts = trio.run(probe_rtt_ms, 10.0, 1.0, 5, 20000, clock=clock)
    assert rtts == pytest.approx([20.0, 20.0, 20.0, 75.712, 160.0], abs=1e-6)


def test_each_client_has_its_own_mapping_and_gets_its_own_answers():
    """Two peers reach one daemon through one forwarder (kafila_ctl.wan_hops.forward): the daemon sees
    each from its own upstream socket, and each answer goes back to the peer it was for."""
    from kafila_ctl.wan_hops import forward, udp_socket

    async def main() -> tuple:
        daemon = await udp_socket()
        fwd = await udp_socket()
        a, b = await udp_socket(), await udp_socket()
        seen: list = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: forward(fwd, daemon.getsockname(), delay_ms=10.0))

            async def answer() -> None:
                while True:
                    data, addr = await daemon.recvfrom(100)
                    seen.append((data, addr))
                    await daemon.sendto(b"re:" + data, addr)
            nursery.start_soon(answer)
            t0 = trio.current_time()
            await a.sendto(b"from a", fwd.getsockname())
            await b.sendto(b"from b", fwd.getsockname())
            got_a, _ = await a.recvfrom(100)
            got_b, _ = await b.recvfrom(100)
            took_ms = (trio.current_time() - t0) * 1000
            nursery.cancel_scope.cancel()
        return got_a, got_b, seen, took_ms

    got_a, got_b, seen, took_ms = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert (got_a, got_b) == (b"re:from a", b"re:from b")
    assert [d for d, _ in seen] == [b"from a", b"from b"] and seen[0][1] != seen[1][1]  # two mappings
    assert took_ms == pytest.approx(20.0, abs=1e-6)
