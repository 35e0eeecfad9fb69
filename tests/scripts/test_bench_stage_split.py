"""scripts/bench_stage_split.py on a synthesised 3-block model (a few steps): it prints a whole and a
split decode step and their ratio (the figures in docs/performance.md come from the full runs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_it_times_a_whole_and_a_split_decode_step(tmp_path):
    from kafilad.executor.synth import synthesize_model
    model = synthesize_model(tmp_path / "m", arch="llama", seed=3, num_hidden_layers=3, hidden_size=32)
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_stage_split.py"), str(model),
                        "--split", "0:1,1:3", "--steps", "3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"whole ([\d.]+) ms; split \[\(0, 1\), \(1, 3\)\] ([\d.]+) ms \(stages ([\d.]+), ([\d.]+) ms\); "
                  r"split ÷ whole ([\d.]+)", r.stdout)
    assert m, r.stdout
    whole, split, a, b, ratio = map(float, m.groups())
    assert whole > 0 and split > 0 and a > 0 and b > 0 and abs(ratio - split / whole) < 0.01
