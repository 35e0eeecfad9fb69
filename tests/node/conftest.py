"""Fixtures of the in-process session tests (tests/node/session_harness.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def session_model(tmp_path_factory):
    """The small synthesised Llama the in-process sessions serve (3 blocks, hidden 32, seed 7)."""
    from kafilad.executor.synth import synthesize_model
    return synthesize_model(tmp_path_factory.mktemp("sessions") / "synth", arch="llama", seed=7,
                            num_hidden_layers=3, hidden_size=32)
