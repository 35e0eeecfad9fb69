"""The daemon's environment switches (kafilad/node/serving/schedule_settings.py): parsed once, bad values refused at start."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kafilad.node.serving.schedule_settings import (DAEMON_SWITCH_INTERVAL_S, SWITCH_INTERVAL_ENV,
                                                   daemon_switch_interval_s, pinned_micro_batches)


@pytest.mark.parametrize("raw, seconds", [("0.2", 0.0002), (" 5 ", 0.005), ("1000", 1.0)])
def test_the_switch_interval_is_given_in_milliseconds(raw, seconds):
    assert daemon_switch_interval_s({SWITCH_INTERVAL_ENV: raw}) == pytest.approx(seconds)


def test_unset_the_switch_interval_is_the_daemons_default():
    assert daemon_switch_interval_s({}) == DAEMON_SWITCH_INTERVAL_S
    assert daemon_switch_interval_s({SWITCH_INTERVAL_ENV: "  "}) == DAEMON_SWITCH_INTERVAL_S


@pytest.mark.parametrize("raw", ["0", "-1", "fast", "1001", "nan"])
def test_a_bad_switch_interval_is_refused_with_its_name(raw):
    with pytest.raises(ValueError, match=f"{SWITCH_INTERVAL_ENV} must be a number of milliseconds"):
        daemon_switch_interval_s({SWITCH_INTERVAL_ENV: raw})


@pytest.mark.parametrize("raw, n", [("", None), ("1", 1), ("3", 3)])
def test_pinned_micro_batches(raw, n):
    assert pinned_micro_batches({"KAFILA_MICRO_BATCHES": raw}) == n


def test_the_daemon_refuses_to_start_with_a_bad_switch_interval(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kafilad.main", "--state-dir", str(tmp_path / "s")],
                       env={"PATH": "/usr/bin:/bin", SWITCH_INTERVAL_ENV: "soon"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"kafilad: {SWITCH_INTERVAL_ENV} must be a number of milliseconds in (0, 1000], not 'soon'." in r.stderr
    assert not (tmp_path / "s").exists()
