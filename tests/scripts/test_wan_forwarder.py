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
