"""A request's sampling parameters, as the head's sampler takes them (DESIGN §6; proto_spec 05 §2 `gen`).

The HTTP APIs (kafilad/control/openai_api.py, ollama_api.py) turn a request's fields into one
:class:`Sampling`; the host hands it to the head, in its own process
(kafilad/node/serving/ring.py `RingMember.generate`) or in the `gen` control frame's optional `sampling`
map to a remote head (kafilad/proto/control.py `Gen`), where :meth:`Sampling.from_wire` checks it
on receipt. The head's runner (kafilad/executor/runner.py `StageRunner.head_sample_rows`) applies
it exactly as mlx-lm's `generate_step` applies `make_logits_processors` and `make_sampler`:

```
logits (1, V) of the last position
  -> logit_bias, repetition_penalty, presence_penalty, frequency_penalty   (mlx_lm.sample_utils processors,
                                                                           over the last `penalty_context_tokens`
                                                                           of prompt + generated tokens)
  -> grammar: tokens the request's grammar forbids get -inf      (constrained decoding, issue 23 item 2:
                                                                   kafilad/executor/grammar.py, llguidance)
  -> logprobs = logits - logsumexp(logits)         (what `logprobs` reports: chosen + `logprobs` best)
  -> temperature 0: argmax; else top_p, min_p, top_k filters, then categorical(logprobs / temperature)
     drawn with the request's own key when `seed` is set: key(seed) split once per token, the sequence
     mx.random.seed(seed) gives mlx-lm, so a seeded request draws the same tokens alone or in a batch.
```

Wire form (a frame-layer map; keys at their defaults may be left out; unknown keys are refused,
because a head that ignored a parameter would silently sample otherwise than the client asked):

```
{"temperature": float >= 0, "top_p": float in [0, 1], "top_k": int >= 0, "min_p": float in [0, 1],
 "seed": int | null, "presence_penalty": float, "frequency_penalty": float,
 "repetition_penalty": float > 0 | null, "penalty_context_tokens": int >= 1,
 "logit_bias": [[token_id, bias], ...], "logprobs": int in [0, 20] | null,
 "grammar": str | null}                 an llguidance grammar (JSON), at most MAX_GRAMMAR_BYTES
```
Pure: no trio, sockets or mlx (tests/test_import_boundary.py).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import attrs

from kafilad.errors import RemoteProtocolError

#: mlx-lm's default window of its penalty processors (tokens), also the default of mlx_lm.server
PENALTY_CONTEXT_TOKENS = 20
#: most alternatives a token's log-probability report may list (OpenAI's `top_logprobs` limit)
MAX_LOGPROBS = 20
#: largest |bias| of one `logit_bias` entry (OpenAI's range)
MAX_LOGIT_BIAS = 100.0
#: most `logit_bias` entries one request may carry
MAX_LOGIT_BIAS_ENTRIES = 1024
#: largest grammar (UTF-8 bytes of its llguidance JSON) one request may carry
MAX_GRAMMAR_BYTES = 256 * 1024


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@attrs.frozen
class Sampling:
    """How the head picks each token of one request (module docstring for the order of operations).

    Attributes:
        temperature: 0 is greedy (argmax); above 0 the logprobs are divided by it and sampled.
        top_p: nucleus sampling, kept mass in (0, 1); 1 keeps everything, 0 keeps only the best token.
        top_k: keep the k best tokens (0: off). min_p: keep tokens above min_p x the best one's
            probability (0: off).
        seed: the request's own random key (None: the process's random state).
        presence_penalty, frequency_penalty: subtracted from the logit of a token once, or once per
            occurrence, among the last `penalty_context_tokens` tokens (0: off).
        repetition_penalty: mlx-lm's multiplicative penalty over the same window (None: off).
        logit_bias: (token_id, bias) pairs added to the logits.
        logprobs: report the chosen token's log-probability and this many best alternatives
            (None: report nothing).
        grammar: the llguidance grammar (a JSON string, e.g. `LLMatcher.grammar_from_json_schema`)
            every token must keep the output within (None: free text); made by the HTTP APIs from
            `response_format`, Ollama's `format` and forced tool calls (kafilad/control/grammars.py).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: Optional[float] = None
    penalty_context_tokens: int = PENALTY_CONTEXT_TOKENS
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: Optional[int] = None
    grammar: Optional[str] = None

    def __attrs_post_init__(self) -> None:
        problem = _problem(self)
        if problem:
            raise ValueError(problem)

    @property
    def plain(self) -> bool:
        """True when only the temperature matters (the runner's original, token-identical path)."""
        return (not self.has_processors and self.logprobs is None and self.seed is None and self.top_p >= 1.0
                and self.top_k == 0 and self.min_p == 0.0 and self.grammar is None)

    @property
    def has_processors(self) -> bool:
        """True when a logits processor (bias or penalty) runs before sampling."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty is not None)

    @property
    def needs_history(self) -> bool:
        """True when the sampler reads the request's recent tokens (a penalty is set)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty is not None)

    def to_wire(self) -> dict:
        """The wire map (module docstring): only keys that differ from their defaults."""
        out: dict = {}
        for a in attrs.fields(Sampling):
            v = getattr(self, a.name)
            if v != a.default:
                out[a.name] = [list(p) for p in v] if a.name == "logit_bias" else v
        return out

    @classmethod
    def from_wire(cls, d: Any) -> "Sampling":
        """The Sampling of a received map, checked field by field.

        Raises:
            RemoteProtocolError: not a map, an unknown key, or a value of the wrong type or range
                (the message names the key).
        """
        if not isinstance(d, dict):
            raise RemoteProtocolError("malformed sampling map: it is not a map")
        names = {a.name for a in attrs.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in names)
        if unknown:
            raise RemoteProtocolError(f"the sampling parameter(s) {', '.join(repr(k) for k in unknown)} are not "
                                      "known to this head (an older version); upgrade kafilad on it")
        kw = dict(d)
        if "logit_bias" in kw:
            pairs = kw["logit_bias"]
            if not isinstance(pairs, (list, tuple)) or not all(
                    isinstance(p, (list, tuple)) and len(p) == 2 and _integer(p[0]) and _number(p[1]) for p in pairs):
                raise RemoteProtocolError("malformed sampling map: 'logit_bias' is not a list of [token_id, bias]")
            kw["logit_bias"] = tuple((int(t), float(b)) for t, b in pairs)
        for key in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            if key in kw and not _number(kw[key]):
                raise RemoteProtocolError(f"malformed sampling map: '{key}' is {_short(kw[key])}")
        for key in ("top_k", "penalty_context_tokens"):
            if key in kw and not _integer(kw[key]):
                raise RemoteProtocolError(f"malformed sampling map: '{key}' is {_short(kw[key])}")
        for key, check in (("seed", _integer), ("logprobs", _integer), ("repetition_penalty", _number),
                           ("grammar", lambda v: isinstance(v, str))):
            if kw.get(key) is not None and not check(kw[key]):
                raise RemoteProtocolError(f"malformed sampling map: '{key}' is {_short(kw[key])}")
        try:
            return cls(**kw)
        except ValueError as e:
            raise RemoteProtocolError(f"malformed sampling map: {e}") from None


def _problem(s: Sampling) -> Optional[str]:
    """The first out-of-range field of `s`, as a sentence without its final period, or None."""
    if not (_number(s.temperature) and s.temperature >= 0):
        return f"'temperature' must be a finite number of at least 0 (got {s.temperature!r})"
    for key in ("top_p", "min_p"):
        v = getattr(s, key)
        if not (_number(v) and 0.0 <= v <= 1.0):
            return f"'{key}' must be between 0 and 1 (got {v!r})"
    if not (_integer(s.top_k) and s.top_k >= 0):
        return f"'top_k' must be an integer of at least 0 (got {s.top_k!r})"
    for key in ("presence_penalty", "frequency_penalty"):
        if not _number(getattr(s, key)):
            return f"'{key}' must be a finite number (got {getattr(s, key)!r})"
    if s.repetition_penalty is not None and not (_number(s.repetition_penalty) and s.repetition_penalty > 0):
        return f"'repetition_penalty' must be a finite number above 0 (got {s.repetition_penalty!r})"
    if not (_integer(s.penalty_context_tokens) and s.penalty_context_tokens >= 1):
        return f"'penalty_context_tokens' must be an integer of at least 1 (got {s.penalty_context_tokens!r})"
    if s.seed is not None and not _integer(s.seed):
        return f"'seed' must be an integer (got {s.seed!r})"
    if s.logprobs is not None and not (_integer(s.logprobs) and 0 <= s.logprobs <= MAX_LOGPROBS):
        return f"'logprobs' must be an integer between 0 and {MAX_LOGPROBS} (got {s.logprobs!r})"
    if s.grammar is not None and not (isinstance(s.grammar, str) and s.grammar
                                      and len(s.grammar.encode("utf-8", "surrogatepass")) <= MAX_GRAMMAR_BYTES):
        return f"'grammar' must be a non-empty string of at most {MAX_GRAMMAR_BYTES} bytes"
    if len(s.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        return f"'logit_bias' may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries (got {len(s.logit_bias)})"
    seen = set()
    for t, b in s.logit_bias:
        if not (_integer(t) and t >= 0):
            return f"'logit_bias' token ids must be integers of at least 0 (got {t!r})"
        if t in seen:
            return f"'logit_bias' lists token {t} twice"
        seen.add(t)
        if not (_number(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS):
            return f"'logit_bias' values must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g} (got {b!r})"
    return None


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


#: the sampling of a request that gives only a temperature (and of `kafila-ctl generate`)
GREEDY = Sampling()

__all__ = ["Sampling", "GREEDY", "PENALTY_CONTEXT_TOKENS", "MAX_LOGPROBS", "MAX_LOGIT_BIAS"]
