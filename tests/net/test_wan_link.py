"""WanLink: fixed delay and token-bucket cap on a fake clock (issue 24 item 2)."""

import pytest

from kafilad.net.wan_link import LinkStats, WanLink


def test_delay_only_delivers_exactly_delay_later_in_order():
    link = WanLink(delay_s=0.040)
    assert link.receive_datagram(b"a", "B", now=1.000)
    assert link.receive_datagram(b"b", "C", now=1.010)
    assert link.get_timer() == pytest.approx(1.040)
    assert link.datagrams_to_send(now=1.0399) == []
    assert link.datagrams_to_send(now=1.040) == [(b"a", "B")]
    assert link.get_timer() == pytest.approx(1.050)
    assert link.datagrams_to_send(now=2.0) == [(b"b", "C")]
    assert link.get_timer() is None
    assert link.stats() == LinkStats(forwarded=2, forwarded_bytes=2, dropped=0)


def test_zero_delay_no_cap_is_due_immediately():
    link = WanLink(delay_s=0.0)
    link.receive_datagram(b"x" * 1200, 1, now=5.0)
    assert link.datagrams_to_send(now=5.0) == [(b"x" * 1200, 1)]


def test_rate_cap_spaces_datagrams_by_serialisation_time_after_burst():
    # 1000 B/s, bucket 1000 B: the first 1000-byte datagram passes at once, the next waits 1 s.
    link = WanLink(delay_s=0.010, rate_Bps=1000.0, burst_bytes=1000)
    for _ in range(3):
        assert link.receive_datagram(b"x" * 1000, "d", now=0.0)
    due = []
    while (t := link.get_timer()) is not None:
        due.append(t)
        link.datagrams_to_send(now=t)
    assert due == pytest.approx([0.010, 1.010, 2.010])


def test_bucket_refills_while_idle_up_to_burst():
    link = WanLink(delay_s=0.0, rate_Bps=1000.0, burst_bytes=500)
    link.receive_datagram(b"x" * 500, "d", now=0.0)  # empties the bucket
    # 10 s idle refills only to the 500-byte burst: 800 bytes wait 0.3 s.
    link.receive_datagram(b"x" * 800, "d", now=10.0)
    link.datagrams_to_send(now=0.0)
    assert link.get_timer() == pytest.approx(10.3)


def test_queue_limit_tail_drops_and_counts():
    link = WanLink(delay_s=0.0, rate_Bps=1000.0, burst_bytes=1000, queue_limit_bytes=1500)
    accepted = [link.receive_datagram(b"x" * 1000, "d", now=0.0) for _ in range(5)]
    # backlog before each: 0 s, 0 s(after burst), 1 s=1000 B, 2 s=2000 B > 1500 -> drop
    assert accepted == [True, True, True, False, False]
    assert link.stats().dropped == 2


def test_cap_gives_measured_throughput_equal_to_rate():
    rate = 125_000.0  # 1 Mbit/s
    link = WanLink(delay_s=0.0, rate_Bps=rate, burst_bytes=1200, queue_limit_bytes=10**9)
    for _ in range(101):
        link.receive_datagram(b"x" * 1200, "d", now=0.0)
    last = None
    while (t := link.get_timer()) is not None:
        last = t
        link.datagrams_to_send(now=t)
    # the first datagram rides the burst; the other 100 take 100*1200/rate seconds
    assert last == pytest.approx(100 * 1200 / rate)


@pytest.mark.parametrize("kw", [{"delay_s": -1}, {"delay_s": 0, "rate_Bps": 0},
                                {"delay_s": 0, "burst_bytes": 0}])
def test_bad_parameters_raise(kw):
    with pytest.raises(ValueError):
        WanLink(**kw)
