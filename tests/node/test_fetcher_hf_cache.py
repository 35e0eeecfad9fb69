"""A member that holds a model file's blob in its Hugging Face cache reads its tensors from it (issue 10)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import trio

from kafilad.errors import RemoteProtocolError
from kafilad.executor.synth import synthesize_model
from kafilad.modelinfo import read_model_info
from kafilad.node.shards.fetcher import FROM_CACHE, FROM_HF_CACHE, FROM_HOST, Fetcher
from kafilad.node.shards.modelfiles import FILE_SHA256_CACHE, FileHashes, ModelFiles
from kafilad.proto import control as cf

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def host_files(tmp_path_factory):
    d = synthesize_model(tmp_path_factory.mktemp("m") / "synth", num_hidden_layers=2, hidden_size=32)
    return ModelFiles(str(d), read_model_info(d), state_dir=tmp_path_factory.mktemp("host_state"))


def lay_out_hf_cache(hf_dir, model_file, repo="models--org--synth", commit="0" * 40):
    """`model_file` as huggingface_hub stores it: a blob named by its sha256, a snapshot symlink."""
    sha = hashlib.sha256(model_file.read_bytes()).hexdigest()
    blobs = hf_dir / repo / "blobs"
    blobs.mkdir(parents=True)
    shutil.copyfile(model_file, blobs / sha)
    snap = hf_dir / repo / "snapshots" / commit
    snap.mkdir(parents=True)
    os.symlink(f"../../blobs/{sha}", snap / model_file.name)
    (hf_dir / repo / "refs").mkdir()
    (hf_dir / repo / "refs" / "main").write_text(commit)
    return blobs / sha


class Host:
    """Answers a Fetcher's `fetch` frames from the host's real model files, and records what was asked."""

    def __init__(self, files: ModelFiles):
        self.files = files
        self.fetcher = None
        self.asked: list[tuple[str, int, int]] = []

    async def send(self, wire: dict) -> int:
        f = cf.decode_control(wire)
        assert isinstance(f, cf.Fetch)
        self.asked.append((f.file, f.offset, f.length))
        assert self.files.check_range(f.file, f.offset, f.length) is None
        self.fetcher.deliver(cf.Data(id=f.id, data=self.files.read(f.file, f.offset, f.length)))
        return len(wire)


def fetch_all(fetcher, rows):
    async def main():
        return [await fetcher.fetch_verified(file=t["file"], offset=t["offset"], nbytes=t["nbytes"],
                                             sha256=t["sha256"], file_sha256=t.get("file_sha256")) for t in rows]
    return trio.run(main)


def test_the_plan_names_each_tensors_whole_file_sha256(host_files):
    whole = hashlib.sha256((host_files.model_dir / WEIGHTS).read_bytes()).hexdigest()
    rows = host_files.tensor_table(0, 2, True)
    assert rows and all(t["file"] == WEIGHTS and t["file_sha256"] == whole for t in rows)
    record = json.loads((host_files.file_hashes.record).read_text())
    assert [e["sha256"] for e in record.values()] == [whole]


def test_tensors_in_the_hf_cache_are_not_fetched_and_an_absent_blob_is(host_files, tmp_path):
    rows = host_files.tensor_table(0, 2, True)
    blob = lay_out_hf_cache(tmp_path / "hub", host_files.model_dir / WEIGHTS)
    assert (tmp_path / "hub" / "models--org--synth" / "snapshots" / ("0" * 40) / WEIGHTS).resolve() == blob.resolve()
    # one row names a whole file whose blob this member does not hold
    absent = dict(rows[1], file_sha256=hashlib.sha256(b"another revision").hexdigest())
    plan = [rows[0], absent] + rows[2:]
    host = Host(host_files)
    host.fetcher = fetcher = Fetcher(host.send, tmp_path / "cache", hf_cache_dir=tmp_path / "hub")
    got = fetch_all(fetcher, plan)
    assert [src for _, src in got] == [FROM_HF_CACHE, FROM_HOST] + [FROM_HF_CACHE] * (len(rows) - 2)
    assert host.asked == [(WEIGHTS, absent["offset"], absent["nbytes"])]  # only the absent one (fits one frame)
    for (data, _), t in zip(got, plan):
        assert data == host_files.read(WEIGHTS, t["offset"], t["nbytes"])
    # the fetched tensor went into the member's own cache, the HF-cache ones did not (no second copy)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [absent["sha256"]]
    assert fetch_all(fetcher, [absent])[0][1] == FROM_CACHE and len(host.asked) == 1


def test_a_blob_whose_range_does_not_match_is_not_used(host_files, tmp_path):
    rows = host_files.tensor_table(0, 2, True)
    blob = lay_out_hf_cache(tmp_path / "hub", host_files.model_dir / WEIGHTS)
    bad = rows[-1]
    with open(blob, "r+b") as f:  # one byte of one tensor flipped in the member's copy
        f.seek(bad["offset"])
        b = f.read(1)
        f.seek(bad["offset"])
        f.write(bytes([b[0] ^ 0xFF]))
    host = Host(host_files)
    host.fetcher = fetcher = Fetcher(host.send, tmp_path / "cache", hf_cache_dir=tmp_path / "hub")
    got = fetch_all(fetcher, rows)
    assert [src for _, src in got] == [FROM_HF_CACHE] * (len(rows) - 1) + [FROM_HOST]
    assert host.asked == [(WEIGHTS, bad["offset"], bad["nbytes"])]
    assert got[-1][0] == host_files.read(WEIGHTS, bad["offset"], bad["nbytes"])


def test_a_file_sha256_that_is_not_a_digest_is_refused(host_files, tmp_path):
    row = dict(host_files.tensor_table(0, 1, False)[0], file_sha256="../../etc")
    host = Host(host_files)
    host.fetcher = fetcher = Fetcher(host.send, tmp_path / "cache", hf_cache_dir=tmp_path / "hub")
    with pytest.raises(RemoteProtocolError):
        fetch_all(fetcher, [row])
    assert host.asked == []


def test_file_hashes_are_remembered_by_size_and_mtime(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc" * 1000)
    record = tmp_path / FILE_SHA256_CACHE
    assert FileHashes(record).sha256(f) == hashlib.sha256(b"abc" * 1000).hexdigest()
    # a fresh FileHashes trusts the record while (size, mtime) are unchanged: it does not rehash
    entry = json.loads(record.read_text())
    (key,) = entry
    entry[key]["sha256"] = "f" * 64
    record.write_text(json.dumps(entry))
    assert FileHashes(record).sha256(f) == "f" * 64
    # a changed file (new mtime) is hashed again
    f.write_bytes(b"xyz" * 1000)
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert FileHashes(record).sha256(f) == hashlib.sha256(b"xyz" * 1000).hexdigest()
