"""The daemon's log file in its state directory (issue 10): STATE_DIR/kafilad.log, rotated, besides stderr."""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import time

from kafilad.main import LOG_FILE_BACKUPS, LOG_FILE_BYTES, _log_to_file
from kafilad.node.session.statedir import StateDir

DAEMON = [sys.executable, "-m", "kafilad.main"]


def test_a_started_daemon_logs_to_its_state_dir_and_to_stderr(tmp_path):
    state = tmp_path / "state"
    err_path = tmp_path / "stderr.log"
    with open(err_path, "wb") as err:
        p = subprocess.Popen(DAEMON + ["--state-dir", str(state), "--name", "logger", "--http", "off"],
                             stdout=err, stderr=err)
    try:
        sock = state / "kafilad.sock"
        deadline = time.monotonic() + 20
        while not sock.exists():
            assert p.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.05)
        log_path = StateDir(state).log_path
        assert log_path == state / "kafilad.log"
        deadline = time.monotonic() + 10
        while "listening on" not in (log_path.read_text() if log_path.exists() else ""):
            assert time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.05)
        line = next(ln for ln in log_path.read_text().splitlines() if "listening on" in ln)
        assert f"kafilad logger (peer " in line and str(sock) in line and " INFO " in line
        assert stat.S_IMODE(os.stat(log_path).st_mode) == 0o600
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(15) == 0
    assert "listening on" in err_path.read_text()  # stderr logging is kept as it was


def test_the_log_file_rotates_and_keeps_a_bounded_number_of_old_files(tmp_path):
    assert LOG_FILE_BYTES == 5 * 1024 * 1024 and LOG_FILE_BACKUPS == 3
    path = tmp_path / "kafilad.log"
    handler = _log_to_file(path, max_bytes=1000, backups=2)
    logger = logging.getLogger("kafilad.test_rotation")
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        for i in range(100):
            logger.info("record %03d %s", i, "x" * 60)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
        logger.setLevel(old_level)
    names = sorted(f.name for f in tmp_path.iterdir())
    assert names == ["kafilad.log", "kafilad.log.1", "kafilad.log.2"]
    for name in names:
        assert (tmp_path / name).stat().st_size <= 1000
    assert "record 099" in path.read_text()
    assert "record 000" not in "".join((tmp_path / n).read_text() for n in names)
