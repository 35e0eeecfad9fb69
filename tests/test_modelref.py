"""Models by name (kafilad/modelref.py; issue 10 "Models by name"), offline.

A Hugging Face cache is laid out in a tmp dir exactly as huggingface_hub writes it
(`models--ORG--NAME/blobs/<sha256>`, `snapshots/<commit>/<file>` -> `../../blobs/<sha256>`,
`refs/main` holding the commit), holding stories260K (../shared/models, read in place; its
twin is the copy shipped in kafila_ctl/models/), and HF_HUB_OFFLINE=1: nothing goes to the network.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import trio

from kafila_testing import shared_model
from kafilad.errors import KafilaError
from kafilad.modelref import missing_model_files, parse_repo_id, resolve_model_dir, resolve_model_ref

PACKAGED = Path(__file__).resolve().parent.parent / "kafila_ctl" / "models" / "stories260K"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
MODEL_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def lay_out_hf_cache(cache: Path, repo_id: str, source: Path, files=MODEL_FILES, commit: str = COMMIT) -> Path:
    """Put `files` of `source` into `cache` under `repo_id` in huggingface_hub's layout; return the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for name in files:
        data = (source / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.mark.parametrize("source", ["shared", "packaged"])
def test_a_cached_repo_resolves_offline_to_its_snapshot(offline_cache, source):
    src = shared_model("stories260K") if source == "shared" else PACKAGED
    snap = lay_out_hf_cache(offline_cache, "karpathy/stories260K", src)
    path = resolve_model_ref("karpathy/stories260K")
    assert Path(path) == snap
    assert json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"] == 5
    assert (Path(path) / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert resolve_model_ref(f"karpathy/stories260K@{COMMIT}") == path  # a pinned commit, also offline
    assert trio.run(resolve_model_dir, "karpathy/stories260K") == path  # the daemon's (threaded) entry


def test_an_absent_repo_offline_is_a_sentence(offline_cache):
    with pytest.raises(KafilaError) as e:
        resolve_model_ref("nobody/no-such-model")
    msg = str(e.value)
    assert msg.startswith(f"The model nobody/no-such-model is not in this daemon's Hugging Face cache at {offline_cache}")
    assert "HF_HUB_OFFLINE is set" in msg and "hf download nobody/no-such-model" in msg


def test_a_partial_snapshot_offline_names_what_it_lacks(offline_cache):
    lay_out_hf_cache(offline_cache, "karpathy/stories260K", PACKAGED, files=["config.json", "tokenizer.json"])
    with pytest.raises(KafilaError, match=r"its snapshot there lacks model\.safetensors"):
        resolve_model_ref("karpathy/stories260K")


def test_paths_are_not_repo_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert parse_repo_id("org/local") is None  # exists here: a path
    assert parse_repo_id("/models/x") is None and parse_repo_id("./a/b") is None and parse_repo_id("~/a/b") is None
    assert parse_repo_id("one-part") is None and parse_repo_id("a/b/c") is None and parse_repo_id("") is None
    assert parse_repo_id("mlx-community/Qwen3-8B-4bit") == ("mlx-community/Qwen3-8B-4bit", None)
    assert parse_repo_id("Qwen/Qwen3-8B@v1.0") == ("Qwen/Qwen3-8B", "v1.0")
    assert resolve_model_ref(str(tmp_path / "org" / "local")) == str(tmp_path / "org" / "local")
    assert resolve_model_ref("/no/such/dir") == "/no/such/dir"  # HostSession says it has no config.json


def test_missing_model_files(tmp_path):
    assert missing_model_files(PACKAGED) == []
    assert missing_model_files(tmp_path) == ["config.json", "tokenizer.json", "model.safetensors"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert missing_model_files(tmp_path)[-1:] == ["model-00002-of-00002.safetensors"]


def test_packaged_copy_is_the_shared_model():
    """The demo's copy (kafila_ctl/models/stories260K) has the bytes of ../shared/models/stories260K."""
    shared = shared_model("stories260K")
    for name in MODEL_FILES:
        assert (PACKAGED / name).read_bytes() == (shared / name).read_bytes(), name


def test_a_hub_out_of_reach_is_one_line_saying_so(tmp_path):
    """A new user's trial (2026-12-02): `host --model foo/bar` without a network printed
    huggingface_hub's multi-line message ("Got: ConnectError: ... An error happened while trying to
    locate the files on the Hub, ..."). It is one sentence naming the cause now."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_CACHE=str(tmp_path))  # nothing listens on port 9
    code = ("from kafilad.modelref import resolve_model_ref\n"
            "try:\n    resolve_model_ref('nobody/no-such-model')\nexcept Exception as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("The model nobody/no-such-model is not in this daemon's Hugging Face cache"), out
    assert "could not be downloaded: the Hugging Face Hub could not be reached (" in out, out
    assert "check this machine's network" in out and out.count("\n") == 1, out
