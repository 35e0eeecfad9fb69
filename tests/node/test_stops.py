"""StopFilter (kafilad/node/session/stops.py): the stop text is never released, not even partly, whatever
the segmentation; everything before it is, and once the stream ends without a stop, all of it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafilad.node.session.stops import StopFilter


def test_docstring_example():
    f = StopFilter(["\n\nThe end"])
    assert f.feed("was happy.\n") == "was happy." and f.held == "\n"
    assert f.feed("\nThe") == "" and f.held == "\n\nThe"
    assert f.feed(" cat") == "\n\nThe cat" and f.held == ""
    assert f.feed("\n\nThe end.") == "" and f.stopped and f.stop == "\n\nThe end"
    assert f.feed("more") == "" and f.finish() == ""
    assert f.text == "was happy.\n\nThe cat"


def test_the_stop_completed_first_wins_and_held_text_is_released_at_the_end():
    f = StopFilter(["lily", "girl"])
    assert f.feed("a little gi") == "a little " and f.held == "gi"
    assert f.feed("rl named lily") == "" and f.stop == "girl" and f.text == "a little "
    f = StopFilter(["a long stop", " "])
    assert f.feed("a long stop") == "a" and f.stop == " "  # " " was generated before "a long stop" was
    f = StopFilter(["b", "ab"])
    assert f.feed("xab") == "x" and f.stop == "ab"  # both end at the same place: the longer is cut whole
    g = StopFilter(["END"])
    assert g.feed("the E") == "the " and g.finish() == "E" and g.text == "the E" and not g.stopped


def test_empty_stop_is_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        StopFilter(["a", ""])


ALPHABET = "ab\n "


@settings(max_examples=400, deadline=None)
@given(text=st.text(ALPHABET, max_size=40), stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1,
                                                             max_size=3), cuts=st.lists(st.integers(0, 40)))
def test_any_segmentation_releases_exactly_the_text_before_the_first_stop(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    segments = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    f = StopFilter(stops)
    released = []
    for seg in segments:
        out = f.feed(seg)
        released.append(out)
        seen = "".join(released)
        assert not any(s in seen + f.held for s in stops) or f.stopped
        whole = seen + f.held  # no stop may begin inside what was released
        assert f.stopped or not any(s.startswith(whole[i:]) for s in stops for i in range(len(seen)))
    released.append(f.finish())
    hits = [(i + len(s), i) for i, s in ((text.find(s), s) for s in stops) if i >= 0]  # (end, start)
    assert "".join(released) == f.text == (text[:min(hits)[1]] if hits else text)
    assert f.stopped == bool(hits)
