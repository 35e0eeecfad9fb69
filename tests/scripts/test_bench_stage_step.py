"""scripts/bench_stage_step.py on a synthesised 3-block model (a few tokens): the ring's call sequence
gives mlx-lm's greedy tokens (the script exits non-zero otherwise) and it prints per-token times
and their ratios (the figures in docs/performance.md come from the full runs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_it_times_mlx_lm_and_the_ring_and_a_stage_step(tmp_path):
    from kafilad.executor.synth import synthesize_model
    model = synthesize_model(tmp_path / "m", arch="llama", seed=3, num_hidden_layers=3, hidden_size=32)
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_stage_step.py"), "--model", str(model),
                        "--tokens", "6", "--runs", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "blocks [0, 1, 2, 3]" in r.stdout, r.stdout
    m = re.search(r"mlx-lm generate_step ([\d.]+) ms/token, in-process ring of 3 stages ([\d.]+) ms/token, "
                  r"mlx-lm / ring ([\d.]+)", r.stdout)
    assert m, r.stdout
    single, ring, ratio = map(float, m.groups())
    assert single > 0 and ring > 0 and abs(ratio - single / ring) < 0.01
    m = re.search(r"stage \[1, 2\) run_blocks: sync ([\d.]+) ms/step, overlapped ([\d.]+) ms/step, "
                  r"overlapped / sync ([\d.]+); graph build ([\d.]+) ms/step", r.stdout)
    assert m, r.stdout
    sync, over, ratio, build = map(float, m.groups())
    assert sync > 0 and over > 0 and abs(ratio - over / sync) < 0.01 and 0 < build
