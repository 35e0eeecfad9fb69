"""The head's speculative decoding state (issue 24 item 1; proto_spec 05 §3.1).

`Drafter` is what the ring driver (kafilad/node/serving/ring.py) asks, per request decoding in the
single form, whether its next pass drafts, which drafts it carries, and how many positions the
other stages take back before its next pass; it keeps each request's `KChooser` and the head's
`SpeculationCounters`. The rules themselves (lookup, acceptance, k) are pure and live in
kafilad/proto/speculation.py; the verification runs in the head's runner (`head_verify`).

A pass's life at the head::

    _sample(req)  ── plan(req) ──▶ k           (k = 0: the fused sample-and-run path may run the pass)
    _send_decode_step ── drafts(req, history) ──▶ d_1..d_m (m <= k; [] sends a plain pass)
                      ── take_trim(req) ──▶ positions the other stages trim first (the act's `trim`)
    the pass returns ── returned(req, now) ──▶ the drafts it carried
    head_verify ── verified(req, m, accepted) : the chooser and counters learn; trim due = m − accepted

A batched step (proto_spec 05 §3.1; each micro-batch group's in turn) speculates as one: at
each batched sampling `plan_batch(rows, group)` decides the k of the group's next pass, if it
carries the same rows, from one `KChooser` per batch size (a pass of B rows costs more than one
of 1, and its cost per extra position grows with B), fed the group's cycles and its rows' mean
acceptance; every row carries the same k drafts (a row whose lookup found fewer is padded with
its last token, which the verification treats like any draft), so the step stays one (B, 1+k, D)
act. `batch_drafts` /
`take_batch_k` + `record_batch` make them, `batch_returned` and `batch_verified` learn from the
pass, and each row's rejected drafts become its trim due, as for a request alone.

Switch: `KAFILA_SPECULATE` = "0"/"off" (never speculate), "auto" (default: k from measured
acceptance and pass cost), or an integer N ≥ 1 (always up to N drafts: for benchmarks).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import attrs

from kafilad.proto.speculation import K_MAX, KChooser, SpeculationCounters, lookup_drafts

#: environment switch (module docstring)
SPECULATE_ENV = "KAFILA_SPECULATE"


def speculation_setting(environ=os.environ) -> Optional[int]:
    """`KAFILA_SPECULATE` read: None for "auto" (the default), 0 for off, N for a fixed k.

    Raises:
        ValueError: any other value (the daemon refuses to start with it).
    """
    raw = environ.get(SPECULATE_ENV, "").strip().lower()
    if raw in ("", "auto", "1", "on", "true", "yes"):
        return None
    if raw in ("0", "off", "false", "no"):
        return 0
    if raw.startswith("k=") and raw[2:].isdigit() and 1 <= int(raw[2:]) <= 64:
        return int(raw[2:])
    raise ValueError(f"{SPECULATE_ENV} must be auto, off, or k=N with 1 <= N <= 64, not {raw!r}.")


@attrs.define
class _Req:
    chooser: KChooser
    planned: int = 0  # k decided at its last sampling for its next pass
    sent: tuple = ()  # the drafts its pass out carries
    trim_due: int = 0  # positions the other stages hold beyond the head's
    last_return_s: Optional[float] = None
    drafted: int = 0
    accepted: int = 0
    passes: int = 0


@attrs.define
class _Batch:
    """One micro-batch group's batched passes: what was planned and sent, and its last return
    (module docstring)."""

    planned_rows: tuple = ()  # the rows `planned` was decided for
    planned: int = 0
    sent_rows: tuple = ()  # the rows of the drafted pass out, and per row its drafts
    sent: tuple = ()
    last_rows: tuple = ()  # the rows of the last returned pass, and when it returned
    last_return_s: Optional[float] = None


class Drafter:
    """Speculation state of the head (module docstring).

    Args:
        setting: `speculation_setting()`: None adaptive, 0 off, N fixed k.
        refusal: why the model cannot speculate (`Stage.speculation_refusal`), or None.
    Attributes:
        counters: the head's totals since the session started (status, /metrics); a batched pass
            counts once per row.
        batch_passes: drafted batched passes (status "batch_passes").
    """

    def __init__(self, setting: Optional[int], refusal: Optional[str]):
        self.setting = setting
        self.refusal = refusal
        #: what proposes the drafts: "prompt lookup", or "draft model NAME" (`host --draft-model`)
        self.source = "prompt lookup"
        self.counters = SpeculationCounters()
        self._reqs: dict[str, _Req] = {}
        self._batches: dict[int, _Batch] = {}  # micro-batch group -> its batched passes' state
        self._batch_choosers: dict[tuple, KChooser] = {}  # (rows B, k_max) -> the chooser of k for B rows
        self.batch_passes = 0

    @property
    def on(self) -> bool:
        return self.setting != 0 and self.refusal is None

    def _state(self, req: str) -> _Req:
        st = self._reqs.get(req)
        if st is None:
            k_max = K_MAX if self.setting is None else self.setting
            st = self._reqs[req] = _Req(KChooser(k_max=k_max if self.on else 0))
        return st

    def plan(self, req: str) -> int:
        """Decide k for the request's next pass (call once per pass, at its sampling)."""
        if not self.on:
            return 0
        st = self._state(req)
        st.planned = st.chooser.choose() if self.setting is None else self.setting
        return st.planned

    def drafts(self, req: str, history: Sequence[int], room: int) -> list[int]:
        """The drafts the request's next pass carries: up to its planned k (at most `room`, the
        tokens it may still produce minus one) looked up in `history` (prompt + output, the token
        being sent last). Records them as sent; [] for a plain pass."""
        k = self.take_k(req, room)
        return self.record(req, lookup_drafts(history, k) if k > 0 else [], k)

    def take_k(self, req: str, room: int) -> int:
        """The number of drafts the request's next pass may carry: its planned k, at most `room`
        (0: a plain pass). A draft model proposes that many (`record` takes them)."""
        st = self._reqs.get(req)
        if st is None or not self.on:
            return 0
        k, st.planned = min(st.planned, max(0, room)), 0
        return k

    def record(self, req: str, drafts: Sequence[int], k: int) -> list[int]:
        """Record `drafts` (proposed for a k of `take_k`) as the ones the request's next pass carries."""
        st = self._reqs.get(req)
        if st is None:
            return []
        out = list(drafts)[:max(0, k)]
        if k > 0 and not out:
            st.chooser.note_no_drafts()
        st.sent = tuple(out)
        return out

    def take_trim(self, req: str) -> int:
        """Positions the other stages take back from the request's caches before its next pass."""
        st = self._reqs.get(req)
        if st is None:
            return 0
        n, st.trim_due = st.trim_due, 0
        return n

    def returned(self, req: str, now_s: float) -> tuple:
        """The request's pass came back: the drafts it carried (() for a plain pass). A plain pass
        is measured here (its cycle since the previous return); a drafted one by `verified`."""
        st = self._reqs.get(req)
        if st is None:
            st = self._state(req)
        sent, st.sent = st.sent, ()
        if not sent:
            if st.last_return_s is not None and self.on:
                cycle = max(0.0, now_s - st.last_return_s)
                st.chooser.note_pass(0, 0, cycle)
                self.counters.note(0, 0, cycle)
            st.last_return_s = now_s
        else:
            st.sent = sent  # until verified
        return sent

    def verified(self, req: str, accepted: int, now_s: float) -> None:
        """The head accepted `accepted` of the drafts the request's pass carried."""
        st = self._state(req)
        k, st.sent = len(st.sent), ()
        cycle = max(0.0, now_s - st.last_return_s) if st.last_return_s is not None else 0.0
        if st.last_return_s is not None:
            st.chooser.note_pass(k, accepted, cycle)
        self._count(st, k, accepted, cycle)
        st.last_return_s = now_s

    def _count(self, st: _Req, k: int, accepted: int, cycle_s: float) -> None:
        """A drafted pass of k drafts for one request, `accepted` of them taken: its rejected drafts
        become its trim due; its record and the counters count the pass."""
        st.trim_due += k - accepted
        st.drafted += k
        st.accepted += accepted
        st.passes += 1
        self.counters.note(k, accepted, cycle_s)

    def forget(self, req: str) -> Optional[dict]:
        """The request ended: its speculation record ({"passes", "drafted", "accepted"}), or None."""
        st = self._reqs.pop(req, None)
        if st is None or not st.passes:
            return None
        return {"passes": st.passes, "drafted": st.drafted, "accepted": st.accepted}

    def forget_all(self) -> None:
        """The ring broke: every request's state goes (the caches it described are dropped)."""
        self._reqs.clear()
        self._batches.clear()

    # ---- a batched step (module docstring) ----------------------------------------------------
    def _batch_chooser(self, rows: int) -> KChooser:
        k_max = K_MAX if self.setting is None else self.setting  # (`kafila-ctl speculate` may change it)
        ch = self._batch_choosers.get((rows, k_max))
        if ch is None:
            ch = self._batch_choosers[(rows, k_max)] = KChooser(k_max=k_max)
        return ch

    def _group(self, group: int) -> _Batch:
        b = self._batches.get(group)
        if b is None:
            b = self._batches[group] = _Batch()
        return b

    def plan_batch(self, reqs: Sequence[str], group: int = 0) -> int:
        """Decide k for micro-batch `group`'s next batched pass, if it carries exactly these rows
        (call once per batched sampling)."""
        b = self._group(group)
        b.planned_rows, b.planned = tuple(reqs), 0
        if not self.on or len(reqs) < 2:
            return 0
        b.planned = self._batch_chooser(len(reqs)).choose() if self.setting is None else self.setting
        return b.planned

    def take_batch_k(self, reqs: Sequence[str], rooms: Sequence[int], group: int = 0) -> int:
        """The drafts each row of `group`'s batched pass of `reqs` may carry: the k planned for
        exactly these rows, at most the smallest `room` (0: a plain step)."""
        b = self._group(group)
        k = b.planned if self.on and tuple(reqs) == b.planned_rows else 0
        b.planned, b.planned_rows = 0, ()
        b.sent_rows, b.sent = (), ()  # a new pass of the group goes out: one is in flight at a time
        return max(0, min([k] + [int(r) for r in rooms]))

    def batch_drafts(self, reqs: Sequence[str], histories: Sequence[Sequence[int]], rooms: Sequence[int],
                     group: int = 0) -> list:
        """Each row's drafts for `group`'s batched pass of `reqs` by prompt lookup in its history
        (prompt + output, the token being sent last), `record_batch`'s equal-length rows; [] for a
        plain step."""
        k = self.take_batch_k(reqs, rooms, group)
        if k <= 0:
            return []
        return self.record_batch(reqs, [lookup_drafts(h, k) for h in histories], k, [h[-1] for h in histories],
                                 group)

    def record_batch(self, reqs: Sequence[str], proposed: Sequence[Sequence[int]], k: int,
                     lasts: Sequence[int], group: int = 0) -> list:
        """Record the drafts `group`'s batched pass of `reqs` carries: every row gets as many as the
        most any row has (at most k), a shorter row padded with its last token (`lasts`). Returns
        the rows' draft lists, or [] (a plain step) when no row has any."""
        rows = [list(p)[:max(0, k)] for p in proposed]
        m = max((len(r) for r in rows), default=0)
        b = self._group(group)
        if m == 0:
            if k > 0:
                self._batch_chooser(len(reqs)).note_no_drafts()
            b.sent_rows, b.sent = (), ()
            return []
        out = [r + [int(last)] * (m - len(r)) for r, last in zip(rows, lasts)]
        b.sent_rows, b.sent = tuple(reqs), tuple(tuple(r) for r in out)
        return out

    def batch_returned(self, reqs: Sequence[str], now_s: float, *, group: int = 0, measure: bool = True) -> tuple:
        """`group`'s batched pass of `reqs` came back: the drafts each row carried (() for a plain
        step). A plain step is measured here (its cycle since the same rows' previous return) when
        `measure` (every row may speculate); a drafted one by `batch_verified`."""
        b = self._group(group)
        reqs = tuple(reqs)
        if b.sent and b.sent_rows == reqs:
            return b.sent
        b.sent_rows, b.sent = (), ()
        if self.on and measure and b.last_rows == reqs and b.last_return_s is not None:
            cycle = max(0.0, now_s - b.last_return_s)
            self._batch_chooser(len(reqs)).note_pass(0, 0, cycle)
            for _ in reqs:
                self.counters.note(0, 0, cycle)
        b.last_rows, b.last_return_s = reqs, now_s
        for r in reqs:  # a row's own (single-form) cycle does not span a batch
            st = self._reqs.get(r)
            if st is not None:
                st.last_return_s = None
        return ()

    def batch_verified(self, reqs: Sequence[str], accepted: Sequence[int], now_s: float, *, group: int = 0) -> None:
        """The head accepted accepted[i] of the drafts row i of `group`'s batched pass carried: each
        row's rejected drafts become its trim due; the chooser for its batch size and the counters
        learn."""
        b = self._group(group)
        reqs = tuple(reqs)
        k = len(b.sent[0]) if b.sent else 0
        b.sent_rows, b.sent = (), ()
        timed = bool(reqs) and b.last_rows == reqs and b.last_return_s is not None
        cycle = max(0.0, now_s - b.last_return_s) if timed else 0.0
        if timed and k:
            self._batch_chooser(len(reqs)).note_pass(k, sum(accepted) / len(reqs), cycle)
        b.last_rows, b.last_return_s = reqs, now_s
        self.batch_passes += 1
        for r, a in zip(reqs, accepted):
            st = self._state(r)
            st.last_return_s = None  # (its own single-form cycle does not span a batch)
            self._count(st, k, a, cycle)

    def status(self) -> dict:
        """For `status`: on or why not, the setting, and the counters."""
        out: dict = {"on": self.on, "k": "auto" if self.setting is None else self.setting, "drafts": self.source}
        if self.refusal is not None:
            out["why"] = self.refusal
        elif self.setting == 0:
            out["why"] = f"{SPECULATE_ENV}=0"
        return {**out, **self.counters.snapshot(), "batch_passes": self.batch_passes}
