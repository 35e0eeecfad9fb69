"""The host's model files as members fetch them (DESIGN §6; proto_spec 05 §2.1).

Members fetch exactly their tensors by byte range of the host's safetensors files (plus, on the
head, the tokenizer files), and verify each against the sha256 the host put in the plan. Each
tensor row also names its whole file's sha256 (`file_sha256`), the name Hugging Face's cache gives
the file's blob, so a member that already holds the file reads the tensor from it instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Optional

#: files the head needs beside its tensors (tokenizer and generation settings).
HEAD_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt")
#: largest byte range one fetch frame may ask for.
FETCH_MAX_BYTES = 4 * 1024 * 1024
#: the host's record of whole-file sha256s, in its state dir, keyed by (path, size, mtime).
FILE_SHA256_CACHE = "file_sha256.json"
_HASH_CHUNK_BYTES = 8 * 1024 * 1024


def read_range(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def check_file_range(model_dir: Path, allowed: set, fname, offset, length, what: str) -> Optional[str]:
    """None when [offset, +length) of `fname` may be served from `model_dir` (a name in `allowed`,
    the range inside the file, at most FETCH_MAX_BYTES; proto_spec 05 §2.1), else the reason it may
    not, `what` naming the model ("this model", "the draft model"). Never raises: every argument but
    the first two comes from a member's `fetch` frame."""
    if not isinstance(fname, str) or fname not in allowed or "/" in fname:
        return f"{fname!r} is not a file of {what}"
    if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or not 0 <= length <= FETCH_MAX_BYTES:
        return f"the range [{offset!r}, +{length!r}) is not a valid range of at most {FETCH_MAX_BYTES} bytes"
    path = model_dir / fname
    if not path.is_file():
        return f"{fname!r} is missing on the host"
    size = path.stat().st_size
    if offset + length > size:
        return f"the range [{offset}, +{length}) is past the end of {fname!r} ({size} bytes)"
    return None


def hash_file(path: Path) -> str:
    """The sha256 hex digest of a whole file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


class FileHashes:
    """Whole-file sha256s, computed once per (path, size, mtime) and kept in a JSON file.

    Blocking (hashes and file I/O): call it off the trio thread.

    Args:
        record: the JSON file (None: remembered in memory only).
    """

    def __init__(self, record: Optional[Path] = None):
        self.record = Path(record) if record is not None else None
        self._lock = threading.Lock()
        self._known: Optional[dict] = None

    def _load(self) -> dict:
        if self._known is None:
            self._known = {}
            if self.record is not None:
                try:
                    loaded = json.loads(self.record.read_text())
                    self._known = loaded if isinstance(loaded, dict) else {}
                except (OSError, ValueError):
                    pass
        return self._known

    def sha256(self, path: Path) -> str:
        """The file's sha256: remembered while its size and mtime are unchanged, else hashed now."""
        path = Path(path).resolve()
        st = path.stat()
        key = [st.st_size, st.st_mtime_ns]
        with self._lock:
            entry = self._load().get(str(path))
            if isinstance(entry, dict) and entry.get("key") == key and isinstance(entry.get("sha256"), str):
                return entry["sha256"]
        digest = hash_file(path)
        with self._lock:
            known = self._load()
            known[str(path)] = {"key": key, "sha256": digest}
            if self.record is not None:
                try:
                    tmp = self.record.with_name(self.record.name + ".part")
                    tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
                    os.replace(tmp, self.record)
                except OSError:
                    pass  # a record that cannot be written only costs a rehash next time
        return digest


class ModelFiles:
    """Byte-range access to one model directory, limited to the model's own files.

    Args:
        model_dir: the directory; info: its kafilad.modelinfo.ModelInfo.
        state_dir: the host's state dir, where whole-file sha256s are remembered (None: in memory).
    """

    def __init__(self, model_dir: str, info, state_dir: Optional[Path] = None):
        self.model_dir = Path(model_dir)
        self.info = info
        self.allowed = {t.file for t in info.tensors.values()} | set(HEAD_FILES)
        self.file_hashes = FileHashes(Path(state_dir) / FILE_SHA256_CACHE if state_dir is not None else None)

    def check_range(self, fname, offset, length) -> Optional[str]:
        """None when [offset, +length) of `fname` may be served (a file of the model, the range inside
        it, at most FETCH_MAX_BYTES; proto_spec 05 §2.1), else the reason it may not. Never raises:
        every argument comes from a member's `fetch` frame."""
        return check_file_range(self.model_dir, self.allowed, fname, offset, length, "this model")

    def read(self, fname: str, offset: int, length: int) -> bytes:
        return read_range(self.model_dir / fname, offset, length)

    def tensor_table(self, start: int, end: int, head: bool) -> list[dict]:
        """The plan's tensor list for a stage [start, end) (+ head parts): places, sha256 and file_sha256.

        Blocking (reads and hashes): call it off the trio thread.
        """
        out = []
        file_sha: dict[str, str] = {}
        for t in self.info.stage_tensors(start, end, head):
            if t.file not in file_sha:
                file_sha[t.file] = self.file_hashes.sha256(self.model_dir / t.file)
            data = read_range(self.model_dir / t.file, t.offset_bytes, t.nbytes)
            out.append({"name": t.name, "file": t.file, "dtype": t.dtype, "shape": list(t.shape),
                        "offset": t.offset_bytes, "nbytes": t.nbytes, "sha256": hashlib.sha256(data).hexdigest(),
                        "file_sha256": file_sha[t.file]})
        return out

    def file_table(self) -> list[dict]:
        """The head's extra files (tokenizer etc.) present in the directory, with sha256."""
        out = []
        for name in HEAD_FILES:
            p = self.model_dir / name
            if p.is_file():
                data = p.read_bytes()
                out.append({"name": name, "nbytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        return out


#: the prefix of a draft model's file names in `fetch` frames (proto_spec 05 §2.1): "draft/config.json"
DRAFT_PREFIX = "draft/"


class DraftFiles:
    """The host's draft model (`host --draft-model`) as a member head fetches it whole (issue 24
    item 1; proto_spec 05 §2 `plan` `draft_files`): its safetensors weights, their index, its
    config and tokenizer files, no other file of the directory.

    Args:
        model_dir: the draft model's directory.
        state_dir: the host's state dir, where whole-file sha256s are remembered (None: in memory).
    """

    def __init__(self, model_dir: str, state_dir: Optional[Path] = None):
        self.model_dir = Path(model_dir)
        self.allowed = {p.name for p in self.model_dir.iterdir() if p.is_file() and (
            p.name in HEAD_FILES or p.name.endswith(".safetensors") or p.name == "model.safetensors.index.json")}
        self.file_hashes = FileHashes(Path(state_dir) / FILE_SHA256_CACHE if state_dir is not None else None)

    def check_range(self, fname, offset, length) -> Optional[str]:
        """As `ModelFiles.check_range`, for a name without DRAFT_PREFIX. Never raises."""
        return check_file_range(self.model_dir, self.allowed, fname, offset, length, "the draft model")

    def read(self, fname: str, offset: int, length: int) -> bytes:
        return read_range(self.model_dir / fname, offset, length)

    def file_table(self) -> list[dict]:
        """Every file a member head needs to load the draft model: [{name, nbytes, sha256}] (names
        without DRAFT_PREFIX), sorted by name. Blocking (hashes): call it off the trio thread."""
        out = []
        for name in sorted(self.allowed):
            p = self.model_dir / name
            out.append({"name": name, "nbytes": p.stat().st_size, "sha256": self.file_hashes.sha256(p)})
        return out
