"""State-directory faults in running daemons (issue 22 §6), real processes on loopback:

- a host restarted with a damaged `trusted_keys.json` restores its session (it used to fail with
  "internal error: UnicodeDecodeError…", the file unnamed, members retrying every second), keeps
  its key, and says in its log which file was moved where;
- a daemon started with a damaged `session.json` warns and runs (it used to drop it silently);
- a member whose state directory's disk fills during the shard fetch (a real 128 KiB tmpfs, root
  only) fails the join with a sentence and lives on (it used to exit "No space left on device
  (check the address and port)");
- `--state-dir` on a shared 1777 directory is refused with a sentence, the mode untouched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kafila_ctl.demo import RING_STRATEGY, LoopbackCluster, packaged_model_dir
from kafila_testing import STORIES_PROMPT, reference_tokens

pytestmark = pytest.mark.slow

DAEMON = [sys.executable, "-m", "kafilad.main"]


def wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.2)


def test_a_host_restarted_with_a_damaged_roster_restores_its_session(tmp_path):
    stories260k = packaged_model_dir()  # shipped in the package: never skipped
    with LoopbackCluster(2, root=str(tmp_path / "c")) as c:
        ref = reference_tokens(stories260k, STORIES_PROMPT, 16)
        code = c.form(str(stories260k))["code"]
        peer = c.call(0, "keys")["peer_id"]
        host = c.daemons[0]
        host.send_signal(signal.SIGTERM)
        assert host.wait(timeout=10) == 0
        roster = c.state_dir(0) / "trusted_keys.json"
        roster.write_bytes(b"\xff\xfe\x00garbage")  # a disk error's leftovers: not UTF-8
        c.daemons[0] = c.start_daemon(0)
        c.wait_daemon(0)
        st = wait_for(lambda: (s := c.call(0, "status"))["state"] == "ready" and s, 90,
                      "the restored session never became ready")
        assert st["code"] == code and c.call(0, "keys")["peer_id"] == peer  # same session, same key
        assert c.generate(STORIES_PROMPT, 16)["token_ids"] == ref
        moved = sorted(roster.parent.glob("trusted_keys.json.corrupt-*"))
        assert len(moved) == 1 and moved[0].read_bytes() == b"\xff\xfe\x00garbage"
        log = (c.state_dir(0) / "kafilad.log").read_text()
        assert f"{roster} is damaged (byte 0 is not UTF-8 text); it was moved to {moved[0]}" in log
        assert "UnicodeDecodeError" not in log and "internal error" not in log
        assert isinstance(c.call(0, "trust_list"), list)  # the roster op answers (no internal error)


def test_a_daemon_with_a_damaged_session_file_warns_and_runs(tmp_path):
    state = tmp_path / "s"
    state.mkdir(mode=0o700)
    (state / "session.json").write_bytes(b'{"role": "member", "code": ')
    err = open(tmp_path / "err.log", "wb")
    p = subprocess.Popen(DAEMON + ["--state-dir", str(state), "--http", "off"], stdout=err, stderr=err)
    try:
        from kafila_ctl.client import ControlClient
        import trio
        wait_for(lambda: (state / "kafilad.sock").exists() or p.poll() is not None, 30, "no control socket")
        assert p.poll() is None, (tmp_path / "err.log").read_text()
        st = wait_for(lambda: trio.run(lambda: ControlClient(state / "kafilad.sock").call("status")), 10, "no status")
        assert st["state"] in ("idle", None) or not st.get("session")
        moved = sorted(state.glob("session.json.corrupt-*"))
        assert len(moved) == 1 and not (state / "session.json").exists()
        log = (state / "kafilad.log").read_text()
        assert f"{state / 'session.json'} is damaged (it is not JSON" in log and f"moved to {moved[0]}" in log
        assert "join it again (kafila-ctl join CODE)" in log
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(15) == 0


def test_a_shared_state_directory_is_refused_with_a_sentence(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    r = subprocess.run(DAEMON + ["--state-dir", str(shared), "--http", "off"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"kafilad: The state directory {shared} is a shared directory (like /tmp) (mode 1777)")
    assert shared.stat().st_mode & 0o7777 == 0o1777 and not (shared / "static_key").exists()


class SmallDiskMember(LoopbackCluster):
    """Daemon 1's state directory is a 128 KiB tmpfs: its identity and log fit, the model's shards do not."""

    def __init__(self, *a, disk: Path, **kw):
        super().__init__(*a, **kw)
        self.disk = disk

    def state_dir(self, i: int) -> Path:
        return self.disk / "state" if i == 1 else super().state_dir(i)


def test_a_full_disk_during_the_shard_fetch_fails_the_join_with_a_sentence_and_the_member_lives(tmp_path):
    stories260k = packaged_model_dir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (to fill a real disk) needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k,mode=0700", "tmpfs", str(disk)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        with SmallDiskMember(2, root=str(tmp_path / "c"), disk=disk) as c:
            member = c.daemons[1]
            code = c.call(0, "host", model_dir=str(stories260k), members=2, open=True,
                          strategy=RING_STRATEGY)["code"]  # blocks on every member, not the host alone
            c.call(1, "join", code=code)  # admitted; then its stage's shards do not fit

            seen = []

            def failed_for_space():  # the member's load failure reaches the host as the member's loss reason
                st = c.call(0, "status")
                seen.append((st["state"], [(m.get("name"), m.get("blocks"), m.get("lost")) for m in st["members"]]))
                said = " ".join(str(m.get("lost")) for m in st.get("members") or [] if m.get("name") == "m1")
                return "No space left on device" in said and said

            said = wait_for(failed_for_space, 90, lambda: f"the member never said its disk is full: {seen[-5:]}")
            cache = c.disk / "state" / "cache" / "sha256"
            assert f"it failed to load its stage: Could not store " in said and f"bytes of the model in {cache}: No " \
                   f"space left on device; the disk holding {cache} is full (or over its quota): free some space " \
                   "there, or start kafilad with --state-dir on a disk with room." in said, said
            assert "OSError" not in said and "Errno" not in said, said
            assert member.poll() is None  # the daemon lives
            assert c.call(1, "keys")["peer_id"]  # and answers
            log = (c.root / "m1.log").read_text(errors="replace")
            assert "check the address and port" not in log
            assert not list((c.disk / "state" / "cache" / "sha256").glob("*.part"))
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
