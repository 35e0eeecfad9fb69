"""Issue 21 item 3: a stage that cannot build fails the session at once, with a sentence naming the
member, the architecture and the reason; the member does not rejoin (no retry loop), and
`kafila-ctl join` ends with that sentence. Real processes on loopback.

The model is a synthesised Llama one of whose blocks holds a tensor with its shape transposed
(`model.layers.N.mlp.gate_proj.weight` [64, 192] where the config makes it [192, 64]): the same
bytes and dtype, so the host's checks (config, safetensors header, sizes, its own probe) pass,
and the failure happens where that block is built: on member m2 for block 5, on the host m0 for
block 0 (`host --strategy uniform` over 3 members: [0, 2) [2, 4) [4, 6), the host first)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kafila_ctl.demo import LoopbackCluster
from kafilad.errors import KafilaError

pytestmark = pytest.mark.slow

def transposed_tensor_model(src: Path, dst: Path, name: str) -> Path:
    """A copy of the model at `src` in `dst` whose tensor `name` has its 2-D shape reversed in the
    safetensors header (same length of header, same bytes)."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    rows, cols = header[name]["shape"]
    assert rows != cols
    header[name]["shape"] = [cols, rows]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))  # safetensors pads its header with spaces
    assert len(text) == n
    path.write_bytes(raw[:8] + text + raw[8 + n:])
    return dst


@pytest.mark.parametrize("block, culprit", [(5, "m2"), (0, "m0")], ids=["on-a-member", "on-the-host"])
def test_a_stage_that_cannot_build_fails_the_session_and_join_ends(tmp_path, synth_llama, block, culprit):
    bad_tensor = f"model.layers.{block}.mlp.gate_proj.weight"
    model = transposed_tensor_model(synth_llama, tmp_path / "bad-llama", bad_tensor)
    with LoopbackCluster(3, root=str(tmp_path / "c")) as c:
        code = c.call(0, "host", model_dir=str(model), members=3, open=True, strategy="uniform")["code"]
        c.call(1, "join", code=code)
        join = subprocess.Popen([sys.executable, "-m", "kafila_ctl.cli", "--state-dir", str(c.state_dir(2)),
                                 "join", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = join.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            join.kill()
            out, err = join.communicate()
            pytest.fail(f"`kafila-ctl join` did not end; its last lines: {(out + err)[-600:]}")
        with pytest.raises(KafilaError) as failed:
            c.call(0, "wait", states=["ready"], timeout_s=60)
        host = c.call(0, "status")
        assert host["state"] == "failed"
        error = host["error"]
        # whose stage, which architecture, what is wrong: one sentence, no Python exception text
        assert f"Member {culprit} could not build" in error and "llama" in error and bad_tensor in error, error
        assert "Error(" not in error and "Traceback" not in error, error
        assert error in str(failed.value)
        # the join that followed m2 ends, saying so (on the host's word when the host's stage failed) (exit status 1: kafila_ctl/cli.py `main`)
        assert join.returncode == 1, (out, err)
        assert bad_tensor in err and f"Member {culprit} could not build" in err, err
        assert err.count("reconnecting") == 0, err
        # no member rejoins the failed session: it stays failed, told why
        time.sleep(3)
        for i in (1, 2):
            st = c.call(i, "status")
            assert st["state"] == "failed", (i, st["state"], st.get("error"))
            assert bad_tensor in st["error"], st["error"]
        trace = [e["event"] for e in c.call(0, "trace")]
        assert trace.count("session_failed") == 1 and "replanned" not in trace, trace
