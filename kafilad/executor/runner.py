"""Per-request execution of one stage, and the activation wire format (DESIGN §2 ring, §6).

A `StageRunner` holds one KV cache list per request id. Its methods are synchronous; MLX work
runs off the trio thread (DESIGN §6), and a lock serialises MLX work inside one runner. Batched
caches leave lazily evaluated arrays behind after `drop`/extract, and MLX binds those to the
thread that built them, so the node calls every runner of a process on one dedicated MLX worker
thread (kafilad/node/serving/ring.py `run_on_mlx_thread`), not on trio's thread pool.

How the ring replays `mlx_lm.generate.generate_step` exactly (the token-identity rule):

1. Prefill: `prefill_chunks(prompt_ids, prefill_step_size)` splits the prompt as generate_step
   does: prompt[:-1] in consecutive chunks of at most `prefill_step_size` (2048, mlx-lm's
   default) tokens, then the last prompt token alone. Every chunk goes round the whole ring in
   order (head: `head_embed_and_run`; other stages: `run`), but only the hidden state of the
   *last* chunk (one token) returns to the head for `head_sample`; the earlier chunks only fill
   the KV caches and their outputs are dropped at the last stage.
2. Decode: each sampled token is a one-token chunk: `head_embed_and_run(rid, [token])`, `run`
   on every other stage, `head_sample` on the head.
3. `drop(rid)` on every stage when the request ends (EOS, max tokens, error).

Because every matmul then has the same shapes as in the single-process run, and f32 activations
cross the wire bit-exactly (`array_to_wire`/`array_from_wire`), the greedy tokens and the
log-probs equal generate_step's bit for bit (tests/executor checks both, with OpenBLAS loaded).
A single whole-prompt pass would give the same tokens in practice but log-probs ~1e-6 apart.

Batched decode (DESIGN §6): after its prefill (step 1, done alone, including the first sampled
token), a request may decode in a batch: the head sends the ordered request ids with each step
and every stage calls `run_batch(ids, h)` (head: `head_embed_and_run_batch(ids, tokens)` and
`head_sample_batch(ids, h, temperatures)`). Each stage keeps one persistent mlx-lm
`BatchKVCache` per block *per micro-batch group* (the `group` of the step, proto_spec 05 §3: the
head may keep several decode micro-batches in flight, kafilad/proto/step_policy.py) and reconciles
it with the ids of each step: new ids are merged in from their single caches or taken from
another group (`merge`/`extend`), absent ids are taken out (`extract`, `filter`) back into single
caches, and the order is permuted to match. Batched steps run (B, 1, D) matmuls, so
tokens match single-request decoding but log-probs may differ in the last bits. A batched
speculative pass (proto_spec 05 §3.1) runs (B, 1 + k, D): `head_verify_batch` accepts each row's
drafts and `trim_rows` cuts each row back inside the batch caches.

Sampling parameters (kafilad/proto/sampling.py): a request with only a temperature is sampled by
`head_sample` / `head_sample_batch` as above. Any other parameter (top_p, top_k, min_p, seed,
penalties, logit_bias, logprobs, a grammar) goes through `head_sample_rows`, which applies mlx-lm's
`make_logits_processors` and sampler functions row by row, in generate_step's order, with the
request's processors, (when seeded) its own random key and (with a grammar) its llguidance matcher
(`grammars`, kafilad/executor/grammar.py) kept here until `drop`.

Wire format of an activation: the array map of proto_spec 02 §4.2, checked by the one codec
`kafilad.proto.frames.encode_activation` / `decode_activation`::
    {"dtype": "float32" | "bfloat16" | "float16", "shape": [B, L, D], "data": bytes}
where `data` is the array in C order, little-endian (bf16: its raw 16-bit patterns). This module
only converts between MLX arrays and those bytes. An activation travels in its sender's dtype;
stages of a ring may hold different dtypes (issue 12 item 4), and each casts what arrives to its
own before its blocks and before the head's output projection (`Stage.cast_in`, called by
`Stage.run_blocks` and `Stage.logits`), so the head samples from logits in its own dtype.
"""

from __future__ import annotations

import threading
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, can_trim_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import (apply_min_p, apply_top_k, apply_top_p, categorical_sampling,
                                 make_logits_processors, make_sampler)

from kafilad.errors import RemoteProtocolError
from kafilad.executor.grammar import GrammarError, Grammars, mask_logits
from kafilad.executor.prefix import PrefixIndex, PrefixStore
from kafilad.executor.stage import Stage
from kafilad.proto.frames import decode_activation, encode_activation
from kafilad.proto.sampling import Sampling
from kafilad.proto.speculation import accept_greedy, accept_point_drafts

#: what a sampled row reports besides its token: (chosen token's logprob, ((token_id, logprob), ...) best
#: first), or None when its request asked for no log-probabilities
TokenLogprobs = Optional[tuple[float, tuple[tuple[int, float], ...]]]

#: mlx-lm's generate_step default prefill chunk (tokens).
DEFAULT_PREFILL_STEP_SIZE = 2048
#: micro-batch groups a stage keeps batch caches for (proto_spec 05 §3: the head uses fewer than 2x its stages)
MAX_GROUPS = 64
#: wire dtype name (proto_spec 02 §4.2) -> numpy dtype of its bytes.
_WIRE_NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def prefill_chunks(ids: list[int], prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE) -> list[list[int]]:
    """Split a prompt as mlx-lm's generate_step does: prompt[:-1] by `prefill_step_size`, then [last].

    Returns a list of non-empty chunks whose concatenation is `ids`; the last is one token.
    Raises:
        ValueError: empty prompt or non-positive step size.
    """
    if not ids:
        raise ValueError("A prompt needs at least one token.")
    if prefill_step_size < 1:
        raise ValueError("prefill_step_size must be at least 1.")
    body = list(ids[:-1])
    chunks = [body[i:i + prefill_step_size] for i in range(0, len(body), prefill_step_size)]
    return chunks + [[ids[-1]]]


def array_to_wire(a: mx.array) -> dict:
    """Encode an activation for the wire, bit-exactly: the array map of proto_spec 02 §4.2.

    Args:
        a: float32, float16 or bfloat16 array, e.g. a hidden state (B, L, D).
    Returns:
        {"dtype", "shape", "data"} (``kafilad.proto.frames.encode_activation``).
    Raises:
        ValueError: a dtype other than float32, float16, bfloat16.
    """
    if a.dtype == mx.float32:
        name, arr = "float32", np.array(a, copy=True)
    elif a.dtype == mx.float16:
        name, arr = "float16", np.array(a, copy=True)
    elif a.dtype == mx.bfloat16:
        name, arr = "bfloat16", np.array(a.view(mx.uint16), copy=True)
    else:
        raise ValueError(f"Activations of dtype {a.dtype} cannot be sent; use float32, float16 or bfloat16.")
    arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    return encode_activation(name, tuple(a.shape), np.ascontiguousarray(arr).tobytes())


def array_from_wire(d: dict) -> mx.array:
    """Decode `array_to_wire`'s map back into an MLX array (bit-exact).

    Raises:
        RemoteProtocolError: not a valid activation map (``kafilad.proto.frames.decode_activation``:
            dtype, shape, byte count).
    """
    name, shape, data = decode_activation(d)
    arr = np.frombuffer(data, dtype=np.dtype(_WIRE_NP[name]).newbyteorder("<")).reshape(shape)
    out = mx.array(arr)
    return out.view(mx.bfloat16) if name == "bfloat16" else out


class StageRunner:
    """Runs one stage for many requests, each with its own KV caches (DESIGN §6).

    See the module docstring for the call sequence that reproduces mlx-lm's generate_step.
    Methods are synchronous and evaluate their result (they block for the compute); call them
    all from one thread, off the trio thread (kafilad/node/serving/ring.py `run_on_mlx_thread`).
    """

    def __init__(self, stage: Stage):
        self.stage = stage
        self._caches: dict[str, list] = {}
        self._groups: dict[int, tuple[list[str], list]] = {}  # group -> (ids, one BatchKVCache per block in ids order)
        self._samplers: dict[float, object] = {}
        self._processors: dict[str, list] = {}  # request -> its mlx-lm logits processors (head)
        self._keys: dict[str, mx.array] = {}  # request -> its random key, for a seeded request (head)
        #: the head's constrained decoding (kafilad/executor/grammar.py), set with the tokenizer
        self.grammars: Optional[Grammars] = None
        #: the prompt cache's kept entries (kafilad/executor/prefix.py), on every stage
        self.prefix = PrefixStore()
        #: the head's index of those entries (None: no prompt cache, or not the head)
        self.prefix_index: Optional[PrefixIndex] = None
        self._lock = threading.Lock()

    @property
    def active_requests(self) -> list[str]:
        """Request ids holding a KV cache here, single ones first, then each group's batch in order."""
        return list(self._caches) + self.batch_ids

    @property
    def batch_ids(self) -> list[str]:
        """Ids held in batch caches, group by group (ascending), each in its row order."""
        return [r for g in sorted(self._groups) for r in self._groups[g][0]]

    def group_ids(self, group: int) -> list[str]:
        """Ids of one micro-batch group's batch cache, in row order ([] if none)."""
        return list(self._groups.get(group, ([], []))[0])

    def cache_length(self, request_id: str) -> int:
        """Tokens held in this request's KV cache (0 if unknown)."""
        with self._lock:
            self._take_out_of_batch([request_id])
            cache = self._caches.get(request_id) or []
            # the first cache that counts tokens (a linear-attention or Mamba cache does not)
            return next((int(c.offset) for c in cache if isinstance(getattr(c, "offset", None), int)), 0)

    def _cache(self, request_id: str) -> list:
        self._take_out_of_batch([request_id])
        cache = self._caches.get(request_id)
        if cache is None:
            cache = self._caches[request_id] = self.stage.make_cache()
        return cache

    def _filter_group(self, group: int, keep: list[int]) -> None:
        ids, caches = self._groups[group]
        if not keep:
            del self._groups[group]
            return
        for c in caches:
            c.filter(keep)
        self._groups[group] = ([ids[i] for i in keep], caches)

    def _take_out_of_batch(self, request_ids: list[str], keep_cache: bool = True) -> None:
        wanted = set(request_ids)
        for group in list(self._groups):
            ids, caches = self._groups[group]
            rows = [i for i, r in enumerate(ids) if r in wanted]
            if not rows:
                continue
            if keep_cache:
                for i in rows:
                    self._caches[ids[i]] = [c.extract(i) for c in caches]
            self._filter_group(group, [i for i in range(len(ids)) if i not in rows])

    def _sync_batch(self, request_ids: list[str], group: int = 0) -> list:
        """Make `group`'s batch cache hold exactly `request_ids`, in that order; return its caches."""
        if not request_ids:
            raise RemoteProtocolError("A batched step listed no requests.")
        if len(set(request_ids)) != len(request_ids):
            raise RemoteProtocolError(f"A batched step listed a request twice: {request_ids}.")
        if not isinstance(group, int) or isinstance(group, bool) or not 0 <= group < MAX_GROUPS:
            raise RemoteProtocolError(f"A batched step named micro-batch group {group!r}; groups are 0-{MAX_GROUPS - 1}.")
        wanted = set(request_ids)
        ids, _ = self._groups.get(group, ([], []))
        self._take_out_of_batch([r for r in ids if r not in wanted])  # rows that left this group
        elsewhere = [r for g, (gids, _) in self._groups.items() if g != group for r in gids if r in wanted]
        self._take_out_of_batch(elsewhere)  # rows that moved here from another group
        ids = self._groups.get(group, ([], []))[0]
        new = [r for r in request_ids if r not in ids]
        missing = [r for r in new if r not in self._caches]
        if missing:
            raise RemoteProtocolError(
                f"Stage [{self.stage.start}, {self.stage.end}) has no KV cache for request(s) {missing}: "
                "a request must be prefilled alone before it joins a batch.")
        if new:
            singles = [self._caches.pop(r) for r in new]
            merged = [singles[0][i].merge([s[i] for s in singles]) for i in range(len(singles[0]))]
            if group in self._groups:
                ids, caches = self._groups[group]
                for mine, theirs in zip(caches, merged):
                    mine.extend(theirs)
                self._groups[group] = (ids + new, caches)
            else:
                self._groups[group] = (list(new), merged)
        ids = self._groups[group][0]
        if ids != list(request_ids):
            self._filter_group(group, [ids.index(r) for r in request_ids])
        return self._groups[group][1]

    def head_embed_and_run(self, request_id: str, ids: list[int]) -> mx.array:
        """Head: embed `ids` (one chunk, L tokens) and run the head's blocks. Returns (1, L, D)."""
        with self._lock:
            h = self.stage.run_tokens(ids, self._cache(request_id))
            mx.eval(h)
            return h

    def run(self, request_id: str, h: mx.array) -> mx.array:
        """Any stage: run its blocks on h (1, L, D) from the previous stage. Returns (1, L, D)."""
        with self._lock:
            out = self.stage.run_blocks(h, self._cache(request_id))
            mx.eval(out)
            return out

    def head_sample(self, request_id: str, h: mx.array, temperature: float = 0.0) -> int:
        """Head: final norm + lm_head on the last position of h (1, L, D), then sample one token.

        The log-probs are `logits - logsumexp(logits)` and the sampler is mlx-lm's
        `make_sampler(temperature)` (argmax at 0), exactly as in generate_step.
        `request_id` is accepted for symmetry and future per-request samplers.
        """
        with self._lock:
            sampler, logprobs = self._sampler_and_logprobs(h, temperature)
            return int(sampler(logprobs).item())

    def _sampler_and_logprobs(self, h: mx.array, temperature: float):
        """The cached sampler for `temperature` and the head's log-probs of `h` (lazy). Call under _lock."""
        sampler = self._samplers.get(temperature)
        if sampler is None:
            sampler = self._samplers[temperature] = make_sampler(temp=temperature)
        logits = self.stage.logits(h)
        return sampler, logits - mx.logsumexp(logits, keepdims=True)

    def head_sample_and_run(self, request_id: str, h: mx.array, temperature: float = 0.0) -> tuple[int, Optional[mx.array]]:
        """Head, a request decoding alone: `head_sample` and, in the same MLX graph, the next step's
        `head_embed_and_run(request_id, [token])` (as generate_step feeds its sampled `y` to the
        model lazily), so one evaluation and one hand-off serve both. Same operations, same bits.

        The request's caches then hold the sampled token: if that step is not sent (the request
        ends, or joins a batch), `trim_last` takes it back. Only mlx-lm's plain `KVCache` is
        trimmed so (a rotating cache may have dropped what a trim would need): with any other
        cache the next step is not run here.

        Returns:
            (token, the next step's (1, 1, D) output, or None when it was not run).
        """
        with self._lock:
            sampler, logprobs = self._sampler_and_logprobs(h, temperature)
            y = sampler(logprobs)
            cache = self._cache(request_id)
            if not all(type(c) is KVCache for c in cache):
                return int(y.item()), None
            out = self.stage.run_tokens(y.reshape(1, 1), cache)
            mx.eval(y, out)
            return int(y.item()), out

    def trim_last(self, request_id: str) -> None:
        """Take the last token back out of the request's single caches (`head_sample_and_run`'s
        step that was not sent); nothing if the request has none."""
        with self._lock:
            for c in self._caches.get(request_id) or ():
                c.trim(1)

    def head_verify(self, request_id: str, h: mx.array, drafts: list[int], temperature: float = 0.0) -> list[int]:
        """Head: accept a speculative pass's drafts (kafilad/proto/speculation.py, issue 24 item 1).

        The pass ran the last sampled token and `drafts` (k tokens) as one chunk, so h (1, k+1, D)
        holds a position for each. Greedy (temperature 0): the longest prefix of drafts equal to
        the model's argmax, plus the argmax after it (`accept_greedy`). Sampling: speculative
        sampling's rule for point-mass drafts (`accept_point_drafts`): draft i is accepted with
        probability p_i(d_i) under mlx-lm's `make_sampler(temperature)` distribution, a rejected
        position draws from p_i without d_i, and a pass whose drafts were all accepted draws one
        more from p_k. The head's caches are trimmed back to the accepted tokens (the pass's first
        token and the n accepted drafts; the returned last token is not in them, as after any
        sampling); the other stages trim by the next act's `trim` (proto_spec 05 §3.1).

        Returns:
            The n accepted drafts and the next token (1 to k+1 tokens).
        Raises:
            RemoteProtocolError: h does not hold k+1 positions of one row.
        """
        k = len(drafts)
        if h.ndim != 3 or h.shape[0] != 1 or h.shape[1] != k + 1:
            raise RemoteProtocolError(f"A speculative pass of {k} drafts returned activations of shape "
                                      f"{tuple(h.shape)}, not (1, {k + 1}, D).")
        with self._lock:
            logits = self.stage.logits(h, all_positions=True)[0]
            out = _accept(logits - mx.logsumexp(logits, axis=-1, keepdims=True), drafts, temperature)
            rejected = k + 1 - len(out)
            if rejected:
                trim_prompt_cache(self._cache(request_id), rejected)
            return out

    def trim(self, request_id: str, n_tokens: int) -> None:
        """Take the last `n_tokens` positions back out of the request's caches (a speculative pass's
        rejected drafts, proto_spec 05 §3.1), taking it out of a batch first when it is in one.

        Raises:
            RemoteProtocolError: the request has no caches here, fewer positions, or caches mlx-lm
                cannot trim (the head speculates only where `Stage.speculation_refusal` is None).
        """
        if n_tokens <= 0:
            return
        with self._lock:
            self._trim_alone(request_id, n_tokens)

    def _trim_alone(self, request_id: str, n_tokens: int) -> None:
        """`trim` under _lock."""
        if n_tokens <= 0:
            return
        self._take_out_of_batch([request_id])
        cache = self._caches.get(request_id)
        held = next((int(c.offset) for c in cache or () if isinstance(getattr(c, "offset", None), int)), 0)
        if not cache or held < n_tokens or not can_trim_prompt_cache(cache):
            raise RemoteProtocolError(f"Stage [{self.stage.start}, {self.stage.end}) cannot take {n_tokens} "
                                      f"positions back out of request {request_id}'s caches ({held} held).")
        trim_prompt_cache(cache, n_tokens)

    def head_verify_batch(self, request_ids: list[str], h: mx.array, drafts: list[list[int]],
                          temperatures: list[float], group: int = 0,
                          rows: Optional[list[int]] = None) -> list[list[int]]:
        """Head: `head_verify` for every row of a batched speculative pass (proto_spec 05 §3.1).

        Row i of h (B, k+1, D) ran request_ids[i]'s last sampled token and its k drafts
        `drafts[i]` (every row carries the same k) in micro-batch `group`; each row is accepted
        by its own temperature's rule, and its rows of the group's batch caches are trimmed back
        to its accepted tokens at once (`trim_rows`; the other stages trim by the next act's
        `trims`). `rows`, when given: the rows of h that are request_ids' (the pass's other rows
        belong to requests that ended while it was out, whose caches are gone).

        Returns:
            Per row, its accepted drafts and its next token (1 to k+1 tokens).
        Raises:
            RemoteProtocolError: drafts or temperatures of another count than the rows, rows of
                unequal k, or h not (B, k+1, D).
        """
        B = len(request_ids)
        if rows is not None:
            if len(rows) != B or any(not 0 <= i < h.shape[0] for i in rows):
                raise RemoteProtocolError(f"Rows {rows} of a batched pass of {h.shape[0]} rows cannot be {B} requests'.")
            h = h[mx.array(rows)]
        k = len(drafts[0]) if drafts else 0
        if len(drafts) != B or len(temperatures) != B or any(len(d) != k for d in drafts):
            raise RemoteProtocolError(f"A batched speculative pass of {B} rows needs {B} equal draft lists and "
                                      f"temperatures, not {[len(d) for d in drafts]} and {len(temperatures)}.")
        if h.ndim != 3 or h.shape[0] != B or h.shape[1] != k + 1:
            raise RemoteProtocolError(f"A batched speculative pass of {B} rows of {k} drafts returned activations "
                                      f"of shape {tuple(h.shape)}, not ({B}, {k + 1}, D).")
        with self._lock:
            logits = self.stage.logits(h, all_positions=True)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if all(t == 0 for t in temperatures):
                targets = mx.argmax(logprobs, axis=-1).tolist()
                outs = [accept_greedy(d, t) for d, t in zip(drafts, targets)]
            else:
                outs = [_accept(logprobs[i], list(drafts[i]), temperatures[i]) for i in range(B)]
            self._trim_batch(request_ids, self._sync_batch(request_ids, group), [k + 1 - len(o) for o in outs])
            return outs

    def trim_rows(self, request_ids: list[str], n_tokens: list[int], group: int = 0) -> None:
        """Take the last n_tokens[i] positions back out of request_ids[i]'s caches before a batched
        step of micro-batch `group` (its act's `trims`, proto_spec 05 §3.1); the rows stay in the
        group's batch caches (`_trim_batch`).

        Raises:
            RemoteProtocolError: a count per row mismatch, a negative count, more positions than
                a row holds, or caches mlx-lm cannot trim; as `_sync_batch`.
        """
        if len(n_tokens) != len(request_ids):
            raise RemoteProtocolError(f"A batched step of {len(request_ids)} rows carried {len(n_tokens)} trims.")
        if not any(n_tokens):
            return
        with self._lock:
            self._trim_batch(request_ids, self._sync_batch(request_ids, group), list(n_tokens))

    def _trim_batch(self, request_ids: list[str], caches: list, n_tokens: list[int]) -> None:
        """Trim row i of `caches` (a group's batch caches, rows `request_ids`) by n_tokens[i].

        mlx-lm's `BatchKVCache` keeps its rows left-padded to one length: every row is trimmed by
        the smallest count (`trim`), and a row with more to take back is shifted right by the rest
        and its left padding grown by it, as mlx-lm itself ends a right-padded prefill
        (`prepare(right_padding=...)`, `finalize`); once every row has padding, mlx-lm's `filter`
        drops the columns they all pad, so padding stays bounded by the rows' length differences
        however the counts alternate. Other trimmable cache kinds take such a row out
        of the batch and trim it alone (`_sync_batch` merges it back at the next step). Call under
        _lock.
        """
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in n_tokens):
            raise RemoteProtocolError(f"A batched step asked to trim {n_tokens} positions.")
        if not any(n_tokens):
            return
        if caches and all(type(c) is BatchKVCache for c in caches):
            held = caches[0].offset.tolist()
            short = [r for r, n, have in zip(request_ids, n_tokens, held) if n > have]
            if short:
                raise RemoteProtocolError(f"Stage [{self.stage.start}, {self.stage.end}) cannot take {n_tokens} "
                                          f"positions back out of rows {request_ids} ({held} held).")
            low = min(n_tokens)
            rest = [n - low for n in n_tokens]
            for c in caches:
                if low:
                    c.trim(low)
                if any(rest):
                    c.prepare(right_padding=rest)
                    c.finalize()
                    if min(c.left_padding.tolist()) > 0:  # padding in every row: mlx-lm's `filter` drops it
                        c.filter(mx.arange(len(request_ids)))
            return
        for r, n in zip(request_ids, n_tokens):
            self._trim_alone(r, n)

    def head_sample_batch_and_run(self, request_ids: list[str], h: mx.array, group: int = 0) -> tuple[list[int], Optional[mx.array]]:
        """Head, batched greedy decode: `head_sample_batch` at temperature 0 and, in the same MLX graph,
        the next step's `head_embed_and_run_batch(request_ids, tokens, group)`; `trim_last_group`
        takes that step back if it is not sent. Caches other than mlx-lm's `BatchKVCache` get no next step.

        Returns:
            (one token per row, the next step's (B, 1, D) output or None when it was not run).
        Raises:
            RemoteProtocolError: as `head_sample_batch` and `head_embed_and_run_batch`.
        """
        if h.shape[0] != len(request_ids):
            raise RemoteProtocolError(f"A batched sample for {len(request_ids)} requests got {h.shape[0]} rows.")
        with self._lock:
            logits = self.stage.logits(h)
            y = mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)
            caches = self._sync_batch(request_ids, group)
            if not all(type(c) is BatchKVCache for c in caches):
                return [int(x) for x in y.tolist()], None
            out = self.stage.run_tokens(y.reshape(len(request_ids), 1), caches)
            mx.eval(y, out)
            return [int(x) for x in y.tolist()], out

    def trim_last_group(self, group: int) -> None:
        """Take the last step back out of micro-batch `group`'s caches (`head_sample_batch_and_run`'s
        step that was not sent); nothing if the group has none."""
        with self._lock:
            for c in self._groups.get(group, ([], []))[1]:
                c.trim(1)

    def head_embed_and_run_batch(self, request_ids: list[str], tokens: list, group: int = 0) -> mx.array:
        """Head, batched decode: embed one token per request (or, for a batched speculative pass,
        L tokens per request: its last token and its drafts, proto_spec 05 §3.1) and run the
        head's blocks.

        tokens[i] (an int, or a list of L ints, the same L for every row) belongs to
        request_ids[i]; `group` is the step's micro-batch group (its batch cache).
        Returns (B, L, D) with B = len(request_ids) (L = 1 for ints).
        Raises:
            RemoteProtocolError: a request that was not prefilled here, listed twice, a bad group,
                or rows of unequal length.
        """
        if len(tokens) != len(request_ids):
            raise RemoteProtocolError(f"A batched step has {len(request_ids)} requests but {len(tokens)} tokens.")
        rows = [list(t) if isinstance(t, (list, tuple)) else [t] for t in tokens]
        if len({len(r) for r in rows}) != 1 or not rows[0]:
            raise RemoteProtocolError(f"A batched step's rows carry {[len(r) for r in rows]} tokens; they must be equal.")
        with self._lock:
            caches = self._sync_batch(request_ids, group)
            h = self.stage.run_tokens(mx.array(rows, dtype=mx.int32), caches)
            mx.eval(h)
            return h

    def run_batch(self, request_ids: list[str], h: mx.array, group: int = 0) -> mx.array:
        """Any stage, batched decode: h (B, L, D), row i for request_ids[i], in micro-batch `group`;
        L = 1, or 1 + k for a batched speculative pass (proto_spec 05 §3.1). Returns (B, L, D).

        Raises:
            RemoteProtocolError: shape does not match the ids, an id was not prefilled here, a bad group.
        """
        if not request_ids:
            raise RemoteProtocolError("A batched step listed no requests.")
        if h.ndim != 3 or h.shape[0] != len(request_ids) or h.shape[1] < 1:
            raise RemoteProtocolError(
                f"A batched step for {len(request_ids)} requests carried activations of shape {tuple(h.shape)}.")
        with self._lock:
            caches = self._sync_batch(request_ids, group)
            out = self.stage.run_blocks(h, caches)
            mx.eval(out)
            return out

    def head_sample_batch(self, request_ids: list[str], h: mx.array, temperatures: float | list[float] = 0.0) -> list[int]:
        """Head, batched decode: one sampled token per row of h (B, L, D), as `head_sample` per row."""
        temps = [temperatures] * len(request_ids) if isinstance(temperatures, (int, float)) else list(temperatures)
        if len(temps) != len(request_ids) or h.shape[0] != len(request_ids):
            raise RemoteProtocolError(f"A batched sample for {len(request_ids)} requests got {h.shape[0]} rows "
                                      f"and {len(temps)} temperatures.")
        with self._lock:
            logits = self.stage.logits(h)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if all(t == 0 for t in temps):
                return [int(x) for x in mx.argmax(logprobs, axis=-1).tolist()]
            out = []
            for i, t in enumerate(temps):
                sampler = self._samplers.get(t)
                if sampler is None:
                    sampler = self._samplers[t] = make_sampler(temp=t)
                out.append(int(sampler(logprobs[i:i + 1]).item()))
            return out

    def head_sample_rows(self, request_ids: list[str], h: mx.array, samplings: list[Optional[Sampling]],
                         histories: list[Optional[list[int]]]) -> list[tuple[int, TokenLogprobs]]:
        """Head: sample row i of h (B, L, D) for request_ids[i] with its own Sampling.

        Each row is sampled as mlx-lm's `generate_step` samples with `make_logits_processors` and
        `make_sampler` (kafilad/proto/sampling.py, module docstring): logits processors over
        `histories[i]` (the request's prompt and generated ids, of which the last
        `penalty_context_tokens` count), logprobs, then argmax or the filters and a categorical draw
        (the request's own key when it is seeded). A None sampling is greedy. Rows are independent,
        so a batch may mix requests with different parameters.

        Returns:
            [(token_id, TokenLogprobs)] in row order; TokenLogprobs is None unless the row's
            sampling asked for `logprobs`.
        Raises:
            RemoteProtocolError: rows, samplings and histories do not match.
            ValueError: a `logit_bias` token id outside the vocabulary.
        """
        if not (len(samplings) == len(histories) == len(request_ids) == h.shape[0]):
            raise RemoteProtocolError(f"A sample for {len(request_ids)} requests got {h.shape[0]} rows, "
                                      f"{len(samplings)} samplings and {len(histories)} histories.")
        with self._lock:
            logits = self.stage.logits(h)
            return [self._sample_row(r, logits[i:i + 1], s or GREEDY_SAMPLING, hist)
                    for i, (r, s, hist) in enumerate(zip(request_ids, samplings, histories))]

    def _sample_row(self, request_id: str, logits: mx.array, s: Sampling,
                    history: Optional[list[int]]) -> tuple[int, TokenLogprobs]:
        """One row: logits (1, V). See `head_sample_rows`."""
        if s.has_processors:
            procs = self._processors.get(request_id)
            if procs is None:
                vocab = logits.shape[-1]
                bad = [t for t, _ in s.logit_bias if t >= vocab]
                if bad:
                    raise ValueError(f"'logit_bias' names token {bad[0]}, outside this model's vocabulary of "
                                     f"{vocab} tokens.")
                n = s.penalty_context_tokens
                procs = self._processors[request_id] = make_logits_processors(
                    dict(s.logit_bias) or None, s.repetition_penalty, n,
                    s.presence_penalty or None, n, s.frequency_penalty or None, n)
            tokens = mx.array(list(history or [])[-s.penalty_context_tokens:], dtype=mx.int32)
            for p in procs:
                logits = p(tokens, logits)
        if s.grammar is not None:
            if self.grammars is None:
                raise GrammarError("This stage is not the head or has no tokenizer: it cannot apply a grammar.")
            logits = mask_logits(logits, self.grammars.allowed(request_id, s.grammar))
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if s.temperature == 0 or s.top_p == 0:
            token = mx.argmax(logprobs, axis=-1)
        else:
            x = logprobs
            if s.top_p < 1.0:
                x = apply_top_p(x, s.top_p)
            if s.min_p > 0.0:
                x = apply_min_p(x, s.min_p)
            if 0 < s.top_k < x.shape[-1]:
                x = apply_top_k(x, s.top_k)
            if s.seed is None:
                token = categorical_sampling(x, s.temperature)
            else:
                key = self._keys.get(request_id)
                if key is None:
                    key = mx.random.key(s.seed % (1 << 64))
                key, sub = mx.random.split(key)  # the sequence mx.random.seed(seed) gives (module docstring)
                self._keys[request_id] = key
                token = mx.random.categorical(x * (1.0 / s.temperature), key=sub)
        tok = int(token.item())
        if s.grammar is not None:
            self.grammars.consume(request_id, tok)
        if s.logprobs is None:
            return tok, None
        row = logprobs[0]
        best: tuple = ()
        if s.logprobs > 0:
            k = min(s.logprobs, row.shape[-1])
            idx = mx.argpartition(-row, kth=k - 1)[:k]
            vals = row[idx].tolist()
            best = tuple(sorted(zip((int(i) for i in idx.tolist()), (float(v) for v in vals)),
                                key=lambda p: (-p[1], p[0])))
        return tok, (float(row[tok].item()), best)

    def prefix_start(self, request_id: str, entry: str, n_tokens: int) -> None:
        """Start a request's caches from the first `n_tokens` positions of kept `entry` (the prompt
        cache, kafilad/executor/prefix.py; copies: the entry stays as it is).

        Raises:
            RemoteProtocolError: the entry is not here, or holds fewer tokens (the head and this
                stage disagree: the ring must not go on with wrong caches).
        """
        with self._lock:
            if request_id in self._caches or request_id in self.batch_ids:
                raise RemoteProtocolError(f"Request {request_id} already has caches here; it cannot start from "
                                          f"prompt-cache entry {entry}.")
            caches = self.prefix.start(entry, n_tokens)
            if caches is None:
                raise RemoteProtocolError(f"Stage [{self.stage.start}, {self.stage.end}) holds no prompt-cache entry "
                                          f"{entry} of {n_tokens} tokens.")
            self._caches[request_id] = caches

    def prefix_keep(self, request_id: str, n_tokens: int) -> None:
        """End a request keeping its caches as prompt-cache entry `request_id`, cut back to its first
        `n_tokens` positions; its sampler state is forgotten as `drop` forgets it."""
        with self._lock:
            self._take_out_of_batch([request_id])
            caches = self._caches.pop(request_id, None)
            self._processors.pop(request_id, None)
            self._keys.pop(request_id, None)
            if self.grammars is not None:
                self.grammars.drop(request_id)
            if caches is not None and self.stage.prefix_cacheable:
                self.prefix.keep(request_id, caches, n_tokens)

    def prefix_evict(self, entries) -> None:
        """Forget kept prompt-cache entries (unknown ones are ignored)."""
        with self._lock:
            self.prefix.evict(entries)

    def drop(self, request_id: str) -> None:
        """Forget a request's KV caches, single or batched, and its sampler state (no error if unknown)."""
        with self._lock:
            self._caches.pop(request_id, None)
            self._processors.pop(request_id, None)
            self._keys.pop(request_id, None)
            if self.grammars is not None:
                self.grammars.drop(request_id)
            self._take_out_of_batch([request_id], keep_cache=False)


GREEDY_SAMPLING = Sampling()


def _accept(logprobs: mx.array, drafts: list[int], temperature: float) -> list[int]:
    """One row's accepted drafts and next token from its pass's log-probs (k+1, V): greedy
    (`accept_greedy`) at temperature 0, else speculative sampling's rule for point-mass drafts
    (`accept_point_drafts`; `StageRunner.head_verify` states both)."""
    k = len(drafts)
    if temperature == 0:
        return accept_greedy(drafts, [int(x) for x in mx.argmax(logprobs, axis=-1).tolist()])
    probs = mx.softmax(logprobs * (1.0 / temperature), axis=-1)
    idx = mx.array(drafts, dtype=mx.int32)
    p_d = probs[mx.arange(k), idx].tolist() if k else []
    n = accept_point_drafts(p_d, mx.random.uniform(shape=(k,)).tolist() if k else [])
    if n < k:  # the residual: p_n without the rejected draft, renormalised
        row = mx.where(mx.arange(probs.shape[-1]) == drafts[n], 0.0, probs[n])
        nxt = mx.random.categorical(mx.log(row))
    else:
        nxt = categorical_sampling(logprobs[k:k + 1], temperature)
    return list(drafts[:n]) + [int(nxt.item())]


def generate_local(runners: list[StageRunner], prompt_ids: list[int], max_tokens: int, *,
                   temperature: float = 0.0, eos_token_ids: Optional[set[int]] = None,
                   prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
                   request_id: str = "local", wire: bool = True, sampling: Optional[Sampling] = None,
                   draft_k: int = 0, counts: Optional[dict] = None) -> list[int]:
    """Drive a ring of runners in one process (head first), following the module's call sequence.

    A reference for the node's pipeline and the tests: with `wire=True` every hop goes through
    `array_to_wire`/`array_from_wire`, as it does between machines. Returns the generated ids
    (not the prompt), stopping after an EOS id (included) or `max_tokens`. With `sampling`, tokens
    are drawn by `head_sample_rows` (its `temperature` then replaces `temperature`).

    With `draft_k` > 0 (and no `sampling`), decoding speculates as the ring does (proto_spec 05
    §3.1): each pass carries the last token and up to `draft_k` prompt-lookup drafts
    (kafilad/proto/speculation.py `lookup_drafts`), the head accepts them (`head_verify`), and the
    other stages trim the rejected positions before their next pass (`trim`). `counts`, when
    given, gets "passes", "drafted" and "accepted" added up.
    """
    head = runners[0]
    hop = (lambda a: array_from_wire(array_to_wire(a))) if wire else (lambda a: a)
    due = [0]  # positions the other stages take back before the next pass

    def around(chunk: list[int]) -> mx.array:
        h = head.head_embed_and_run(request_id, chunk)
        for r in runners[1:]:
            r.trim(request_id, due[0])
            h = r.run(request_id, hop(h))
        due[0] = 0
        return hop(h)

    if draft_k > 0 and sampling is None:
        from kafilad.proto.speculation import lookup_drafts
        out: list[int] = []
        try:
            chunks = prefill_chunks(prompt_ids, prefill_step_size)
            for chunk in chunks[:-1]:
                around(chunk)
            pending = [head.head_sample(request_id, around(chunks[-1]), temperature)]
            while True:
                for tok in pending:
                    if len(out) >= max_tokens:
                        break
                    out.append(tok)
                    if eos_token_ids and tok in eos_token_ids:
                        return out
                if len(out) >= max_tokens:
                    return out
                drafts = lookup_drafts(list(prompt_ids) + out, min(draft_k, max_tokens - len(out) - 1))
                h = around([out[-1]] + drafts)
                pending = head.head_verify(request_id, h, drafts, temperature)
                due[0] = len(drafts) + 1 - len(pending)
                if counts is not None:
                    for key, v in (("passes", 1), ("drafted", len(drafts)), ("accepted", len(pending) - 1)):
                        counts[key] = counts.get(key, 0) + v
        finally:
            for r in runners:
                r.drop(request_id)

    out: list[int] = []
    try:
        chunks = prefill_chunks(prompt_ids, prefill_step_size)
        for chunk in chunks[:-1]:
            around(chunk)
        h = around(chunks[-1])
        while len(out) < max_tokens:
            if sampling is None:
                tok = head.head_sample(request_id, h, temperature)
            else:
                tok = head.head_sample_rows([request_id], h, [sampling], [list(prompt_ids) + out])[0][0]
            out.append(tok)
            if (eos_token_ids and tok in eos_token_ids) or len(out) >= max_tokens:
                break
            h = around([tok])
    finally:
        for r in runners:
            r.drop(request_id)
    return out
