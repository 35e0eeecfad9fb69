"""Fixtures for end-to-end tests: real kafilad processes and a real rendezvous on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from kafila_ctl.demo import LoopbackCluster


@pytest.fixture(scope="session")
def synth_llama(tmp_path_factory) -> Path:
    """A Llama-shaped model the project synthesises (random weights, byte-level tokenizer)."""
    from kafilad.executor.synth import synthesize_model
    return synthesize_model(tmp_path_factory.mktemp("synth") / "synth-llama", arch="llama", seed=7,
                            num_hidden_layers=6, hidden_size=64)


@pytest.fixture(scope="session")
def synth_qwen3(tmp_path_factory) -> Path:
    from kafilad.executor.synth import synthesize_model
    return synthesize_model(tmp_path_factory.mktemp("synth") / "synth-qwen3", arch="qwen3", seed=11,
                            num_hidden_layers=5, hidden_size=64)


@pytest.fixture
def cluster3(tmp_path):
    """Three daemons; ring edges go direct where checks succeed (on loopback: all of them)."""
    with LoopbackCluster(3, root=str(tmp_path / "c"), record_relay=True) as c:
        yield c


@pytest.fixture
def cluster3_relayed(tmp_path):
    """Three daemons whose ring edges all run over relayed circuits (KAFILA_DIRECT=0)."""
    with LoopbackCluster(3, root=str(tmp_path / "c"), record_relay=True, env={"KAFILA_DIRECT": "0"}) as c:
        yield c
