"""A member's byte-range fetch of its tensors from the host, verified and cached (proto_spec 05 §2.1; DESIGN §6).

Hashing and file writes run off the trio thread (`trio.to_thread`), so a large shard never
stalls the member's links. Names come from the host's plan and are checked before any file is
touched: a cache entry is named by its sha256 (64 hex digits) and a tokenizer file by a plain
file name, so a compromised host cannot make a member write outside its cache.

Before asking the host, a member looks in its own cache, then in its Hugging Face hub cache
(`HF_HUB_CACHE`; LFS files are kept as `models--ORG--NAME/blobs/<sha256 of the whole file>`): when
the plan names the tensor's whole-file sha256 and a blob of that name exists, the tensor's byte
range is read from it and checked against the tensor's own sha256; only a missing blob or a
mismatch sends the fetch to the host.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Awaitable, Callable, Optional

import trio

from kafilad.errors import RemoteProtocolError, SessionError, collapse_groups
from kafilad.modelref import hub_cache_dir
from kafilad.proto import control as cf

#: Bytes asked per `fetch` frame (proto_spec 05 §2: at most 4 MiB).
FETCH_CHUNK_BYTES = cf.FETCH_MAX_BYTES
#: `fetch` frames a member keeps unanswered at once (proto_spec 05 §2.1 allows
#: `cf.FETCHES_IN_FLIGHT_MAX`): enough to keep a link busy across its round trip (4 x 4 MiB covers
#: 130 ms at 1 Gbit/s) without holding more than 16 MiB of answers in flight.
FETCH_WINDOW = 4
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: where `fetch_verified`'s bytes came from.
FROM_CACHE, FROM_HF_CACHE, FROM_HOST = "cache", "hf_cache", "host"


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


def _read_from_hf_blob(hf_cache: Path, file_sha256: str, offset: int, nbytes: int, sha256: str):
    """The range [offset, +nbytes) of any HF cache blob named `file_sha256`, if it hashes to `sha256`."""
    try:
        blobs = sorted(hf_cache.glob(f"*/blobs/{file_sha256}"))
    except OSError:
        return None
    for blob in blobs:
        try:
            with open(blob, "rb") as f:
                f.seek(offset)
                data = f.read(nbytes)
        except OSError:
            continue
        if len(data) == nbytes and hashlib.sha256(data).hexdigest() == sha256:
            return data
    return None


def _verify_and_store(path: Path, data: bytes, sha256: str) -> bool:
    """Check `data` against `sha256` and keep it in the cache at `path`; False on a mismatch.

    Raises:
        SessionError: it cannot be written (a full disk, a read-only or foreign directory), with a
            sentence naming the cache and what to do; no partial file is left behind.
    """
    if hashlib.sha256(data).hexdigest() != sha256:
        return False
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a temporary file of its own: two tensors with the same bytes (e.g. two norms of ones) may
        # be stored at once, and a shared ".part" name would lose one writer's rename
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name + ".", suffix=".part",
                                         delete=False) as tmp:
            tmp_name = tmp.name
            tmp.write(data)
        os.replace(tmp_name, path)
    except OSError as e:
        if tmp_name is not None:
            try:
                os.unlink(tmp_name)
            except OSError:
                pass
        raise store_error(e, path.parent, len(data)) from None
    return True


def store_error(e: OSError, where: Path, nbytes: int) -> SessionError:
    """The sentence of a failed write of `nbytes` model bytes under `where` (the cache, the head's
    tokenizer directory)."""
    from kafilad.node.session.statedir import disk_advice
    return SessionError(f"Could not store {nbytes} bytes of the model in {where}: {e.strerror or e}; "
                        f"{disk_advice(e, where)}")


class Fetcher:
    """Fetches byte ranges over the ctl link and matches `data`/`fetch_error` answers by id.

    Args:
        send: awaitable sending one control frame to the host.
        cache_dir: where verified tensors are kept, one file per sha256.
        hf_cache_dir: the Hugging Face hub cache to read whole-file blobs from (None: the
            environment's, kafilad.modelref.hub_cache_dir()).
    """

    def __init__(self, send: Callable[[dict], Awaitable[int]], cache_dir: Path, hf_cache_dir: Optional[Path] = None):
        self._send = send
        self.cache_dir = Path(cache_dir)
        self.hf_cache_dir = Path(hf_cache_dir) if hf_cache_dir is not None else hub_cache_dir()
        self._waiters: dict[int, trio.MemorySendChannel] = {}
        self._next_id = 0
        self._window = trio.Semaphore(FETCH_WINDOW)

    def deliver(self, frame) -> None:
        """Route a `data` or `fetch_error` frame to its waiting fetch (unknown ids are dropped)."""
        ch = self._waiters.pop(frame.id, None)
        if ch is not None:
            ch.send_nowait(frame)

    async def fetch(self, file: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of a model file, in chunks of FETCH_CHUNK_BYTES, up to
        FETCH_WINDOW of them unanswered at once (shared by every fetch of this Fetcher).

        Raises:
            SessionError: the host refused a range or sent the wrong number of bytes.
        """
        starts = range(0, length, FETCH_CHUNK_BYTES)
        parts: list[bytes] = [b""] * len(starts)

        async def one(i: int, start: int) -> None:
            n = min(FETCH_CHUNK_BYTES, length - start)
            async with self._window:
                self._next_id += 1
                fid = self._next_id
                send, recv = trio.open_memory_channel(1)
                self._waiters[fid] = send
                try:
                    await self._send(cf.Fetch(id=fid, file=file, offset=offset + start, length=n).to_wire())
                    f = await recv.receive()
                finally:
                    self._waiters.pop(fid, None)
            if isinstance(f, cf.FetchError):
                raise SessionError(f"The host could not serve {file}: {f.reason}.")
            if len(f.data) != n:
                raise SessionError(f"The host sent {len(f.data)} bytes of {file} where {n} were asked.")
            parts[i] = f.data

        with collapse_groups():
            async with trio.open_nursery() as nursery:
                for i, start in enumerate(starts):
                    nursery.start_soon(one, i, start)
        return b"".join(parts)

    def looks_cached(self, *, sha256: str, file_sha256: Optional[str] = None) -> bool:
        """Whether `fetch_verified` will likely read these bytes from a cache rather than the host: a
        cache entry of that name, or an HF cache blob of the whole file, exists (not yet verified:
        for the progress a member shows before it reads them).

        Raises:
            RemoteProtocolError: the plan's sha256 or file_sha256 is not a digest.
        """
        if (self.cache_dir / checked_sha256(sha256)).is_file():
            return True
        if file_sha256 is None:
            return False
        try:
            return any(self.hf_cache_dir.glob(f"*/blobs/{checked_sha256(file_sha256)}"))
        except OSError:
            return False

    async def fetch_verified(self, *, file: str, offset: int, nbytes: int, sha256: str,
                             file_sha256: Optional[str] = None) -> tuple[bytes, str]:
        """One tensor's or file's bytes: from the cache, else the HF cache's blob of the whole file,
        else fetched from the host and cached.

        Args:
            file_sha256: the sha256 of the whole file holding the range (the HF blob's name), if known.
        Returns:
            (data, where it came from: FROM_CACHE, FROM_HF_CACHE or FROM_HOST).
        Raises:
            RemoteProtocolError: the plan's sha256 or file_sha256 is not a digest.
            SessionError: fetch failures, the bytes do not match the sha256, or they cannot be
                cached (a full disk: `store_error`'s sentence).
        """
        path = self.cache_dir / checked_sha256(sha256)
        data = await trio.to_thread.run_sync(_read_if_intact, path, sha256)
        if data is not None:
            return data, FROM_CACHE
        if file_sha256 is not None:
            data = await trio.to_thread.run_sync(_read_from_hf_blob, self.hf_cache_dir, checked_sha256(file_sha256),
                                                 offset, nbytes, sha256)
            if data is not None:
                return data, FROM_HF_CACHE
        data = await self.fetch(file, offset, nbytes)
        if not await trio.to_thread.run_sync(_verify_and_store, path, data, sha256):
            raise SessionError(f"{file} [{offset}, +{nbytes}) from the host failed verification (sha256 mismatch).")
        return data, FROM_HOST
