"""Tokenizers for serving: every end-of-sequence id the model declares, and text that is the decode.

`load_tokenizer` wraps mlx-lm's `TokenizerWrapper` (mlx_lm/tokenizer_utils.py) with two fixes
(issue 10 "Generation correctness first"):

* End-of-sequence ids. `mlx_lm.load` passes `eos_token_id` of config.json / generation_config.json
  (an int or a list: chat models end turns with ids such as Llama 3's `<|eot_id|>`) to the
  tokenizer; `mlx_lm.utils.load_tokenizer` alone does not. Here the set is the union of
  config.json's, generation_config.json's and the tokenizer's own `eos_token`.
* Streamed text. mlx-lm's streaming detokenizers drop the first space of a continuation (the SPM
  and BPE ones trim a leading space because they do not know a prompt came before) and the BPE one
  turns byte 0x00 into "Ā" (its byte table lookup treats the byte value 0 as "absent").
  `ContinuationDetokenizer` streams exactly

      decode(prompt_ids + generated_ids)[len(decode(prompt_ids)):]

  (`decode` with special tokens skipped: `<s>` or `<unk>` sampled mid-text is not returned text)

  i.e. the generated text as it continues the prompt, computed with the tokenizer's own `decode`
  over a short window of context, so each token costs O(CONTEXT_TOKENS + COMMIT_TOKENS).

Window argument: a decoder (byte-level, SentencePiece byte fallback + Strip, WordPiece) is local:
the decode of `ctx + pending` begins with the decode of `ctx` whenever `decode(ctx)` does not end
inside something a later token may still change, which is exactly when this module commits. Such
text is held back until the next token or `finalize`:
  * an incomplete UTF-8 character (U+FFFD at the end);
  * a trailing run of byte-fallback tokens (`<0xNN>`): the `tokenizers` ByteFallback decoder turns
    a whole run into one U+FFFD per byte when the run is not valid UTF-8, so a later byte can
    rewrite the run (decoders/byte_fallback.rs);
  * with `clean_up_tokenization_spaces`, a trailing " " or " '" that " ," or " 's" would rewrite.

Lower bound on a prompt's tokens (`Tokenizer.min_tokens`): when every token of the text covers at
most L of its characters, the text encodes to at least ceil(len(text) / L) tokens, found without
tokenizing (a multi-megabyte prompt takes seconds to encode). L is the longest vocabulary entry as
the model spells it: a byte-level BPE entry ('Ġthe') has one character per byte it covers, a
SentencePiece one ('▁the', '<0x0A>') at least one per character, so no entry covers more characters
than it has. That holds only when nothing of the text vanishes on the way to the tokens, which
`_keeps_every_character` checks of the `tokenizers` pipeline: length-keeping normalizers (NFC and
NFKC only on text already in that form: composing shortens it), pre-tokenizers that drop nothing
(no whitespace splitting), a model without fused unknowns (a run of unknown characters is one
`<unk>`), and no added token that strips the whitespace around it. Any other tokenizer gets 0.

This module imports no mlx: `ContinuationDetokenizer` needs only a `decode(ids) -> str`.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from kafilad.errors import ModelFormatError

#: prompt or committed tokens kept as left context for the next decode
CONTEXT_TOKENS = 16
#: pending tokens decoded together before the window moves on (when nothing is held back)
COMMIT_TOKENS = 16
#: transformers' `clean_up_tokenization` rewrites (tokenization_utils_base.py): a trailing proper
#: prefix of one of these may still be rewritten by the next token.
CLEANUP_PATTERNS = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")


def _held_back(text: str, clean_spaces: bool) -> int:
    """How many trailing characters of `text` a later token may still change."""
    n = len(text) - len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character decodes to U+FFFD
    if n or not clean_spaces:
        return n
    for k in range(min(len(text), max(map(len, CLEANUP_PATTERNS)) - 1), 0, -1):
        tail = text[-k:]
        if any(p.startswith(tail) and p != tail for p in CLEANUP_PATTERNS):
            return k
    return 0


class ContinuationDetokenizer:
    """A streaming detokenizer whose text is the decode of the generated ids after the prompt.

    The interface of mlx-lm's `StreamingDetokenizer`: `reset()`, `add_token(id)`, `finalize()`,
    `text` (everything so far that no later token can change), `tokens`, `last_segment` (the text
    since the last read). After `finalize()`, `text == decode(prefix + tokens)[len(decode(prefix)):]`
    for any prefix-stable `decode` (see the module docstring).

    Args:
        decode: the tokenizer's `decode(ids) -> str` (special tokens kept, as `decode` does).
        prefix_ids: the prompt's ids (only the last CONTEXT_TOKENS are used); empty gives
            `decode(tokens)` itself.
        clean_spaces: the tokenizer's decode applies transformers' cleanup rules (" ," -> ",").
        byte_ids: ids of byte-fallback tokens (`<0xNN>`), whose runs decode as a whole.
        skipped_ids: ids `decode` leaves out (special tokens): a byte run goes on across them.
    """

    def __init__(self, decode: Callable[[list[int]], str], prefix_ids: Sequence[int] = (), *,
                 clean_spaces: bool = False, byte_ids: frozenset[int] = frozenset(),
                 skipped_ids: frozenset[int] = frozenset()):
        self._decode = decode
        self._prefix = [int(t) for t in prefix_ids][-CONTEXT_TOKENS:]
        self._clean_spaces = clean_spaces
        self._byte_ids = byte_ids
        self._run_ids = byte_ids | skipped_ids if byte_ids else frozenset()
        self.reset()

    def reset(self) -> None:
        """Forget the generated tokens (the prompt context stays)."""
        self.offset = 0
        self.tokens: list[int] = []
        self._ctx = list(self._prefix)
        self._ctx_text = self._decode(self._ctx) if self._ctx else ""
        self._pending: list[int] = []
        self._committed = ""  # text of every token before `_pending`
        self._shown = ""  # the part of `_pending`'s text no later token can change

    def _pending_text(self, pending: list[int]) -> str:
        full = self._decode(self._ctx + pending)
        if full.startswith(self._ctx_text):
            return full[len(self._ctx_text):]
        # A decoder that rewrote the context (not seen with byte-level or SentencePiece ones):
        # keep what was already streamed and continue after the longest common prefix.
        i = 0
        while i < min(len(full), len(self._ctx_text)) and full[i] == self._ctx_text[i]:
            i += 1
        return full[i:]

    def add_token(self, token: int) -> None:
        """Consume one generated id."""
        self.tokens.append(int(token))
        self._pending.append(int(token))
        run = 0  # the trailing run of byte-fallback tokens (and skipped ones among them): a later byte may rewrite it
        while run < len(self._pending) and self._pending[-1 - run] in self._run_ids:
            run += 1
        if run == len(self._pending):
            return
        text = self._pending_text(self._pending[:len(self._pending) - run])
        held = _held_back(text, self._clean_spaces)
        shown = text[:len(text) - held]
        if shown.startswith(self._shown):  # never take back streamed text
            self._shown = shown
        if not held and not run and len(self._pending) >= COMMIT_TOKENS:
            self._commit()

    def _commit(self) -> None:
        self._committed += self._shown
        self._ctx = (self._ctx + self._pending)[-CONTEXT_TOKENS:]
        self._ctx_text = self._decode(self._ctx)
        self._pending, self._shown = [], ""

    def finalize(self) -> None:
        """Flush text held back for a token that will not come."""
        if self._pending:
            text = self._pending_text(self._pending)
            self._shown = text if text.startswith(self._shown) else self._shown
            self._committed += self._shown
            self._ctx = (self._ctx + self._pending)[-CONTEXT_TOKENS:]
            self._ctx_text = self._decode(self._ctx)
            self._pending, self._shown = [], ""

    @property
    def text(self) -> str:
        return self._committed + self._shown

    @property
    def last_segment(self) -> str:
        """The text added since this property was last read."""
        text = self.text
        segment = text[self.offset:]
        self.offset = len(text)
        return segment


#: normalizers that never shorten the text; NFC and NFKC shorten only text not already composed
_KEEPING_NORMALIZERS = {"Prepend", "Append", "Lowercase", "NFD", "NFKD"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
#: pre-tokenizers that split without dropping characters (Split and Punctuation: unless "Removed")
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def _keeps_every_character(backend, byte_fallback_complete: bool) -> Optional[tuple[str, ...]]:
    """The Unicode forms a text must be in for each of its characters to reach some token (empty:
    any text), or None when the `tokenizers` pipeline of `backend` may drop or fuse characters
    (module docstring). `byte_fallback_complete`: the vocabulary has all 256 `<0xNN>` tokens."""
    def flat(doc: dict, key: str) -> list[dict]:  # a Sequence's members, nested ones included
        return [p for d in doc.get(key, []) for p in flat(d, key)] if doc.get("type") == "Sequence" else [doc]

    def parts(component, key: str) -> Optional[list[dict]]:
        if component is None:
            return []
        try:
            return flat(json.loads(component.__getstate__()), key)
        except Exception:  # noqa: BLE001 - a component without a JSON state: nothing is known of it
            return None

    normalizers, pre_tokenizers = parts(backend.normalizer, "normalizers"), parts(backend.pre_tokenizer, "pretokenizers")
    if normalizers is None or pre_tokenizers is None:
        return None
    forms = []
    for n in normalizers:
        kind = n.get("type")
        if kind in _COMPOSING_NORMALIZERS:
            forms.append(kind)
        elif kind == "Replace":
            pattern = (n.get("pattern") or {}).get("String")
            if not isinstance(pattern, str) or len(str(n.get("content", ""))) < len(pattern):
                return None
        elif kind not in _KEEPING_NORMALIZERS:
            return None
    if any(p.get("type") not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in pre_tokenizers):
        return None
    model = backend.model
    kind = type(model).__name__
    if kind == "BPE":
        fuses = getattr(model, "unk_token", None) is not None and getattr(model, "fuse_unk", False)
    elif kind == "Unigram":
        fuses = True  # a run of unknown characters is one <unk>, unless bytes stand in for them
    else:  # WordPiece, WordLevel: an unknown word of any length is one token
        return None
    if fuses and not (getattr(model, "byte_fallback", False) and byte_fallback_complete):
        return None
    if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
        return None
    return tuple(forms)


def declared_eos_token_ids(model_dir: str | Path) -> Optional[set[int]]:
    """The `eos_token_id` values of config.json and generation_config.json (int or list), or None
    when neither names one.

    Raises:
        ValueError: an `eos_token_id` that is not an int or a list of ints.
    """
    ids: set[int] = set()
    found = False
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        value = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{path}: eos_token_id must be an integer or a list of integers, not {value!r}.")
        ids.update(values)
        found = True
    return ids if found else None


class Tokenizer:
    """mlx-lm's TokenizerWrapper with every declared EOS id and text that equals the decode.

    Every attribute not defined here (`encode`, `decode`, `apply_chat_template`, ...) is the
    wrapper's. `detokenizer` gives `decode(generated)`; `continuation_detokenizer(prompt_ids)`
    gives the text as it continues the prompt (a leading space kept), which is what serving streams.
    """

    def __init__(self, wrapper):
        self._wrapper = wrapper
        probe = wrapper.encode("a ,b", add_special_tokens=False)
        self.clean_spaces = " ," not in wrapper.decode(probe)
        #: ids the returned text leaves out (`text_of`: the tokenizer's special tokens)
        self.special_ids = frozenset(int(i) for i in getattr(wrapper, "all_special_ids", None) or ())
        pieces = wrapper.convert_ids_to_tokens(list(range(len(wrapper))))
        self.byte_ids = frozenset(i for i, p in enumerate(pieces)
                                  if isinstance(p, str) and len(p) == 6 and p.startswith("<0x") and p.endswith(">"))
        backend = getattr(getattr(wrapper, "_tokenizer", None), "backend_tokenizer", None)
        keeps = _keeps_every_character(backend, len(self.byte_ids) == 256) if backend is not None else None
        #: characters of the text one token covers at most (None: no bound, see the module docstring)
        self.max_token_chars: Optional[int] = (
            max(len(p) for p in pieces if isinstance(p, str)) if keeps is not None and pieces else None)
        self._composed_forms = keeps or ()

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))` found without tokenizing (module docstring): O(1),
        or O(len(text)) in C when the tokenizer composes Unicode (NFC/NFKC). 0 when none is known."""
        if not self.max_token_chars or not all(unicodedata.is_normalized(f, text) for f in self._composed_forms):
            return 0
        return -(-len(text) // self.max_token_chars)

    def count_tokens(self, text: str) -> int:
        """`len(encode(text))`, without transformers' warning about sequences past the model's length."""
        return len(self.encode(text, verbose=False))

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._wrapper, name)

    def __len__(self) -> int:
        return len(self._wrapper)

    @property
    def eos_token_ids(self) -> set[int]:
        return self._wrapper.eos_token_ids

    def text_of(self, ids: list[int]) -> str:
        """The text returned for `ids`: the tokenizer's decode with special tokens skipped (`<s>`,
        `<unk>`, a chat template's turn markers), which a model may sample mid-text (issue 25 item 6)."""
        return self._wrapper.decode(ids, skip_special_tokens=True)

    @property
    def detokenizer(self) -> ContinuationDetokenizer:
        """A fresh streaming detokenizer for `text_of(generated)` (no prompt context)."""
        return ContinuationDetokenizer(self.text_of, (), clean_spaces=self.clean_spaces, byte_ids=self.byte_ids,
                                       skipped_ids=self.special_ids)

    def continuation_detokenizer(self, prompt_ids: Iterable[int]) -> ContinuationDetokenizer:
        """A fresh streaming detokenizer for the text generated after `prompt_ids` (`text_of`)."""
        return ContinuationDetokenizer(self.text_of, list(prompt_ids), clean_spaces=self.clean_spaces,
                                       byte_ids=self.byte_ids, skipped_ids=self.special_ids)


#: transformers' own "no limit" for `model_max_length` (transformers.tokenization_utils_base.VERY_LARGE_INTEGER)
UNBOUNDED_TOKENS = int(1e30)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of a local model dir (reads only local files).

    Raises:
        ValueError: a malformed `eos_token_id` in config.json or generation_config.json.
        ModelFormatError: the directory has no tokenizer transformers can load (its first line says why).
    """
    from mlx_lm.utils import load_tokenizer as _load

    eos = declared_eos_token_ids(model_dir)
    try:
        # the session's admitted context bounds a prompt (DESIGN §5.4), not the tokenizer config's
        # `model_max_length` (stories260K says 512 though it is served at 2048): without this,
        # transformers warns of "indexing errors" for every longer prompt
        wrapped = _load(Path(model_dir), tokenizer_config_extra={"model_max_length": UNBOUNDED_TOKENS},
                        eos_token_ids=eos)
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError, OSError, KeyError, ... here
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelFormatError(f"{model_dir} has no tokenizer that can be loaded (tokenizer.json, tokenizer.model "
                               f"or tokenizer_config.json): {first}") from None
    return Tokenizer(wrapped)
