"""kafila-ctl status shows the head's speculative decoding (issue 24 item 1)."""

from __future__ import annotations

from tests.ctl.test_render import SNAPSHOT, render


def test_status_shows_speculation_counters_and_why_it_is_off():
    on = render({**SNAPSHOT, "speculation": {"on": True, "k": "auto", "passes": 11, "drafted": 88, "accepted": 85,
                                             "acceptance": 0.9659, "tokens_per_pass": 7.07, "gain": 3.9}})
    assert "speculation: 85 of 88 drafts accepted (97%), 7.07 tokens per pass, gain 3.90x" in on
    off = render({**SNAPSHOT, "speculation": {"on": False, "why": "KAFILA_SPECULATE=0", "passes": 0}})
    assert "speculation: off (KAFILA_SPECULATE=0)" in off
    assert "speculation" not in render({**SNAPSHOT, "speculation": {"on": True, "passes": 0}})
