"""The pure rules of speculative decoding (kafilad/proto/speculation.py, issue 24 item 1): prompt
lookup, greedy and point-draft acceptance, the expected tokens of a pass and the choice of k."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafilad.proto.speculation import (K_FIRST, K_MAX, PROBE_BACKOFF, KChooser, SpeculationCounters, accept_greedy,
                                       accept_point_drafts, best_k, expected_tokens, lookup_drafts)


def test_lookup_takes_what_followed_the_latest_longest_match():
    seq = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    assert lookup_drafts(seq, 3) == [4, 5, 9]  # the 3-gram 1 2 3 occurred at 0
    assert lookup_drafts(seq, 1) == [4]
    assert lookup_drafts([5, 2, 3, 6, 2, 3, 7, 2, 3], 2) == [7, 2]  # the latest of two 2-gram matches
    assert lookup_drafts([1, 2, 3, 4], 4) == []  # nothing recurs
    assert lookup_drafts([1, 2, 1, 2], 0) == []
    assert lookup_drafts([4, 1, 4], 2, min_ngram=1) == [1, 4]
    with pytest.raises(ValueError):
        lookup_drafts([1], -1)


@given(st.lists(st.integers(0, 5), max_size=60), st.integers(0, 8))
def test_lookup_drafts_follow_an_earlier_occurrence_of_the_suffix(seq, k):
    out = lookup_drafts(seq, k)
    assert len(out) <= k
    if out:  # some n >= 2: seq[i:i+n] == the suffix and out == seq[i+n:i+n+len(out)]
        assert any(seq[i:i + n] == seq[len(seq) - n:] and seq[i + n:i + n + len(out)] == out
                   for n in (2, 3) for i in range(len(seq) - n))


def test_greedy_acceptance_is_the_longest_matching_prefix_plus_one():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]  # all accepted: a bonus token
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]) == [4]
    assert accept_greedy([], [3]) == [3]
    with pytest.raises(ValueError):
        accept_greedy([1], [1])


@given(st.lists(st.integers(0, 3), max_size=8), st.data())
def test_greedy_acceptance_equals_one_token_at_a_time(drafts, data):
    """The tokens a pass yields are what plain greedy decoding gives for those positions: each target
    is the model's next token given the accepted ones before it."""
    targets = data.draw(st.lists(st.integers(0, 3), min_size=len(drafts) + 1, max_size=len(drafts) + 1))
    out = accept_greedy(drafts, targets)
    assert out == targets[:len(out)]
    assert out[:-1] == drafts[:len(out) - 1]
    assert len(out) == len(drafts) + 1 or drafts[len(out) - 1] != targets[len(out) - 1]


def test_point_draft_rejection_sampling_keeps_the_distribution():
    """One position, vocabulary {0, 1, 2}, p = (0.5, 0.3, 0.2), draft 0: accept with p(0), else draw
    from p without 0 renormalised; the result is distributed as p."""
    p = [0.5, 0.3, 0.2]
    rng = random.Random(7)
    counts = [0, 0, 0]
    n = 40000
    for _ in range(n):
        if accept_point_drafts([p[0]], [rng.random()]) == 1:
            counts[0] += 1
        else:
            counts[rng.choices([1, 2], weights=[p[1], p[2]])[0]] += 1
    for i in range(3):
        assert abs(counts[i] / n - p[i]) < 0.015
    assert accept_point_drafts([0.9, 0.9, 0.1], [0.5, 0.2, 0.5]) == 2
    with pytest.raises(ValueError):
        accept_point_drafts([0.5], [])


def test_expected_tokens_and_best_k():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert best_k(0.0, 0.01, 0.0) == 0  # drafts never accepted: no speculation
    assert best_k(0.99, 0.01, 0.0) == K_MAX  # free extra positions and good drafts: all of them
    assert best_k(0.9, 0.01, 0.01) == 0  # each draft costs a whole pass: never pays
    assert best_k(0.6, 0.01, 0.003) == 1  # costly extra positions: one draft


@settings(max_examples=200)
@given(st.floats(0, 1), st.floats(1e-4, 1), st.floats(0, 1))
def test_best_k_beats_plain_decoding_when_chosen(a, c0, c1):
    k = best_k(a, c0, c1)
    assert 0 <= k <= K_MAX
    if k:
        assert expected_tokens(a, k) / (c0 + c1 * k) > 1 / c0


def test_chooser_measures_then_drafts_then_backs_off_on_misses():
    ch = KChooser()
    assert ch.choose() == 0  # c0 unmeasured: a plain pass measures it
    ch.note_pass(0, 0, 0.05)
    k = ch.choose()
    assert k == K_FIRST  # optimistic acceptance, but extra positions not yet measured
    ch.note_pass(k, k, 0.05)  # all accepted, at no extra cost: now k may grow
    assert ch.c1_s == 0.0 and ch.choose() == K_MAX
    k = K_MAX
    for _ in range(20):  # drafts are never accepted
        ch.note_pass(k, 0, 0.06)
        k = ch.choose()
        if k == 0:
            break
    assert k == 0
    ks = [ch.choose() for _ in range(PROBE_BACKOFF + 1)]
    assert ks == [0] * PROBE_BACKOFF + [1]  # the back-off, then a probe
    ch.note_pass(1, 0, 0.06)  # the probe did not pay: the back-off doubles
    assert [ch.choose() for _ in range(2 * PROBE_BACKOFF + 1)] == [0] * (2 * PROBE_BACKOFF) + [1]
    for _ in range(10):
        ch.note_pass(1, 1, 0.05)  # now drafts are accepted at no extra cost
    assert ch.choose() > 1


def test_chooser_off_and_no_drafts():
    assert KChooser(k_max=0).choose() == 0
    ch = KChooser()
    before = ch.accept_rate
    ch.note_no_drafts()
    assert ch.accept_rate < before
    with pytest.raises(ValueError):
        ch.note_pass(2, 3, 0.1)


def test_counters():
    c = SpeculationCounters()
    assert c.snapshot()["gain"] is None and c.tokens_per_pass == 1.0
    c.note(0, 0, 0.1)
    c.note(4, 3, 0.2)
    assert (c.passes, c.drafted, c.accepted, c.tokens, c.plain_passes) == (1, 4, 3, 4, 1)
    assert c.acceptance == 0.75 and c.tokens_per_pass == 2.5
    assert c.gain == pytest.approx((4 / 0.2) / (1 / 0.1))
