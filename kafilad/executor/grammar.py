"""Constrained decoding on the head: the tokens a request's grammar allows (issue 23 item 2).

The engine is llguidance (Microsoft's guidance engine, Rust, MIT): chosen over xgrammar and
outlines-core because it builds a tokenizer's token trie once (about 1 s for a 49k vocabulary) and
then computes a token mask per step without precompiling the grammar per vocabulary, takes JSON
schemas, Lark and regular expressions alike, and ships as one abi3 wheel without torch. Its cost
per token is measured by scripts/bench_grammar.py (docs/performance.md).

A request's grammar arrives in its Sampling (kafilad/proto/sampling.py, `grammar`: llguidance's
JSON form, made by the HTTP APIs from `response_format`, Ollama's `format` and forced tool calls:
kafilad/control/grammars.py).
The head's runner (kafilad/executor/runner.py `head_sample_rows`) keeps one `LLMatcher` per request
while it runs: before each token it sets every token the matcher forbids to -inf (after the logits
processors, before the log-probabilities and the sampler), and after it the matcher consumes the
token. Each row of a batch has its own matcher. When the grammar is complete the matcher allows only
the end-of-sequence tokens, so the request ends there.

Runs on the head's MLX worker thread, off the event loop; llguidance drops the GIL while it
computes a mask.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from kafilad.errors import KafilaError

class GrammarError(KafilaError, ValueError):
    """A grammar llguidance refuses, or a token it did not allow (the matcher's own sentence); a
    ValueError as the runner's other refusals of a request's parameters are (the ring ends that
    request with it)."""


class Grammars:
    """The head's matchers, one per constrained request, over the model's tokenizer.

    Args:
        tokenizer: the head's tokenizer (kafilad/executor/tokenizer.py `Tokenizer`, a
            transformers fast tokenizer inside).
        vocab_size: V, the width of the model's logits (may exceed the tokenizer's vocabulary).
    """

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self._lltok = None
        self._lock = threading.Lock()
        self._matchers: dict[str, object] = {}

    def _ll_tokenizer(self):
        """llguidance's view of the tokenizer, built once (about 1 s for a 49k vocabulary)."""
        with self._lock:
            if self._lltok is None:
                import llguidance.hf

                hf = self._tokenizer  # Kafila's Tokenizer wraps mlx-lm's TokenizerWrapper, which wraps transformers'
                for inner in ("_wrapper", "_tokenizer"):
                    hf = hf.__dict__.get(inner, hf)
                eos = sorted(self._tokenizer.eos_token_ids) if getattr(self._tokenizer, "eos_token_ids", None) else None
                self._lltok = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
            return self._lltok

    def matcher(self, request_id: str, grammar: str):
        """The request's matcher, made from `grammar` on its first token.

        Raises:
            GrammarError: a grammar llguidance cannot compile (its sentence).
        """
        m = self._matchers.get(request_id)
        if m is None:
            import llguidance

            m = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
            if m.is_error():
                raise GrammarError(f"The request's grammar cannot be used: {m.get_error()}")
            self._matchers[request_id] = m
        return m

    def allowed(self, request_id: str, grammar: str) -> mx.array:
        """The tokens the request's grammar allows next: a bool array (V,).

        Raises:
            GrammarError: as `matcher`, or a matcher in an error state.
        """
        m = self.matcher(request_id, grammar)
        words = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        if m.is_error():
            raise GrammarError(f"The request's grammar failed: {m.get_error()}")
        bits = np.unpackbits(words, bitorder="little")[:self.vocab_size].astype(bool)
        if bits.size < self.vocab_size:
            bits = np.concatenate([bits, np.zeros(self.vocab_size - bits.size, bool)])
        return mx.array(bits)

    def consume(self, request_id: str, token: int) -> None:
        """Advance the request's matcher past `token` (sampled under its mask).

        Raises:
            GrammarError: the matcher did not allow it.
        """
        m = self._matchers.get(request_id)
        if m is not None and not m.consume_token(int(token)):
            raise GrammarError(f"The request's grammar did not allow token {token}: {m.get_error()}")

    def done(self, request_id: str) -> bool:
        """Whether the request's grammar is complete (its matcher stopped or only accepts an end)."""
        m = self._matchers.get(request_id)
        return bool(m is not None and m.is_stopped())

    def drop(self, request_id: str) -> None:
        """Forget the request's matcher (no error if it has none)."""
        self._matchers.pop(request_id, None)


def mask_logits(logits: mx.array, allowed: mx.array) -> mx.array:
    """logits (1, V) with every token not `allowed` (V,) set to -inf."""
    return mx.where(allowed[None, :], logits, mx.array(-float("inf"), dtype=logits.dtype))


