"""Speculative decoding across the ring: drafting, acceptance and the choice of k (issue 24 item 1).

Pure: no MLX, trio or sockets. The head's driver (kafilad/node/serving/drafts.py) asks `lookup_drafts`
for up to k draft tokens, sends the last sampled token plus the drafts round the ring as one pass
(proto_spec 05 §3.1), and the head's runner (kafilad/executor/runner.py `head_verify`) accepts
them by the rules below, with the model's own logits at every position of that pass.

Drafting by prompt lookup (n-gram lookup, no extra model; as mlx-lm's and vLLM's "prompt lookup
decoding"): the last n tokens of the request's prompt + output are searched for at an earlier
place of the same sequence, n from `max_ngram` down to `min_ngram`; the most recent earlier match
wins, and the up-to-k tokens that followed it there are the drafts.

Acceptance (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
§2.3; mlx_lm/generate.py `speculative_generate_step` for greedy):
- greedy: the longest prefix of the drafts equal to the model's argmax at each position, plus
  one token: the model's argmax after that prefix (a correction, or a bonus when all matched).
  The output is the model's greedy output token for token.
- sampling with draft distribution q: draft d_i is accepted with probability min(1, p_i(d_i) /
  q_i(d_i)); at the first rejection a token is drawn from norm(max(0, p_i − q_i)); when all are
  accepted one more is drawn from p_{k}. A lookup draft is a point mass (q(d) = 1), so d is
  accepted with probability p(d) and the residual is p without d, renormalised. The output
  distribution is exactly the model's.

Choosing k (`KChooser`): with a per-draft acceptance rate a (measured, a moving average) a pass
with k drafts yields E(k) = (1 − a^(k+1)) / (1 − a) tokens (the paper's eq. 1), and costs c(k) =
c0 + c1·k seconds (c0: a one-token pass, c1: each extra position, both measured moving averages
of the pass's circuit at the head). k maximises E(k) / c(k) among 0..k_max; k = 0 (no drafting)
when nothing beats one token per c0. Until a drafted pass has measured c1, k is at most
`K_FIRST`: the first drafted pass must not pay k_max positions where a position is dear (MLX's
4-bit matmul on a CPU costs about L times a one-token pass for L positions). A request whose chooser picked 0 re-probes with k = 1
after a back-off of passes that doubles each time the probe does not pay (so a miss prompt pays
for a probe rarely), and resets when one does. c0 is measured by plain passes: the first ones of
a request, and one after every `remeasure` drafted passes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import attrs

#: the most drafts a pass carries
K_MAX = 8
#: the most drafts before a drafted pass has measured the cost of a position (module docstring)
K_FIRST = 2
#: n-gram lengths the lookup tries, longest first
MAX_NGRAM = 3
MIN_NGRAM = 2
#: the moving averages' weight of a new observation
EMA = 0.2
#: the back-off (passes) before the first re-probe, and its cap
PROBE_BACKOFF = 4
PROBE_BACKOFF_MAX = 256
#: speculation must beat plain decoding's expected tokens per second by this factor to be chosen
MARGIN = 1.05


def lookup_drafts(tokens: Sequence[int], k: int, *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM,
                  window: int = 4096) -> list[int]:
    """Up to `k` draft tokens by prompt lookup (module docstring).

    Args:
        tokens: the request's prompt and output so far; its last token is the one just sampled.
        k: the most drafts wanted (0 gives []).
        max_ngram, min_ngram: the n-gram lengths tried, longest first.
        window: only the last `window` tokens are searched (bounds the cost per pass).
    Returns:
        The tokens that followed the most recent earlier occurrence of the longest matching
        suffix n-gram (at most k; [] when no n-gram of min_ngram or more recurs).
    Raises:
        ValueError: k < 0 or 1 > min_ngram or min_ngram > max_ngram.
    """
    if k < 0 or not 1 <= min_ngram <= max_ngram:
        raise ValueError("lookup_drafts needs k >= 0 and 1 <= min_ngram <= max_ngram.")
    seq = list(tokens[-window:])
    n_tok = len(seq)
    if k == 0 or n_tok < 2:
        return []
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = seq[n_tok - n:]
        first = suffix[0]
        # the latest start i < n_tok - n with seq[i:i+n] == suffix and at least one token after it
        for i in range(n_tok - n - 1, -1, -1):
            if seq[i] == first and seq[i:i + n] == suffix:
                return seq[i + n:i + n + k]
    return []


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a greedy pass yields (module docstring).

    Args:
        drafts: the k drafted tokens d_1..d_k sent after the last sampled token.
        targets: the model's argmax at each of the pass's k+1 positions (targets[i] follows the
            pass's token i: the last sampled token, then d_1..d_k).
    Returns:
        targets[0..n]: the n accepted drafts (each equal to its target) and the next token; 1 to
        k+1 tokens.
    Raises:
        ValueError: len(targets) != len(drafts) + 1.
    """
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} targets, not {len(targets)}.")
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return [int(t) for t in targets[:n + 1]]


def accept_point_drafts(p_drafts: Sequence[float], uniforms: Sequence[float]) -> int:
    """How many point-mass drafts speculative sampling accepts (module docstring).

    Args:
        p_drafts: p_i(d_i), the model's probability (after temperature) of each draft at its position.
        uniforms: one U(0, 1) draw per draft.
    Returns:
        n: drafts 1..n are accepted (draft i is accepted when uniforms[i] < p_i(d_i)), 0 <= n <= k.
        The caller then draws the next token from p_n without d_{n+1} renormalised (n < k), or
        from p_k (n = k).
    Raises:
        ValueError: the sequences differ in length.
    """
    if len(p_drafts) != len(uniforms):
        raise ValueError("accept_point_drafts needs one uniform draw per draft.")
    n = 0
    while n < len(p_drafts) and uniforms[n] < p_drafts[n]:
        n += 1
    return n


def expected_tokens(accept_rate: float, k: int) -> float:
    """E(k) = 1 + a + ... + a^k: tokens a pass of k drafts yields when each is accepted with
    probability a independently (Leviathan et al. eq. 1)."""
    a = min(max(accept_rate, 0.0), 1.0)
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def best_k(accept_rate: float, c0_s: float, c1_s: float, k_max: int = K_MAX) -> int:
    """The k in 0..k_max that maximises E(k) / (c0_s + c1_s·k); 0 unless it beats one token per
    c0_s by MARGIN. Ties go to the smaller k."""
    c0 = max(c0_s, 1e-9)
    c1 = max(c1_s, 0.0)
    best, rate = 0, MARGIN / c0
    for k in range(1, k_max + 1):
        r = expected_tokens(accept_rate, k) / (c0 + c1 * k)
        if r > rate * (1 + 1e-12):
            best, rate = k, r
    return best


@attrs.define
class KChooser:
    """One request's measured acceptance and pass cost, and the k they choose (module docstring).

    Attributes:
        k_max: the most drafts (0: speculation off for this request).
        accept_rate: moving average of drafts accepted / drafts sent (starts optimistic).
        c0_s: moving average of a plain (one-token) pass's circuit (s); None until measured.
        c1_s: moving average of each extra position's cost (s).
        backoff: plain passes before the next probe, after k = 0 was chosen.
        remeasure: a plain pass is sent after this many drafted ones, to keep c0_s current.
    """

    k_max: int = K_MAX
    accept_rate: float = 0.7
    c0_s: Optional[float] = None
    c1_s: float = 0.0
    backoff: int = PROBE_BACKOFF
    remeasure: int = 32
    _wait: int = 0
    _probing: bool = False
    _since_plain: int = 0
    _c1_measured: bool = False

    def choose(self) -> int:
        """k for the next pass (0..k_max): a plain pass while c0 is unmeasured or stale, 0 while
        backing off, 1 for a probe after the back-off, else `best_k`."""
        if self.k_max <= 0:
            return 0
        if self._wait > 0:
            self._wait -= 1
            return 0
        if self._probing:
            return 1
        if self.c0_s is None or self._since_plain >= self.remeasure:
            return 0
        k = best_k(self.accept_rate, self.c0_s, self.c1_s, self.k_max)
        if not self._c1_measured:
            k = min(k, K_FIRST)
        if k == 0:
            self._wait = self.backoff
            self._probing = True
        return k

    def note_pass(self, k: int, accepted: int, circuit_s: float) -> None:
        """One returned pass of `k` drafts (0: a plain pass), `accepted` of them taken, its circuit
        (s) from sending to return.

        Raises:
            ValueError: accepted outside 0..k, or a negative circuit.
        """
        if not 0 <= accepted <= k or circuit_s < 0:
            raise ValueError(f"A pass of {k} drafts cannot have {accepted} accepted in {circuit_s} s.")
        if k == 0:
            self._since_plain = 0
            self.c0_s = circuit_s if self.c0_s is None else self.c0_s + EMA * (circuit_s - self.c0_s)
            return
        self._since_plain += 1
        self.accept_rate += EMA * (accepted / k - self.accept_rate)
        if self.c0_s is not None:
            extra = max(0.0, (circuit_s - self.c0_s) / k)
            self.c1_s = extra if not self._c1_measured else self.c1_s + EMA * (extra - self.c1_s)
            self._c1_measured = True
        if self._probing:
            self._end_probe(best_k(self.accept_rate, self.c0_s or 1.0, self.c1_s, self.k_max) > 0)

    def note_no_drafts(self) -> None:
        """The lookup found nothing to draft (the pass goes plain, and `note_pass(0, ...)` follows):
        it counts as one draft refused, so a sequence that never recurs drives k to 0."""
        self.accept_rate += EMA * (0.0 - self.accept_rate)
        if self._probing:
            self._end_probe(False)

    def _end_probe(self, paid: bool) -> None:
        """A probe after k = 0 paid (back to choosing k) or not (the back-off doubles)."""
        if paid:
            self._probing = False
            self.backoff = PROBE_BACKOFF
        else:
            self.backoff = min(self.backoff * 2, PROBE_BACKOFF_MAX)
            self._wait = self.backoff


@attrs.define
class SpeculationCounters:
    """A head's speculation totals, for `status`, the trace and /metrics.

    Attributes:
        passes: decode passes that carried drafts; drafted: drafts sent; accepted: drafts taken;
        tokens: tokens those passes yielded (accepted + one each); plain_passes: decode passes
        of requests that could speculate but sent none; drafted_s, plain_s: the cycles (s, from
        the request's previous return to this one) of each kind.
    """

    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    plain_passes: int = 0
    drafted_s: float = 0.0
    plain_s: float = 0.0

    def note(self, k: int, accepted: int, cycle_s: float = 0.0) -> None:
        """One pass of k drafts (0: plain), `accepted` taken, `cycle_s` long."""
        if k == 0:
            self.plain_passes += 1
            self.plain_s += cycle_s
            return
        self.passes += 1
        self.drafted += k
        self.accepted += accepted
        self.tokens += accepted + 1
        self.drafted_s += cycle_s

    @property
    def acceptance(self) -> float:
        """Drafts accepted / drafts sent (0.0 when none was sent)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens per decode pass over all passes (speculating or not; 1.0 when none)."""
        n = self.passes + self.plain_passes
        return (self.tokens + self.plain_passes) / n if n else 1.0

    @property
    def gain(self) -> Optional[float]:
        """Tokens per second of drafted passes ÷ that of plain passes (None until both were timed)."""
        if not (self.drafted_s > 0 and self.plain_s > 0 and self.plain_passes):
            return None
        return (self.tokens / self.drafted_s) / (self.plain_passes / self.plain_s)

    def snapshot(self) -> dict:
        gain = self.gain
        return {"passes": self.passes, "drafted": self.drafted, "accepted": self.accepted, "tokens": self.tokens,
                "plain_passes": self.plain_passes, "acceptance": round(self.acceptance, 4),
                "tokens_per_pass": round(self.tokens_per_pass, 4),
                "gain": None if gain is None else round(gain, 3)}
