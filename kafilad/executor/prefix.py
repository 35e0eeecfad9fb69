"""The prompt cache across requests: KV caches kept after a request, reused by the next that shares its prefix
(issue 23 item 3; proto_spec 05 §3 `act` "from"/"reuse"/"evict", `end` "keep"/"evict").

A chat's next turn repeats the whole conversation so far. Instead of dropping a finished request's
KV caches, every stage keeps them as an *entry* (named by the request's id) holding the first
`n_tokens` positions; a later request whose prompt starts with those tokens starts from a copy of
the entry's caches and prefills only the rest of its prompt.

The head decides everything and every other stage follows, so all stages always hold the same
entries: the head keeps the token ids of each entry (`PrefixIndex`), picks the entry sharing the
longest prefix with a new prompt, and names it and the number of reused tokens in the request's
first `act`; it decides which entries to keep when a request ends and which to evict, and says so
in the `end` and `act` frames, which go round the ring in order. Other stages only execute
(`PrefixStore`).

Budget (what the plan admitted, DESIGN §5.4): the plan reserves KV room for `concurrency`
requests of `context` tokens. Kept entries may use the room of the requests not running:
their tokens stay at most context x (concurrency - running requests); the oldest entry goes first
(LRU). At concurrency 1 a session keeps the last conversation while it is idle and hands it to
the next request.

Caches: only mlx-lm's plain `KVCache` can be cut back to a prefix exactly (`trim`), so the prompt
cache is on only when every cache the model makes is one (`Stage.prefix_cacheable`); a model with
rotating-window, linear-attention or SSM caches runs without it (status says so).

Reused positions hold the keys and values computed when the entry's request ran; the rest of the
prompt is prefilled as mlx-lm's generate_step prefills the rest after a prompt cache.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from mlx_lm.models.cache import KVCache


def common_prefix_len(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def kv_slice(cache: KVCache, n: int) -> KVCache:
    """A new KVCache holding the first n positions of `cache` (new arrays: writing to it never
    changes `cache`)."""
    out = KVCache()
    if n > 0 and cache.keys is not None:
        out.keys = cache.keys[..., :n, :]
        out.values = cache.values[..., :n, :]
        out.offset = n
    return out


class PrefixStore:
    """A stage's kept entries: entry id -> (one KVCache per block, tokens held). Executes what the
    head decided; the runner calls it under its lock."""

    def __init__(self):
        self.entries: "OrderedDict[str, tuple[list, int]]" = OrderedDict()

    def keep(self, entry: str, caches: list, n_tokens: int) -> None:
        """Keep a finished request's `caches` as `entry`, cut back to its first `n_tokens` positions."""
        for c in caches:
            c.trim(max(0, c.offset - n_tokens))
        self.entries[entry] = (caches, n_tokens)

    def start(self, entry: str, n_tokens: int) -> Optional[list]:
        """Caches for a new request holding the entry's first `n_tokens` positions (copies), or None
        when the entry is not here (the new request then prefills from nothing: a stage that lost
        its entries must not make the ring fail)."""
        got = self.entries.get(entry)
        if got is None or n_tokens > got[1]:
            return None
        self.entries.move_to_end(entry)
        return [kv_slice(c, n_tokens) for c in got[0]]

    def evict(self, entries) -> None:
        for e in entries:
            self.entries.pop(e, None)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.entries.values())


class PrefixIndex:
    """The head's view of the entries: their token ids, in LRU order, and the decisions.

    Args:
        budget_tokens: context x concurrency of the plan (module docstring); 0 turns it off.
        context_tokens: the session's context (room one running request may use).
    """

    def __init__(self, budget_tokens: int, context_tokens: int):
        self.budget_tokens = budget_tokens
        self.context_tokens = context_tokens
        self.tokens: "OrderedDict[str, tuple[int, ...]]" = OrderedDict()
        self.hits = 0
        self.tokens_saved = 0

    def _room(self, running: int) -> int:
        return max(0, self.budget_tokens - self.context_tokens * running)

    def _over(self, room: int, keep_last: Optional[str] = None) -> list[str]:
        """Entries to evict, oldest first, until the rest fit in `room` tokens."""
        out = []
        total = sum(len(t) for t in self.tokens.values())
        for e in list(self.tokens):
            if total <= room:
                break
            if e == keep_last:
                continue
            total -= len(self.tokens.pop(e))
            out.append(e)
        return out

    def claim(self, prompt: tuple[int, ...], running: int) -> tuple[Optional[str], int, list[str]]:
        """For a new request (`running` counts it): (entry to start from or None, tokens reused,
        entries to evict). At least the prompt's last token is left to prefill (it makes the
        logits), so at most len(prompt) - 1 tokens are reused."""
        best, n = None, 0
        for e, toks in self.tokens.items():
            k = min(common_prefix_len(toks, prompt), len(prompt) - 1)
            if k > n:
                best, n = e, k
        if best is not None:
            self.tokens.move_to_end(best)
            self.hits += 1
            self.tokens_saved += n
        return best, n, self._over(self._room(running), keep_last=best)

    def keep(self, entry: str, tokens: tuple[int, ...], running: int) -> tuple[bool, list[str]]:
        """A request ends with `tokens` in its caches (`running` no longer counts it): (keep it as
        `entry`?, entries to evict). Nothing is kept past the budget; an entry whose tokens are a
        prefix of the new one's is replaced by it."""
        room = self._room(running)
        if not tokens or len(tokens) > room:
            return False, []
        evict = [e for e, t in self.tokens.items() if len(t) <= len(tokens) and tokens[:len(t)] == t]
        for e in evict:
            self.tokens.pop(e)
        self.tokens[entry] = tuple(tokens)
        return True, evict + self._over(room, keep_last=entry)
