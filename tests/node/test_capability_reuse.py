"""A capability measured for the same model is reused for CAPABILITY_REUSE_S (kafilad/node/serving/stagehost.py):
a member daemon restarted into its session rejoins without the 1-3 s timing probe (chaos runs:
the probe was most of a killed member's recovery after its restart)."""

from __future__ import annotations

import json
import time

import pytest

from kafilad.node.serving import stagehost
from kafilad.proto import control as cf


@pytest.fixture
def config():
    from kafilad.executor.synth import synth_config
    return synth_config("llama", num_hidden_layers=2, hidden_size=64)


@pytest.fixture
def probes_run(monkeypatch) -> list:
    """The timing probes run (kafilad/executor/probe.py `measure_capability`, which still runs in full):
    one entry per probe, so a test counts them instead of timing them."""
    probe = stagehost.executor().probe
    real, runs = probe.measure_capability, []

    def counted(*args, **kwargs):
        runs.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(probe, "measure_capability", counted)
    return runs


def test_the_same_model_is_measured_once_then_reused_with_memory_read_afresh(tmp_path, config, probes_run):
    admitted = cf.Admitted(session_id="s", model_id="m", config=config, dtype="float32", context=64, concurrency=1)
    before = time.time()
    first = stagehost.measure_capability(admitted, tmp_path)
    assert len(probes_run) == 1
    saved = json.loads((tmp_path / stagehost.CAPABILITY_FILE).read_text())
    assert saved["capability"]["bandwidth_Bps"] == first["bandwidth_Bps"] > 0
    assert before <= saved["measured_at_s"] <= time.time()
    again = stagehost.measure_capability(admitted, tmp_path)
    assert len(probes_run) == 1  # reused: no second probe (the 1-3 s a restarted member's rejoin spent)
    for k in ("bandwidth_Bps", "step_overhead_s", "batch_row_cost", "dtype", "bandwidth_source"):
        assert again[k] == first[k], k
    assert again["memory_bytes"] > 0


def test_another_model_an_old_measurement_or_no_state_dir_measures_again(tmp_path, config, probes_run):
    admitted = cf.Admitted(session_id="s", model_id="m", config=config, dtype="float32", context=64, concurrency=1)
    first = stagehost.measure_capability(admitted, tmp_path)
    other = cf.Admitted(session_id="s", model_id="m", config={**config, "hidden_size": 32, "head_dim": 8}, dtype="float32",
                        context=64, concurrency=1)
    assert stagehost._reused_capability(tmp_path, stagehost._capability_key(other.config, other.dtype)) is None
    assert stagehost._reused_capability(tmp_path, stagehost._capability_key(config, "bfloat16")) is None
    assert stagehost._reused_capability(tmp_path, stagehost._capability_key(config, "float32"))["bandwidth_Bps"] == first["bandwidth_Bps"]
    path = tmp_path / stagehost.CAPABILITY_FILE
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "measured_at_s": time.time() - stagehost.CAPABILITY_REUSE_S - 1}))
    assert stagehost._reused_capability(tmp_path, stagehost._capability_key(config, "float32")) is None
    path.write_text("{not json")
    assert stagehost._reused_capability(tmp_path, stagehost._capability_key(config, "float32")) is None
    assert stagehost._reused_capability(None, stagehost._capability_key(config, "float32")) is None
    stagehost.measure_capability(admitted, tmp_path)  # the stored measurement is unreadable: measured again
    assert len(probes_run) == 2
