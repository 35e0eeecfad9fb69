"""A few cases of the architecture matrix (tests/executor/test_arch_matrix.py) through real daemons
(issue 21 item 2): three kafilad processes on loopback divide a tiny model of an architecture whose
own forward does more than a plain decoder's (Gemma 3's scaled embedding, windowed blocks and
tied output; DeepSeek-V3's MLA and routed experts, 4-bit; Qwen3-Next's linear attention; gpt-oss's
sliding windows and mxfp4 experts; Granite's multipliers), uniformly, 2 blocks each, and answer a
prompt longer than every sliding window with single-process mlx-lm's greedy tokens."""

from __future__ import annotations

import pytest

from kafila_ctl.demo import LoopbackCluster
from kafila_testing import reference_tokens
from kafilad.executor import archs

pytestmark = pytest.mark.slow

#: about 40 byte tokens: past the 8-token sliding windows
PROMPT = "A ring of stages passes one hidden state around."
CASES = [("gemma3_text", "float32"), ("deepseek_v3", "q4"), ("qwen3_next", "float32"), ("gpt_oss", "mxfp4"),
         ("granite", "q8")]


@pytest.mark.parametrize("arch,precision", CASES, ids=[f"{a}-{p}" for a, p in CASES])
def test_three_daemons_serve_the_architecture_token_identically(tmp_path, arch, precision):
    d = archs.synthesize_arch(tmp_path / "model", arch, precision, seed=archs.seed_for(arch))
    ref = reference_tokens(d, PROMPT, 24)
    assert len(set(ref)) >= 3
    with LoopbackCluster(3, root=str(tmp_path / "c")) as c:
        st = c.form(str(d), strategy="uniform")["status"]
        assert sorted(tuple(b) for b in st["plan"]["blocks"].values()) == [(0, 2), (2, 4), (4, 6)]
        assert c.generate(PROMPT, 24)["token_ids"] == ref
