"""How many decode micro-batches the head keeps in flight, from measured stage times (DESIGN §6, §5.1).

Pure: no trio, MLX or sockets. `kafilad.proto.scheduler.HeadScheduler` feeds a `StepPolicy` what it
measured on every decode step that returned (its rows B, each stage's compute `dt` from the act's
`hops`, the circuit from the step's decision to its return, and the head's sampling time) and asks
it, whenever it may send a step, how many steps may be in flight for the K requests decoding.

The model (the paper's throughput model T(K) = K / max(Σt + H, P · max t), refined for batches):
a step of B rows costs stage i `t_i(B) = a_i + b_i · B` (least squares over the row counts seen,
each a moving average; `b_i = 0` until two row counts were seen), the head's sampling `h(B)` the
same way, and the circuit outside compute a measured overhead `o` (transfers, encoding, hand-offs).
K requests split into M micro-batches of B = ceil(K / M) rows; each token of every request needs
one pass round the ring, so one *cycle* delivers K tokens and lasts

    cycle(M) = max( C(B),  M · bottleneck(B) )
    C(B)          = Σ_i t_i(B) + o + h(B)                  (one micro-batch's circuit)
    bottleneck(B) = max( max_i t_i(B),  t_head(B) + h(B) ) (the busiest device per micro-batch)

and the predicted tokens/s is K / cycle(M). With flat batch costs (`b = 0`, memory-bound decode:
measured on this CPU, a 4-row step of 8 Llama blocks costs 1.05x a 1-row step) M = 1, lockstep,
is best; with costs that grow with rows (compute-bound devices, e.g. under CPU quotas) several
micro-batches overlap the stages' work and M up to the number of stages wins. M never exceeds
the number of stages P (a further micro-batch would only queue) nor K. A change of M needs a
predicted gain of `HYSTERESIS` (5 %), and leaving lockstep one of `TRIAL_GAIN` (15 %), so noise
does not flip the schedule.

The model assumes the stages run on separate devices. Where they do not (several members share
cores, as on a one-machine test ring), overlapping steps slow each other and the prediction is
wrong; so costs are fitted only from lockstep steps (one step in flight: nothing overlaps it),
and a move from lockstep to M > 1 is a *trial*: for `TRIAL_S` the head measures the tokens/s per
decoding request it achieves and keeps M only if that beats the lockstep rate measured just
before by `TRIAL_MARGIN` (a trial already `EARLY_LOSS` below it after `EARLY_S` is judged then,
so a clear loss costs a quarter of a trial); otherwise it returns to lockstep and waits `BACKOFF_S` (doubling to
`BACKOFF_MAX_S`) before the next trial. A kept M stays watched: when its rate over the last
`BASELINE_S` falls below the lockstep rate its trial beat, the head returns to lockstep (and
backs off) as after a failed trial. Each trial also calibrates the model: its measured gain over
lockstep ÷ the gain it predicted multiplies every later prediction with M > 1 (`overlap_factor`),
so on members that share cores (where overlapping steps gained 0.74x lockstep against a predicted
1.2x) the model stops proposing trials, while on separate devices it keeps its prediction.
Measured on the 2-core dev VM (3 daemons sharing 2 cores, `python scripts/bench_batching.py
--modes lockstep,micro3`): 3 micro-batches in flight ran at 0.38x lockstep, which the trial
catches within `TRIAL_S`; after its first trial the policy stays in lockstep there
(docs/performance.md "Serving schedule").

`KAFILA_MICRO_BATCHES=N` (read by the driver) pins M; `KAFILA_BATCH=0` is per-request pipelining
(every request its own micro-batch, no cap), which the scheduler handles without this policy.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import attrs

#: weight of a new sample in a row count's moving average
EWMA_ALPHA = 0.25
#: relative predicted gain needed before M changes
HYSTERESIS = 0.05
#: predicted gain needed to leave lockstep for a trial: the overlap model's error on members that
#: share cores (3 daemons on 2 cores: 3 micro-batches ran at 0.38x lockstep) is larger than 5 %;
#: costs that grow with rows (compute-bound devices) predict gains of 1.5-3x
TRIAL_GAIN = 0.15
#: how long a trial of M > 1 runs before it is judged (s)
TRIAL_S = 1.0
#: a trial must beat the lockstep rate by this fraction to stay
TRIAL_MARGIN = 0.03
#: a trial is judged early, after EARLY_S, once its rate is this fraction below the lockstep rate:
#: overlapped steps on members that share cores lose 25-60 % (3 daemons on 2 cores: 0.38x, 0.74x),
#: and every second of such a trial is served at that rate
EARLY_LOSS = 0.2
EARLY_S = 0.25
#: the lockstep rate is measured over the last this many seconds
BASELINE_S = 2.0
#: first wait after a failed trial (s), doubled on each failure up to BACKOFF_MAX_S
BACKOFF_S = 10.0
BACKOFF_MAX_S = 160.0
#: name of the head's own entry in the per-stage costs (its embed + blocks, from the act's first hop)
HEAD = "<head>"


@attrs.define
class _Fit:
    """Moving averages of one cost by row count B, and its least-squares line a + b·B."""

    by_rows: dict = attrs.field(factory=dict)  # B -> moving average (s)

    def note(self, rows: int, value_s: float) -> None:
        old = self.by_rows.get(rows)
        self.by_rows[rows] = value_s if old is None else old + EWMA_ALPHA * (value_s - old)

    def line(self) -> tuple[float, float]:
        """(a_s, b_s_per_row), both ≥ 0; b = 0 while fewer than two row counts were seen."""
        pts = sorted(self.by_rows.items())
        if not pts:
            return 0.0, 0.0
        if len(pts) == 1:
            return pts[0][1], 0.0
        n = len(pts)
        mx = sum(b for b, _ in pts) / n
        my = sum(v for _, v in pts) / n
        sxx = sum((b - mx) ** 2 for b, _ in pts)
        b = max(0.0, sum((b - mx) * (v - my) for b, v in pts) / sxx)
        a = max(0.0, my - b * mx)
        return a, b

    def at(self, rows: int) -> float:
        """The cost of a step of `rows` rows (s): the measured average where there is one, else the line."""
        if rows in self.by_rows:
            return self.by_rows[rows]
        a, b = self.line()
        return a + b * rows


@attrs.define
class StepPolicy:
    """Chooses M, the decode micro-batches in flight (module docstring).

    Args:
        stages: P, the ring's stages (the head included); M never exceeds it.
        pinned: a fixed M (`KAFILA_MICRO_BATCHES`), or None to choose from measurements.
    Attributes:
        current: the M last chosen (1 until measurements say otherwise).
    """

    stages: int = 1
    pinned: Optional[int] = None
    current: int = 1
    _stage: dict = attrs.field(factory=dict)  # peer id (HEAD for the head's own hop) -> _Fit
    _sample: _Fit = attrs.field(factory=_Fit)
    _overhead: _Fit = attrs.field(factory=_Fit)
    _order: list = attrs.field(factory=list)  # stage ids as first seen
    _lockstep: list = attrs.field(factory=list)  # [(now_s, tokens, k)] sampled in lockstep, last BASELINE_S
    _trial: Optional[dict] = None  # {"m", "start_s", "baseline", "events": [(now_s, tokens, k)]}
    _kept: Optional[dict] = None  # a kept trial: {"baseline", "events"} (last BASELINE_S at M > 1)
    _blocked_until_s: float = 0.0
    _backoff_s: float = BACKOFF_S
    trials: list = attrs.field(factory=list)  # [(m, trial rate, lockstep rate, kept)] per request-row, for status
    #: measured ÷ predicted gain of the last trial, applied to every prediction with M > 1 (module docstring)
    overlap_factor: float = 1.0

    def note_step(self, rows: int, hops: Iterable[tuple[str, float]], circuit_s: float, *, alone: bool = True) -> None:
        """A decode step of `rows` rows returned: each stage's `dt` (the first hop is the head's) and
        its circuit (s, from the decision to send it to its return). `alone`: no other decode step
        was in flight with it; only such steps are fitted (module docstring)."""
        hops = list(hops)
        if rows < 1 or not hops or not alone:
            return
        total = 0.0
        for i, (pid, dt) in enumerate(hops):
            key = HEAD if i == 0 else str(pid)
            if key not in self._stage:
                self._stage[key] = _Fit()
                self._order.append(key)
            self._stage[key].note(rows, float(dt))
            total += float(dt)
        self._overhead.note(rows, max(0.0, circuit_s - total))

    def note_sampling(self, rows: int, sample_s: float, *, alone: bool = True) -> None:
        """The head sampled a step of `rows` rows in `sample_s` seconds (`alone` as in note_step)."""
        if rows >= 1 and alone:
            self._sample.note(rows, max(0.0, sample_s))

    def note_tokens(self, tokens: int, k: int, now_s: float) -> None:
        """`tokens` were sampled at `now_s` while `k` requests were decoding (the achieved rate)."""
        event = (now_s, tokens, max(1, k))
        if self._trial is not None:
            self._trial["events"].append(event)
        elif self._kept is not None:
            events = self._kept["events"]
            events.append(event)
            while events and events[0][0] < now_s - BASELINE_S:
                events.pop(0)
        elif self.current == 1:
            self._lockstep.append(event)
            while self._lockstep and self._lockstep[0][0] < now_s - BASELINE_S:
                self._lockstep.pop(0)

    @staticmethod
    def _rate(events: list) -> Optional[float]:
        """Tokens/s per decoding request over `events` (None: under half a baseline of data)."""
        if len(events) < 3:
            return None
        span = events[-1][0] - events[0][0]
        if span <= 0:
            return None
        tokens = sum(n for _, n, _ in events[1:])
        mean_k = sum(k for _, _, k in events) / len(events)
        return tokens / span / mean_k

    def predict_tps(self, k: int, m: int) -> Optional[float]:
        """Predicted tokens/s for `k` decoding requests in `m` micro-batches, or None without data."""
        if not self._stage or k < 1 or m < 1:
            return None
        rows = math.ceil(k / m)
        t = {key: fit.at(rows) for key, fit in self._stage.items()}
        h = self._sample.at(rows)
        circuit = sum(t.values()) + self._overhead.at(rows) + h
        members = [v for key, v in t.items() if key != HEAD]
        bottleneck = max(max(members, default=0.0), t.get(HEAD, 0.0) + h)
        cycle = max(circuit, m * bottleneck)
        if cycle <= 0:
            return None
        return k / cycle * (self.overlap_factor if m > 1 else 1.0)

    def choose(self, k: int, now_s: float = 0.0) -> int:
        """M for `k` requests decoding at `now_s` (≥ 1): pinned; or a trial's M until it is judged;
        or the best predicted, kept unless another is `HYSTERESIS` better, a move up from lockstep
        starting a trial (module docstring). Also stored in `current`."""
        if self.pinned is not None:
            self.current = max(1, self.pinned)
            return self.current
        if self._trial is not None:
            return self._judge(now_s)
        if self._kept is not None:
            events = self._kept["events"]
            rate = self._rate(events)
            if rate is not None and events[-1][0] - events[0][0] >= BASELINE_S / 2 and rate < self._kept["baseline"]:
                self.trials.append((self.current, rate, self._kept["baseline"], False))
                del self.trials[:-8]
                return self._back_to_lockstep(now_s)
        limit = max(1, min(self.stages, k))
        if k < 1 or not self._stage:
            return self.current
        now = min(self.current, limit)
        now_tps = self.predict_tps(k, now) or 0.0
        best, best_tps, top_tps = now, now_tps, now_tps
        for m in range(1, limit + 1):
            tps = self.predict_tps(k, m) or 0.0
            top_tps = max(top_tps, tps)
            if tps > best_tps * (1 + HYSTERESIS):
                best, best_tps = m, tps
        if now == 1 and best > 1 and top_tps < now_tps * (1 + TRIAL_GAIN):
            best = 1  # a small predicted gain is within the model's error where members share cores
        if best == 1:
            self._kept = None
        if self.current == 1 and best > 1:
            baseline = self._rate(self._lockstep)
            if baseline is None or now_s < self._blocked_until_s:
                return 1
            self._trial = {"m": best, "start_s": now_s, "baseline": baseline, "events": [],
                           "predicted_gain": best_tps / now_tps if now_tps > 0 else 1.0}
        self.current = best
        return best

    def _judge(self, now_s: float) -> int:
        trial = self._trial
        rate = self._rate(trial["events"])
        if now_s - trial["start_s"] < TRIAL_S:
            losing = rate is not None and rate < trial["baseline"] * (1 - EARLY_LOSS)
            if not losing or now_s - trial["start_s"] < EARLY_S:
                return self.current
        kept = rate is not None and rate >= trial["baseline"] * (1 + TRIAL_MARGIN)
        if rate is not None and trial["baseline"] > 0:  # what overlapping really gave, against the model
            measured_gain = rate / trial["baseline"]
            self.overlap_factor = min(2.0, max(0.1, self.overlap_factor * measured_gain / trial["predicted_gain"]))
        self.trials.append((trial["m"], rate, trial["baseline"], kept))
        del self.trials[:-8]
        self._trial = None
        if kept:
            self._backoff_s = BACKOFF_S
            self._kept = {"baseline": trial["baseline"], "events": []}
            return self.current
        return self._back_to_lockstep(now_s)

    def _back_to_lockstep(self, now_s: float) -> int:
        self.current = 1
        self._kept = None
        self._lockstep.clear()
        self._blocked_until_s = now_s + self._backoff_s
        self._backoff_s = min(BACKOFF_MAX_S, self._backoff_s * 2)
        return 1

    def snapshot(self) -> dict:
        """For status and benchmarks: M, and each cost's line (a_ms, b_ms per row) by stage."""
        def ms(fit: _Fit) -> list:
            a, b = fit.line()
            return [round(a * 1e3, 3), round(b * 1e3, 3)]
        return {"micro_batches": self.current, "pinned": self.pinned, "trial": bool(self._trial),
                "overlap_factor": round(self.overlap_factor, 3),
                "trials": [[m, None if r is None else round(r, 3), round(b, 3), kept] for m, r, b, kept in self.trials],
                "stage_ms": {key: ms(self._stage[key]) for key in self._order},
                "sample_ms": ms(self._sample), "overhead_ms": ms(self._overhead)}
