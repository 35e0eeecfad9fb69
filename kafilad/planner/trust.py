"""Members checked against what they do (issue 22 item 5; docs/cost-model.md "Reports checked against
measurement"; DESIGN §5.1).

A member's capability report (memory, `bandwidth_Bps`, `step_overhead_s`, ...) is its word: the
planner divides the model by it. Once the ring serves, the head measures every stage's decode step
time (`decode_compute_s_median` of the `end` frame's statistics, proto_spec 05 §3). This module
compares, per member and per plan, the measured step time with what the cost model predicted from
the figures the plan used, and decides:

* **off**: over at least MIN_STEPS decode steps of that plan, measured / predicted lies outside
  [RATIO_LOW, RATIO_HIGH] = [1/2, 2] and the two differ by more than SLACK_S. The host then plans
  again with the member's figures *derived from measurement*: its time figures scaled by the ratio
  (`derived_device`), so the cost model predicts what was measured.
* **confirmed**: the same number of steps lie within the bound. Only the host and confirmed members
  may be the head under `host --head auto` (`head_allowed`): the head sees every prompt and samples
  every token, so no member becomes it on its word alone. A confirmed member the plan held back
  from heading gets a new plan when it would save at least REHEAD_GAIN (25%) per token; otherwise
  it may head from the session's next plan (a member joined, returned or was lost).

Why [1/2, 2]: the cost model predicts a stage's step time within ~6% median error and 21% at worst
per run on an emulated fleet (docs/cost-model.md), and a loaded machine's stage times vary by
±15-20% run to run. A factor of 2 is beyond three times that worst error, so an honest member is
not replanned around, while a report off by 2x or more (which moves the division by a block or
more and decides who is head) is. MIN_STEPS (16) decode steps make the median robust to a few
slow steps (a garbage collection, a page fault); SLACK_S (2 ms) ignores differences no division
would notice and that timer and scheduler noise of a loaded machine reach on sub-millisecond
stages. Only requests that decoded alone (batch rows 1) are counted: a batched step's time depends
on the rows and on `batch_row_cost`, itself a report.

`host --head any` trusts the reports instead (a group whose machines are all its own, a fleet
emulated by reported figures): the verdicts are recorded and shown, nothing is acted on.

Stage times in `hops` are reported by each stage itself, so a member that lies about its step times
too is not caught by this check; its circuit time (measured by the head) still shows it. Pure: no
I/O, no clock.
"""

from __future__ import annotations

from typing import Iterable, Optional

import attrs

from kafilad.planner.records import Device

#: measured / predicted stage time outside [RATIO_LOW, RATIO_HIGH]: the report is off (module docstring)
RATIO_LOW = 0.5
RATIO_HIGH = 2.0
#: decode steps of one plan a member's stage must have run before it is judged
MIN_STEPS = 16
#: seconds: a measured and predicted step time closer than this are never "off"
SLACK_S = 0.002
#: a member held back from heading (Plan.held_back) that is then confirmed gets a new plan only when
#: it would save at least this fraction per token: a new head reloads every stage (seconds) and lets
#: the running requests drain first, which a few percent do not repay
REHEAD_GAIN = 0.25


@attrs.frozen
class Verdict:
    """A judgement of one member's report under one plan.

    Attributes:
        name: the member. outcome: "confirmed" or "off".
        ratio: measured / predicted step time. measured_s, predicted_s: seconds per decode step.
        steps: decode steps the measurement covers. scale: the member's cumulative correction
            after this verdict (1.0: its report as sent).
    """

    name: str
    outcome: str
    ratio: float
    measured_s: float
    predicted_s: float
    steps: int
    scale: float


def judge(measured_s: float, predicted_s: float, steps: int) -> Optional[str]:
    """"off", "confirmed" or None (fewer than MIN_STEPS steps, or no prediction) for one member's
    measured against predicted step time, seconds (the module docstring's rule)."""
    if steps < MIN_STEPS or not predicted_s or predicted_s <= 0 or measured_s is None or measured_s < 0:
        return None
    ratio = measured_s / predicted_s
    if (ratio < RATIO_LOW or ratio > RATIO_HIGH) and abs(measured_s - predicted_s) > SLACK_S:
        return "off"
    return "confirmed"


def derived_device(d: Device, scale: float) -> Device:
    """`d` with its time figures scaled by `scale` (measured / predicted): bandwidth_Bps and
    flops_per_s divided by it, step_overhead_s multiplied, so every stage time the cost model
    predicts for it (DESIGN §5.1, `step_overhead_s + work / rate`) is `scale` times the reported one.
    Memory, NAT class and dtype are kept. `scale` 1.0 returns `d`."""
    if scale == 1.0:
        return d
    return attrs.evolve(d, bandwidth_Bps=None if d.bandwidth_Bps is None else d.bandwidth_Bps / scale,
                        flops_per_s=None if d.flops_per_s is None else d.flops_per_s / scale,
                        step_overhead_s=d.step_overhead_s * scale)


def _weighted_median(samples: list[tuple[int, float]]) -> float:
    """The median of per-request medians, each counted `steps` times."""
    ordered = sorted(samples, key=lambda s: s[1])
    half, seen = sum(s for s, _ in ordered) / 2.0, 0
    for steps, value in ordered:
        seen += steps
        if seen >= half:
            return value
    return ordered[-1][1]


@attrs.define
class MemberChecks:
    """The host's record of every member's report against its measured stage (module docstring).

    Attributes:
        exempt: names never judged (the host: its own probe ran on this machine).
        predicted_s: name -> predicted step time of the current plan, seconds (Plan.stage_s).
        epoch: the plan `predicted_s` and the samples belong to (any hashable key: the host uses its
            epoch and MakePlan sequence number, since a plan kept without reloading predicts anew).
        samples: name -> [(decode steps, median step s)] of the current plan's unbatched requests.
        scale: name -> cumulative correction applied to the member's report (absent: 1.0).
        confirmed: names whose stage ran within the bound under some plan (kept until judged off).
        last: name -> the latest Verdict; judged_in: name -> the plan epoch it was reached in.
    """

    exempt: frozenset = frozenset()
    predicted_s: dict = attrs.field(factory=dict)
    epoch: object = None
    samples: dict = attrs.field(factory=dict)
    scale: dict = attrs.field(factory=dict)
    confirmed: set = attrs.field(factory=set)
    last: dict = attrs.field(factory=dict)
    #: name -> the plan epoch of its latest verdict
    judged_in: dict = attrs.field(factory=dict)

    def new_plan(self, epoch, predicted_s: dict) -> None:
        """Plan `epoch` serves with these predicted stage times (name -> s): samples start afresh."""
        if epoch != self.epoch:
            self.epoch, self.predicted_s, self.samples = epoch, dict(predicted_s), {}

    def observe(self, epoch, stats: Iterable[tuple[str, int, float]], batch_rows: Optional[float] = None
                ) -> list[Verdict]:
        """One finished request's stage times under plan `epoch`: (name, decode steps, median step s)
        per stage. Returns the verdicts it newly reaches: a member's first "confirmed" under this
        plan, or "off" (its samples then start afresh and its `scale` is updated). Requests of an
        earlier plan, or batched ones (`batch_rows` > 1), count for nothing."""
        if epoch != self.epoch or (batch_rows is not None and batch_rows > 1):
            return []
        out = []
        for name, steps, median_s in stats:
            if name in self.exempt or name not in self.predicted_s or median_s is None or int(steps) <= 0:
                continue
            prior = self.last.get(name) if self.judged_in.get(name) == self.epoch else None
            if prior is not None and prior.outcome == "off":
                continue  # judged off under this plan: the next plan (its figures scaled) is judged afresh
            got = self.samples.setdefault(name, [])
            got.append((int(steps), float(median_s)))
            total = sum(s for s, _ in got)
            measured = _weighted_median(got)
            predicted = float(self.predicted_s[name])
            outcome = judge(measured, predicted, total)
            if outcome is None:
                continue
            ratio = measured / predicted
            if outcome == "confirmed" and prior is not None:  # confirmed under this plan already: figures move
                self.last[name] = attrs.evolve(prior, ratio=ratio, measured_s=measured, steps=total)
                continue
            if outcome == "off":
                self.scale[name] = self.scale.get(name, 1.0) * ratio
                self.confirmed.discard(name)
            else:
                self.confirmed.add(name)
            v = Verdict(name, outcome, ratio, measured, predicted, total, self.scale.get(name, 1.0))
            self.last[name] = v
            self.judged_in[name] = self.epoch
            out.append(v)
        return out

    def device(self, d: Device) -> Device:
        """The device as the planner should count it: its report scaled by its correction."""
        return derived_device(d, self.scale.get(d.name, 1.0))

    def head_allowed(self, names: Iterable[str]) -> frozenset:
        """Who may be the head under `host --head auto`: the exempt (the host) and the confirmed."""
        return frozenset(n for n in names if n in self.exempt or n in self.confirmed)

    def forget(self, name: str) -> None:
        """A member left for good or rejoined with a new report: judge it afresh."""
        for table in (self.samples, self.scale, self.last, self.judged_in):
            table.pop(name, None)
        self.confirmed.discard(name)

    def status(self, name: str) -> Optional[dict]:
        """{scale, confirmed, ratio, measured_s, predicted_s, steps, outcome} for `status`, or None."""
        v = self.last.get(name)
        if v is None and name not in self.scale:
            return None
        out = {"scale": self.scale.get(name, 1.0), "confirmed": name in self.confirmed}
        if v is not None:
            out.update(outcome=v.outcome, ratio=v.ratio, measured_s=v.measured_s, predicted_s=v.predicted_s,
                       steps=v.steps)
        return out
