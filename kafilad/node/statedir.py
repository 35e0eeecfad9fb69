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
```
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import platformdirs

from kafilad.errors import KafilaError
from kafilad.proto.noise import generate_keypair, public_key

KEY_BYTES = 32


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
        self.path.mkdir(parents=True, exist_ok=True)
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
        """Trusted keys admitted earlier: {peer_id: {"public_key": hex, "name": str}}."""
        try:
            return json.loads(self.roster_path.read_text())
        except FileNotFoundError:
            return {}
        except json.JSONDecodeError as e:
            raise KafilaError(f"{self.roster_path} is not valid JSON ({e}); fix or remove it.") from e

    def save_roster(self, roster: dict[str, dict]) -> None:
        tmp = self.roster_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(roster, f, indent=1, sort_keys=True)
        os.replace(tmp, self.roster_path)

    @property
    def session_path(self) -> Path:
        return self.path / "session.json"

    def remember_session(self, record: dict) -> None:
        """Keep the session this daemon is a member of ({"code", "rendezvous"}), so a restarted daemon
        rejoins it by itself (DESIGN §3, healing); written atomically, mode 0600."""
        tmp = self.session_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.session_path)

    def remembered_session(self) -> dict | None:
        """The remembered session record, or None (absent or unreadable: a warning, never a crash)."""
        try:
            record = json.loads(self.session_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        if not isinstance(record, dict) or not isinstance(record.get("code"), str) \
                or not isinstance(record.get("rendezvous"), str):
            return None
        return record

    def forget_session(self) -> None:
        try:
            self.session_path.unlink()
        except FileNotFoundError:
            pass
