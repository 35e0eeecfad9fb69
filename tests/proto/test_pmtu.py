"""Datagram size search (kafilad/proto/pmtu.py; RFC 8899; proto_spec 07 §4a): pure, fake clock."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kafilad.proto import pmtu
from kafilad.proto.pmtu import BASE_BYTES, LADDER_BYTES, MAX_PROBES, PmtuSearch, SearchState


def _walk(search: PmtuSearch, path_mtu: int, now: float = 0.0) -> list[int]:
    """Answer every probe up to ``path_mtu`` bytes, drop the rest, until the search stops; the sizes probed."""
    probed = []
    while (size := search.next_probe(now)) is not None:
        probed.append(size)
        if size <= path_mtu:
            search.confirmed(size, now)
        else:
            search.failed(size, now)
        now += 1.0
    return probed


def test_a_clean_path_climbs_the_whole_ladder_then_stays():
    s = PmtuSearch(now=0.0)
    assert s.size == BASE_BYTES and s.state == SearchState.BASE
    assert _walk(s, 9000) == list(LADDER_BYTES)
    assert s.size == max(LADDER_BYTES) and s.state == SearchState.COMPLETE
    assert s.next_probe(pmtu.RAISE_S * 3) is None  # nothing above the top of the ladder


def test_a_1280_mtu_stops_at_1252_after_three_unanswered_tries_and_raises_later():
    s = PmtuSearch(now=0.0)
    assert _walk(s, 1252) == [1252] + [1348] * MAX_PROBES
    assert s.size == 1252 and s.state == SearchState.COMPLETE and s.probes == 1 + MAX_PROBES
    assert s.next_probe(10.0) is None and s.wake_at() == MAX_PROBES + 1 + pmtu.RAISE_S - 1
    assert s.next_probe(s.wake_at()) == 1348  # the raise timer: the path may carry more now


def test_a_black_hole_goes_back_to_base_and_searches_again_later():
    s = PmtuSearch(now=0.0)
    _walk(s, 9000)
    assert s.black_hole(100.0) == BASE_BYTES and s.size == BASE_BYTES and s.black_holes == 1
    assert s.next_probe(100.0) is None and s.wake_at() == 100.0 + pmtu.BLACK_HOLE_RETRY_S
    assert _walk(s, 1300, now=s.wake_at()) == [1252] + [1348] * MAX_PROBES
    assert s.size == 1252


def test_late_or_foreign_answers_change_nothing():
    s = PmtuSearch(now=0.0)
    s.confirmed(1452, 0.0)  # not the size under test
    assert s.size == BASE_BYTES and s.probing == 1252
    s.failed(1348, 0.0)
    assert s.probing == 1252 and s.to_json() == {"datagram_bytes": 1200, "state": "base", "probes": 2,
                                                 "black_holes": 0}


@settings(max_examples=200, deadline=None)
@given(mtu=st.integers(1200, 1600), answers=st.lists(st.booleans(), max_size=40))
def test_the_confirmed_size_never_exceeds_what_was_answered(mtu, answers):
    # whatever the order of answers and losses, the size is BASE or a size some probe confirmed
    s = PmtuSearch(now=0.0)
    confirmed = {BASE_BYTES}
    for i, lost in enumerate(answers):
        size = s.next_probe(float(i))
        if size is None:
            break
        if size <= mtu and not lost:
            s.confirmed(size, float(i))
            confirmed.add(size)
        else:
            s.failed(size, float(i))
    assert s.size in confirmed and s.size <= max(mtu, BASE_BYTES)
