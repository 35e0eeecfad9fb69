"""A member's byte-range fetch of its tensors from the host, verified and cached (proto_spec 05 §2.1; DESIGN §6).

Hashing and file writes run off the trio thread (`trio.to_thread`), so a large shard never
stalls the member's links. Names come from the host's plan and are checked before any file is
touched: a cache entry is named by its sha256 (64 hex digits) and a tokenizer file by a plain
file name, so a compromised host cannot make a member write outside its cache.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Awaitable, Callable

import trio

from kafilad.errors import RemoteProtocolError, SessionError
from kafilad.proto import control as cf

#: Bytes asked per `fetch` frame (proto_spec 05 §2: at most 4 MiB).
FETCH_CHUNK_BYTES = cf.FETCH_MAX_BYTES
_SHA256 = re.compile(r"[0-9a-f]{64}")


def checked_sha256(value) -> str:
    """A plan's sha256 field, as the cache file name.

    Raises:
        RemoteProtocolError: not 64 lowercase hex digits.
    """
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise RemoteProtocolError(f"the host's plan names a tensor by {value!r}, which is not a sha256 hex digest")
    return value


def checked_file_name(value) -> str:
    """A file name from the host's plan that is safe to create inside one directory.

    Raises:
        RemoteProtocolError: empty, a path (separator), `.`/`..`, or a NUL byte.
    """
    if (not isinstance(value, str) or not value or value in (".", "..") or "/" in value or "\\" in value
            or "\x00" in value or os.sep in value or (os.altsep and os.altsep in value)):
        raise RemoteProtocolError(f"the host's plan names a file {value!r}, which is not a plain file name")
    return value


def _read_if_intact(path: Path, sha256: str):
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return data if hashlib.sha256(data).hexdigest() == sha256 else None


def _verify_and_store(path: Path, data: bytes, sha256: str) -> bool:
    if hashlib.sha256(data).hexdigest() != sha256:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return True


class Fetcher:
    """Fetches byte ranges over the ctl link and matches `data`/`fetch_error` answers by id.

    Args:
        send: awaitable sending one control frame to the host.
        cache_dir: where verified tensors are kept, one file per sha256.
    """

    def __init__(self, send: Callable[[dict], Awaitable[int]], cache_dir: Path):
        self._send = send
        self.cache_dir = Path(cache_dir)
        self._waiters: dict[int, trio.MemorySendChannel] = {}
        self._next_id = 0

    def deliver(self, frame) -> None:
        """Route a `data` or `fetch_error` frame to its waiting fetch (unknown ids are dropped)."""
        ch = self._waiters.pop(frame.id, None)
        if ch is not None:
            ch.send_nowait(frame)

    async def fetch(self, file: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of a model file, in chunks of FETCH_CHUNK_BYTES.

        Raises:
            SessionError: the host refused a range or sent the wrong number of bytes.
        """
        out = bytearray()
        while len(out) < length:
            n = min(FETCH_CHUNK_BYTES, length - len(out))
            self._next_id += 1
            fid = self._next_id
            send, recv = trio.open_memory_channel(1)
            self._waiters[fid] = send
            await self._send(cf.Fetch(id=fid, file=file, offset=offset + len(out), length=n).to_wire())
            f = await recv.receive()
            if isinstance(f, cf.FetchError):
                raise SessionError(f"The host could not serve {file}: {f.reason}.")
            if len(f.data) != n:
                raise SessionError(f"The host sent {len(f.data)} bytes of {file} where {n} were asked.")
            out += f.data
        return bytes(out)

    async def fetch_verified(self, *, file: str, offset: int, nbytes: int, sha256: str) -> tuple[bytes, bool]:
        """One tensor's or file's bytes: from the cache when present and intact, else fetched and cached.

        Returns:
            (data, True if it came from the cache).
        Raises:
            RemoteProtocolError: the plan's sha256 is not a digest.
            SessionError: fetch failures, or the bytes do not match the sha256.
        """
        path = self.cache_dir / checked_sha256(sha256)
        data = await trio.to_thread.run_sync(_read_if_intact, path, sha256)
        if data is not None:
            return data, True
        data = await self.fetch(file, offset, nbytes)
        if not await trio.to_thread.run_sync(_verify_and_store, path, data, sha256):
            raise SessionError(f"{file} [{offset}, +{nbytes}) from the host failed verification (sha256 mismatch).")
        return data, False
