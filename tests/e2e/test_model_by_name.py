"""`kafila-ctl host --model ORG/NAME` (issue 10 "Models by name"): the host's daemon resolves the
repo id in its own Hugging Face cache, offline (HF_HUB_OFFLINE=1), and serves it; an absent repo
is a sentence from kafila-ctl. Real daemons, rendezvous and kafila-ctl processes on loopback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kafila_ctl.demo import LoopbackCluster
from kafila_testing import STORIES_PROMPT, STORIES_REFERENCE_IDS, shared_model
from test_modelref import PACKAGED, lay_out_hf_cache

pytestmark = pytest.mark.slow


def ctl(cluster, i, *args, env):
    return subprocess.run([sys.executable, "-m", "kafila_ctl.cli", "--state-dir", str(cluster.state_dir(i)), *args],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("source", ["shared", "packaged"])
def test_host_by_repo_id_from_an_offline_cache(tmp_path, source):
    src = shared_model("stories260K") if source == "shared" else PACKAGED
    cache = tmp_path / "hub"
    snap = lay_out_hf_cache(cache, "karpathy/stories260K", src)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    with LoopbackCluster(2, root=str(tmp_path / "c"), env=env) as cluster:
        r = ctl(cluster, 0, "host", "--model", "nobody/absent-model", "--members", "2", "--open", env=cluster.env)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert (f"kafila-ctl: The model nobody/absent-model is not in this daemon's Hugging Face cache at {cache}"
                in r.stderr) and "HF_HUB_OFFLINE is set" in r.stderr

        r = ctl(cluster, 0, "host", "--model", "karpathy/stories260K", "--members", "2", "--open", env=cluster.env)
        assert r.returncode == 0, r.stderr
        cluster.call(1, "join", code=r.stdout.strip())
        status = cluster.call(0, "wait", states=["ready"], timeout_s=120)
        assert status["state"] == "ready" and len(status["members"]) == 2
        result = cluster.generate(STORIES_PROMPT, 40)
        assert result["token_ids"] == STORIES_REFERENCE_IDS
        assert result["text"] == (", there was a little girl named Lily. She loved to play outside in the park. "
                                  "One day, she saw a big, red ball.")
        # the session serves the cached snapshot, and remembers it (a restarted host needs no network)
        record = json.loads((cluster.state_dir(0) / "session.json").read_text())
        assert record["model_dir"] == str(snap.resolve())
