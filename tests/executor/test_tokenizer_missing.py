"""A model directory without tokenizer files is refused with a sentence, not an internal error
(a new user's report, 2026-12-01: `kafila-ctl host` said "Internal error in 'host': ValueError(...)")."""

from __future__ import annotations

import pytest

from kafilad.errors import ModelFormatError
from kafilad.executor.synth import synthesize_model
from kafilad.executor.tokenizer import load_tokenizer


def test_a_model_without_tokenizer_files_is_refused_with_a_sentence(tmp_path):
    d = synthesize_model(tmp_path / "synth", num_hidden_layers=1, hidden_size=32)
    assert load_tokenizer(d).encode("once upon a time")  # whole: it loads
    removed = [p for p in d.iterdir() if p.name.startswith(("tokenizer", "special_tokens", "vocab", "merges"))]
    assert removed
    for p in removed:
        p.unlink()
    with pytest.raises(ModelFormatError, match=rf"^{d} has no tokenizer that can be loaded \(tokenizer.json"):
        load_tokenizer(d)
