"""A prompt's lower bound on tokens, found without tokenizing it (kafilad/executor/tokenizer.py
`Tokenizer.min_tokens`): never above the real count, for the packaged stories260K (SentencePiece
BPE with byte fallback) and the synthesised byte-level BPE, on text made to defeat it (whitespace
runs, special-token text, composed and decomposed Unicode, emoji); and no bound at all for a
tokenizer pipeline that drops or fuses characters.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from kafila_ctl.demo import packaged_model_dir
from kafilad.executor.synth import synthesize_model
from kafilad.executor.tokenizer import _keeps_every_character, load_tokenizer

HARD_TEXTS = ["Once upon a time", " " * 1000, "\n\n\t  x" * 300, "</s><s><unk>" * 100, "é" * 200,
              "e\u0301" * 200, "\u1100\u1161\u11a8" * 100, "日本語のテキスト" * 50, "🙂👍🏽" * 80, "\x00\x01" * 100,
              "the cat sat on the mat and the dog ran far away. " * 200]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    synth = synthesize_model(tmp_path_factory.mktemp("synth") / "s", arch="llama", seed=7, num_hidden_layers=2,
                             hidden_size=64)
    return {"stories260K": load_tokenizer(packaged_model_dir()), "synth": load_tokenizer(synth)}


@pytest.mark.parametrize("name,longest", [("stories260K", 7), ("synth", 4)])
def test_the_bound_never_exceeds_the_count(tokenizers, name, longest):
    tok = tokenizers[name]
    assert tok.max_token_chars == longest  # '▁little' / '</s>'
    for text in HARD_TEXTS:
        bound, count = tok.min_tokens(text), tok.count_tokens(text)
        assert 0 < bound <= count, (name, text[:20], bound, count)
    text = "the cat sat on the mat and the dog ran far away. " * 80000  # the trial's 3.9 MB prompt
    assert tok.min_tokens(text) == -(-len(text) // longest)


def pipeline(normalizer=None, pre_tokenizer=None, model=None) -> RustTokenizer:
    t = RustTokenizer(model or models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    if normalizer is not None:
        t.normalizer = normalizer
    if pre_tokenizer is not None:
        t.pre_tokenizer = pre_tokenizer
    return t


def test_pipelines_that_drop_or_fuse_characters_get_no_bound():
    assert _keeps_every_character(pipeline(), False) == ()
    assert _keeps_every_character(pipeline(pre_tokenizer=pre_tokenizers.ByteLevel()), False) == ()
    assert _keeps_every_character(pipeline(normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])),
                                  False) == ("NFC",)  # bounded only on text already composed
    dropping = [pipeline(pre_tokenizer=pre_tokenizers.WhitespaceSplit()),  # a run of spaces is no token
                pipeline(pre_tokenizer=pre_tokenizers.Split(" ", "removed")),
                pipeline(normalizers.Strip()), pipeline(normalizers.StripAccents()),
                pipeline(normalizers.Replace("ab", "")),
                pipeline(model=models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]")),  # a word: one [UNK]
                pipeline(model=models.BPE(vocab={"<unk>": 0, "a": 1}, merges=[], unk_token="<unk>", fuse_unk=True))]
    assert [_keeps_every_character(t, False) for t in dropping] == [None] * len(dropping)
    # fused unknowns are harmless when every byte has a fallback token
    fused = pipeline(model=models.BPE(vocab={"<unk>": 0}, merges=[], unk_token="<unk>", fuse_unk=True,
                                      byte_fallback=True))
    assert _keeps_every_character(fused, True) == () and _keeps_every_character(fused, False) is None


def test_a_composing_tokenizer_bounds_only_composed_text():
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    from kafilad.executor.tokenizer import Tokenizer
    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    vocab.update({"\uac01": len(vocab), "ab": len(vocab) + 1})  # '각', a Hangul syllable
    rust = pipeline(normalizers.NFC(), model=models.BPE(vocab=vocab, merges=[("a", "b")]))
    tok = Tokenizer(TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=rust)))
    assert tok.max_token_chars == 2 and tok.min_tokens("abab") == tok.count_tokens("abab") == 2
    decomposed = "\u1100\u1161\u11a8" * 20  # 60 characters, 20 tokens (< 60 / 2): NFC makes each jamo triple '각'
    assert tok.count_tokens(decomposed) == 20 and tok.min_tokens(decomposed) == 0
    assert tok.min_tokens("\uac01" * 20) == 10
