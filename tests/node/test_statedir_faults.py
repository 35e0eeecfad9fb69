"""State-directory faults (kafilad/node/session/statedir.py, fetcher.py, trace.py; issue 22 §6): a damaged
roster or session file is moved aside with a warning naming it and what to do, the key is kept; a
full disk fails a shard fetch with a sentence (a real ENOSPC from a small tmpfs); a shared or
foreign state directory is refused, not chmodded. The same faults in a running daemon:
tests/daemon/test_state_faults.py."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import trio

from kafilad.errors import KafilaError, SessionError
from kafilad.node.shards.fetcher import Fetcher
from kafilad.node.session.statedir import StateDir
from kafilad.node.session.trace import Trace
from kafilad.proto import control as cf

GOOD_KEY = "ab" * 32


def state(tmp_path: Path) -> StateDir:
    s = StateDir(tmp_path / "state").ensure()
    s.load_or_create_static_key()
    return s


def aside(path: Path) -> list[Path]:
    return sorted(path.parent.glob(path.name + ".corrupt-*"))


@pytest.mark.parametrize("content, why", [
    (b"\xff\xfe{\"p\": 1}", "byte 0 is not UTF-8 text"),
    (b"{\"p-1\": {\"public_key\": ", "it is not JSON: Expecting value at line 1, column 24"),
    (b"[1, 2]", "it holds a JSON list, not an object"),
])
def test_a_damaged_roster_is_moved_aside_and_the_daemon_keeps_its_key(tmp_path, caplog, content, why):
    """Before: a restored session failed with "internal error: UnicodeDecodeError…", the file unnamed."""
    s = state(tmp_path)
    key = s.key_path.read_bytes()
    s.roster_path.write_bytes(content)
    with caplog.at_level(logging.WARNING, "kafilad.state"):
        assert s.load_roster() == {}
    moved, = aside(s.roster_path)
    assert moved.read_bytes() == content and not s.roster_path.exists()
    text = caplog.text
    assert f"{s.roster_path} is damaged ({why}); it was moved to {moved}" in text
    assert "wait for `kafila-ctl admit` once more" in text and "Error(" not in text
    assert s.load_roster() == {} and len(aside(s.roster_path)) == 1  # once moved, it is simply absent
    assert s.load_or_create_static_key()[0] == key  # the identity is kept


def test_a_roster_with_some_bad_entries_keeps_the_good_ones(tmp_path, caplog):
    s = state(tmp_path)
    doc = {"p-good": {"public_key": GOOD_KEY, "name": "birch"}, "p-bad": {"public_key": "zz", "name": "x"},
           "p-worse": "not an entry"}
    s.roster_path.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, "kafilad.state"):
        assert s.load_roster() == {"p-good": doc["p-good"]}
    assert "2 of its 3 entries are not" in caplog.text and "The 1 readable entries are kept" in caplog.text
    assert json.loads(aside(s.roster_path)[0].read_text()) == doc
    assert json.loads(s.roster_path.read_text()) == {"p-good": doc["p-good"]}  # rewritten with what was kept


@pytest.mark.parametrize("content", [b"\x00\x01garbage", b"{\"code\": 5}", b"{\"code\": \"kfl-x\""])
def test_a_damaged_session_file_is_moved_aside_with_a_warning(tmp_path, caplog, content):
    """Before: dropped silently, though the docstring promised a warning."""
    s = state(tmp_path)
    s.session_path.write_bytes(content)
    with caplog.at_level(logging.WARNING, "kafilad.state"):
        assert s.remembered_session() is None
    moved, = aside(s.session_path)
    assert moved.read_bytes() == content
    assert f"{s.session_path} is damaged" in caplog.text and f"moved to {moved}" in caplog.text
    assert "host it again (kafila-ctl host) or join it again (kafila-ctl join CODE)" in caplog.text


def test_a_shared_state_directory_is_refused_not_chmodded(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(KafilaError, match=r"is a shared directory \(like /tmp\) \(mode 1777\).*--state-dir naming a "
                                          r"directory of your own"):
        StateDir(shared).ensure()
    assert shared.stat().st_mode & 0o7777 == 0o1777 and not (shared / "cache").exists()
    group = tmp_path / "group"
    group.mkdir()
    os.chmod(group, 0o770)
    with pytest.raises(KafilaError, match="is writable by its group"):
        StateDir(group).ensure()
    mine = tmp_path / "mine"
    mine.mkdir()
    os.chmod(mine, 0o755)  # the user's own, only readable by others: made private as before
    StateDir(mine).ensure()
    assert mine.stat().st_mode & 0o777 == 0o700
    fresh = tmp_path / "a" / "b"
    StateDir(fresh).ensure()
    assert fresh.stat().st_mode & 0o777 == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_state_directory_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4242, 4242)
    with pytest.raises(KafilaError, match=r"belongs to another user \(uid 4242\)"):
        StateDir(theirs).ensure()
    assert theirs.stat().st_uid == 4242 and theirs.stat().st_mode & 0o777 == 0o700


# ---- a full disk: a real ENOSPC from a small tmpfs -----------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs mounted at tmp_path/disk (root only); skips with the reason where it cannot."""
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (to fill a real disk) needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


class Host:
    """The host end of a member's ctl link: answers every `fetch` with the bytes of `blob`."""

    def __init__(self, blob: bytes):
        self.blob = blob
        self.fetcher: Fetcher | None = None

    async def send(self, wire: dict) -> int:
        f = cf.decode_control(wire)
        self.fetcher.deliver(cf.Data(id=f.id, data=self.blob[f.offset:f.offset + f.length]))
        return 0


def test_a_full_disk_fails_the_fetch_with_a_sentence_and_leaves_no_partial_file(small_disk, tmp_path):
    import hashlib
    blob = os.urandom(200_000)  # bigger than the 64 KiB disk
    host = Host(blob)
    cache = small_disk / "cache" / "sha256"
    host.fetcher = Fetcher(host.send, cache, hf_cache_dir=tmp_path / "no-hf")

    async def main():
        return await host.fetcher.fetch_verified(file="model.safetensors", offset=0, nbytes=len(blob),
                                                 sha256=hashlib.sha256(blob).hexdigest())

    with pytest.raises(SessionError) as e:
        trio.run(main)
    assert str(e.value) == (f"Could not store 200000 bytes of the model in {cache}: No space left on device; the disk "
                            f"holding {cache} is full (or over its quota): free some space there, or start kafilad "
                            "with --state-dir on a disk with room.")
    assert list(cache.iterdir()) == []  # the partial file is gone
    small = os.urandom(1000)  # the same fetcher goes on once the bytes fit
    host.blob = small
    got, _ = trio.run(lambda: host.fetcher.fetch_verified(file="f", offset=0, nbytes=1000,
                                                          sha256=hashlib.sha256(small).hexdigest()))
    assert got == small and (cache / hashlib.sha256(small).hexdigest()).read_bytes() == small


def test_a_full_disk_never_fails_a_trace_or_loses_the_old_roster(small_disk, caplog):
    s = StateDir(small_disk / "state").ensure()
    s.save_roster({"p-good": {"public_key": GOOD_KEY, "name": "birch"}})
    fd = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT)  # fill the disk to its last byte
    try:
        while True:
            os.write(fd, b"x" * 512)
    except OSError:
        pass
    finally:
        os.close(fd)
    with pytest.raises(KafilaError, match=f"Could not write {s.roster_path}: No space left on device; the disk"):
        s.save_roster({"p-good": {"public_key": GOOD_KEY, "name": "birch"}, "p-2": {"public_key": GOOD_KEY,
                                                                                  "name": "x" * 100_000}})
    assert s.load_roster() == {"p-good": {"public_key": GOOD_KEY, "name": "birch"}}  # the old one is kept
    assert not s.roster_path.with_suffix(".tmp").exists()
    with caplog.at_level(logging.WARNING):
        trace = Trace(s.trace_path("s-1"))
        for i in range(3):
            trace.write("generation", blob="y" * 50_000)
        assert s.remember_session({"code": "kfl-x", "rendezvous": "ws://r:1", "pad": "z" * 100_000}) is False
    assert caplog.text.count("Could not write the trace") == 1  # one warning, not one per record
    assert "A restarted daemon will not come back to this session by itself" in caplog.text
