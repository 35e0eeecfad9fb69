"""The host's model files as members fetch them (DESIGN §6; proto_spec 05 §2.1).

Members fetch exactly their tensors by byte range of the host's safetensors files (plus, on the
head, the tokenizer files), and verify each against the sha256 the host put in the plan.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

#: files the head needs beside its tensors (tokenizer and generation settings).
HEAD_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt")
#: largest byte range one fetch frame may ask for.
FETCH_MAX_BYTES = 4 * 1024 * 1024


def read_range(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


class ModelFiles:
    """Byte-range access to one model directory, limited to the model's own files.

    Args:
        model_dir: the directory; info: its kafilad.modelinfo.ModelInfo.
    """

    def __init__(self, model_dir: str, info):
        self.model_dir = Path(model_dir)
        self.info = info
        self.allowed = {t.file for t in info.tensors.values()} | set(HEAD_FILES)

    def check_range(self, fname, offset, length) -> Optional[str]:
        """None when [offset, +length) of `fname` may be served, else the reason it may not."""
        if not isinstance(fname, str) or fname not in self.allowed or "/" in fname:
            return f"{fname!r} is not a file of this model"
        if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or not 0 <= length <= FETCH_MAX_BYTES:
            return f"the range [{offset!r}, +{length!r}) is not a valid range of at most {FETCH_MAX_BYTES} bytes"
        if not (self.model_dir / fname).is_file():
            return f"{fname!r} is missing on the host"
        return None

    def read(self, fname: str, offset: int, length: int) -> bytes:
        return read_range(self.model_dir / fname, offset, length)

    def tensor_table(self, start: int, end: int, head: bool) -> list[dict]:
        """The plan's tensor list for a stage [start, end) (+ head parts): places and sha256."""
        out = []
        for t in self.info.stage_tensors(start, end, head):
            data = read_range(self.model_dir / t.file, t.offset_bytes, t.nbytes)
            out.append({"name": t.name, "file": t.file, "dtype": t.dtype, "shape": list(t.shape),
                        "offset": t.offset_bytes, "nbytes": t.nbytes, "sha256": hashlib.sha256(data).hexdigest()})
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
