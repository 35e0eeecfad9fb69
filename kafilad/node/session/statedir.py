"""The daemon's state directory: static key, trusted-key roster, cache, control socket, traces.

Layout (all files private to the user):

```
DIR/
  kafilad.sock        control socket (mode 0600), DESIGN §7
  static_key          X25519 private key, 32 raw bytes (mode 0600), DESIGN §4 "Identity"
  trusted_keys.json   the host's roster of admitted public keys {peer_id: {"public_key": hex, "name": str}}
  cache/sha256/<hex>  verified tensor bytes fetched from hosts, by content hash (DESIGN §6)
  traces/<session_id>.jsonl   session traces (DESIGN §8)
  kafilad.log         the daemon's log (kafilad.log.1 .. .3 after rotation at 5 MiB), besides stderr
  session.json        the session to restore after a restart (host or member), DESIGN §3
```
Faults (issue 22 §6) never end the daemon and never cost it its key: a `trusted_keys.json` or
`session.json` that cannot be read as what it should be (bytes that are not UTF-8, not JSON, or not
the expected shape) is moved aside to `FILE.corrupt-YYYYmmddTHHMMSSZ` with a warning that names
both and says what to do, and the daemon goes on as if it were absent (a roster keeps the entries
it could read). The directory itself must be the user's own and not shared: one owned by another
user, or writable by group or others (a shared 1777 /tmp-like directory), is refused with a
sentence rather than chmodded; a directory of the user's own that is merely readable by others is
made 0700 as before.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Optional

import platformdirs

from kafilad.errors import KafilaError
from kafilad.proto.noise import generate_keypair, public_key

KEY_BYTES = 32

log = logging.getLogger("kafilad.state")


#: environment variable naming the state directory when --state-dir is not given (both tools)
STATE_DIR_ENV = "KAFILA_STATE_DIR"


def default_state_dir() -> Path:
    """$KAFILA_STATE_DIR when set, else the platform's user state directory for kafilad
    (e.g. ~/.local/state/kafila on Linux)."""
    if os.environ.get(STATE_DIR_ENV, "").strip():
        return Path(os.environ[STATE_DIR_ENV].strip()).expanduser()
    return Path(platformdirs.user_state_dir("kafila", appauthor=False))


def default_name() -> str:
    """The member name used when none is given: this machine's host name."""
    return socket.gethostname().split(".")[0] or "kafila"


class StateDir:
    """Accessors for one daemon's state directory (created 0700 on first use)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else default_state_dir()

    def ensure(self) -> "StateDir":
        """Create the directory (0700) and its subdirectories, or check an existing one (module docstring).

        Raises:
            KafilaError: the directory is owned by another user, or writable by group or others.
            OSError: it cannot be created (kafilad/main.py prepare_state_dir words it).
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.path.mkdir(mode=0o700)
        except FileExistsError:
            pass
        check_private_dir(self.path)
        os.chmod(self.path, 0o700)
        (self.path / "cache" / "sha256").mkdir(parents=True, exist_ok=True)
        (self.path / "traces").mkdir(parents=True, exist_ok=True)
        return self

    @property
    def socket_path(self) -> Path:
        return self.path / "kafilad.sock"

    @property
    def key_path(self) -> Path:
        return self.path / "static_key"

    @property
    def roster_path(self) -> Path:
        return self.path / "trusted_keys.json"

    @property
    def cache_dir(self) -> Path:
        return self.path / "cache" / "sha256"

    @property
    def log_path(self) -> Path:
        """The daemon's log file (rotated by kafilad/main.py: LOG_FILE_BYTES x LOG_FILE_BACKUPS)."""
        return self.path / "kafilad.log"

    def trace_path(self, session_id: str) -> Path:
        return self.path / "traces" / f"{session_id}.jsonl"

    def load_or_create_static_key(self) -> tuple[bytes, bytes]:
        """Return (private, public); create a fresh key (mode 0600) on first start.

        Raises:
            KafilaError: the key file exists but is not 32 bytes, or is readable by others.
        """
        p = self.key_path
        if p.exists():
            mode = p.stat().st_mode & 0o777
            if mode & 0o077:
                raise KafilaError(f"{p} is readable by other users (mode {mode:o}); run `chmod 600 {p}`.")
            priv = p.read_bytes()
            if len(priv) != KEY_BYTES:
                raise KafilaError(f"{p} is not a 32-byte X25519 key; move it away to make a new identity.")
            return priv, public_key(priv)
        priv, pub = generate_keypair()
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(priv)
        return priv, pub

    def load_roster(self) -> dict[str, dict]:
        """Trusted keys admitted earlier: {peer_id: {"public_key": hex, "name": str}}.

        A file that cannot be read as such is moved aside with a warning (module docstring); the
        entries that could be read are kept.

        Raises:
            KafilaError: the file cannot be read at all (permissions, I/O error), naming it.
        """
        path = self.roster_path
        doc = self._read_json(path)
        if doc is None:
            return {}
        if isinstance(doc, Exception):
            self._set_aside(path, doc, "The keys admitted before (kafila-ctl admit) are forgotten: members that "
                                       "join again wait for `kafila-ctl admit` once more")
            return {}
        if not isinstance(doc, dict):
            self._set_aside(path, ValueError(f"it holds a JSON {type(doc).__name__}, not an object"),
                            "The keys admitted before (kafila-ctl admit) are forgotten: members that join again "
                            "wait for `kafila-ctl admit` once more")
            return {}
        good = {pid: r for pid, r in doc.items() if _roster_entry_ok(pid, r)}
        if len(good) != len(doc):
            self._set_aside(path, ValueError(f"{len(doc) - len(good)} of its {len(doc)} entries are not "
                                             "{\"public_key\": 64 hex digits, \"name\": text}"),
                            f"The {len(good)} readable entries are kept; the others' members wait for "
                            "`kafila-ctl admit` when they join again")
            try:
                self.save_roster(good)
            except KafilaError as e:
                log.warning("%s", e)
        return good

    def save_roster(self, roster: dict[str, dict]) -> None:
        """Write the roster atomically, mode 0600.

        Raises:
            KafilaError: it cannot be written (a full disk...), naming the file; the old one is kept.
        """
        self._write_json(self.roster_path, roster, indent=1, sort_keys=True)

    def _write_json(self, path: Path, doc, **kw) -> None:
        tmp = path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, **kw)
            os.replace(tmp, path)
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise KafilaError(f"Could not write {path}: {e.strerror or e}; "
                              f"{disk_advice(e, self.path)}") from None

    @staticmethod
    def _read_json(path: Path):
        """The JSON document in `path`; None when absent; the decoding error (returned, not raised)
        when its bytes are not UTF-8 JSON.

        Raises:
            KafilaError: the file exists but cannot be read (permissions, I/O), naming it.
        """
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise KafilaError(f"Could not read {path}: {e.strerror or e}; make it readable by this user "
                              f"(chmod 600 {path}) or move it away.") from None
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            return e

    def _set_aside(self, path: Path, why: Exception, consequence: str) -> Optional[Path]:
        """Move a damaged `path` to PATH.corrupt-TIMESTAMP and log a warning naming both, `why` and
        `consequence`; the moved file's path (None, and the warning says so, when it cannot move)."""
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        n = 1
        while aside.exists():
            n += 1
            aside = aside.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{n}")
        what = _why_damaged(why)
        try:
            os.replace(path, aside)
        except OSError as e:
            log.warning("%s is damaged (%s) and could not be moved aside (%s); %s. Move it away or delete it.",
                        path, what, e.strerror or e, consequence)
            return None
        log.warning("%s is damaged (%s); it was moved to %s and the daemon goes on without it. %s. If you can "
                    "repair it, stop kafilad and move it back.", path, what, aside, consequence)
        return aside

    @property
    def session_path(self) -> Path:
        return self.path / "session.json"

    def remember_session(self, record: dict) -> bool:
        """Keep the session this daemon is a member of ({"code", "rendezvous"}), so a restarted daemon
        rejoins it by itself (DESIGN §3, healing); written atomically, mode 0600.

        Returns:
            False when it could not be written (a full disk...): a warning, never a failed session.
        """
        try:
            self._write_json(self.session_path, record)
        except KafilaError as e:
            log.warning("%s A restarted daemon will not come back to this session by itself.", e)
            return False
        return True

    def remembered_session(self) -> dict | None:
        """The remembered session record, or None: absent, or damaged (moved aside with a warning,
        module docstring; never a crash)."""
        try:
            record = self._read_json(self.session_path)
        except KafilaError as e:
            log.warning("%s The daemon does not restore its session meanwhile.", e)
            return None
        if record is None:
            return None
        consequence = ("The daemon does not restore the session it was in; host it again (kafila-ctl host) or "
                       "join it again (kafila-ctl join CODE)")
        if isinstance(record, Exception):
            self._set_aside(self.session_path, record, consequence)
            return None
        if not isinstance(record, dict) or not isinstance(record.get("code"), str) \
                or not isinstance(record.get("rendezvous"), str):
            self._set_aside(self.session_path, ValueError("it is not an object with a \"code\" and a \"rendezvous\""),
                            consequence)
            return None
        return record

    def forget_session(self) -> None:
        try:
            self.session_path.unlink()
        except FileNotFoundError:
            pass


def _roster_entry_ok(pid, entry) -> bool:
    """Whether a roster entry reads as {"public_key": 64 hex digits, "name": text}."""
    if not isinstance(pid, str) or not isinstance(entry, dict) or not isinstance(entry.get("name", ""), str):
        return False
    key = entry.get("public_key")
    try:
        return isinstance(key, str) and len(bytes.fromhex(key)) == KEY_BYTES
    except ValueError:
        return False


def _why_damaged(e: Exception) -> str:
    """What is wrong with a file, as a phrase (no Python repr)."""
    if isinstance(e, UnicodeDecodeError):
        return f"byte {e.start} is not UTF-8 text"
    if isinstance(e, json.JSONDecodeError):
        return f"it is not JSON: {e.msg} at line {e.lineno}, column {e.colno}"
    if isinstance(e, RecursionError):
        return "it is not JSON this daemon can read: nested too deeply"
    return str(e)


def disk_advice(e: OSError, where: Path) -> str:
    """What to do about an OSError writing under `where`, as the end of a sentence."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk holding {where} is full (or over its quota): free some space there, or start kafilad with " \
               "--state-dir on a disk with room."
    if e.errno == errno.EROFS:
        return f"{where} is on a read-only file system: start kafilad with --state-dir on a writable one."
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"this user may not write there: fix the permissions of {where} (it should be yours, mode 0700)."
    return f"check the disk holding {where}."


def check_private_dir(path: Path) -> None:
    """Refuse a state directory another user owns or may write to (module docstring).

    Raises:
        KafilaError: a sentence naming the directory and what to do.
        NotADirectoryError: `path` is a file.
    """
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):  # an OSError: kafilad/main.py words it ("is a file, not a directory")
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    uid = os.geteuid() if hasattr(os, "geteuid") else st.st_uid
    fix = ("start kafilad with --state-dir naming a directory of your own, e.g. ~/.kafila (it is created when "
           "missing, mode 0700)")
    if st.st_uid != uid:
        raise KafilaError(f"The state directory {path} belongs to another user (uid {st.st_uid}), who could read this "
                          f"daemon's key or plant files in it; {fix}.")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        shared = "a shared directory (like /tmp)" if mode & stat.S_ISVTX or mode & 0o002 else "writable by its group"
        raise KafilaError(f"The state directory {path} is {shared} (mode {mode:o}): other users could replace this "
                          f"daemon's files in it, so it is not used; {fix}, or make it private yourself "
                          f"(chmod 700 {path}) if it is yours alone.")
