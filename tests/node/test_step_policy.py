"""The decode micro-batch policy without MLX or sockets (kafilad/proto/step_policy.py; DESIGN §6, §5.1)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafilad.proto import step_policy
from kafilad.proto.step_policy import BACKOFF_S, TRIAL_S, StepPolicy


def fed(costs_ms, *, rows=(1, 2, 4), overhead_ms=1.0, sample_ms=0.0, stages=3) -> StepPolicy:
    """A policy that saw lockstep steps of `rows` rows; costs_ms[i](B) is stage i's step time (ms),
    stage 0 the head."""
    p = StepPolicy(stages=stages)
    for b in rows:
        hops = [(f"p{i}", f(b) / 1e3) for i, f in enumerate(costs_ms)]
        p.note_step(b, hops, sum(dt for _, dt in hops) + overhead_ms / 1e3)
        p.note_sampling(b, sample_ms / 1e3)
    return p


def test_flat_costs_predict_lockstep_best():
    p = fed([lambda b: 5.0] * 3)
    # B rows cost what one row costs: one step of 4 rows per circuit of 3 x 5 + 1 ms
    assert p.predict_tps(4, 1) == pytest.approx(4 / 0.016)
    assert p.predict_tps(4, 2) == pytest.approx(4 / 0.016)  # cycle max(16 ms, 2 x 5 ms): no gain
    assert p.choose(4, now_s=0.0) == 1


def test_linear_costs_predict_the_model_exactly():
    p = fed([lambda b: 1.0 + 4.0 * b] * 3, overhead_ms=3.0, sample_ms=0.0)
    # K = 6 in M = 3 micro-batches of 2 rows: stage 9 ms, circuit 27 + 3 = 30 ms, 3 x 9 = 27 -> cycle 30 ms
    assert p.predict_tps(6, 3) == pytest.approx(6 / 0.030)
    # lockstep: B = 6 -> 25 ms a stage (the line a = 1, b = 4 ms/row), circuit 75 + 3 = 78 ms
    assert p.predict_tps(6, 1) == pytest.approx(6 / 0.078)
    snap = p.snapshot()
    assert snap["stage_ms"]["<head>"] == [1.0, 4.0] and snap["overhead_ms"] == [3.0, 0.0]


def test_the_head_sampling_counts_on_the_heads_device():
    # members 2 ms, head 2 ms + 6 ms sampling: the head is the bottleneck at 8 ms a micro-batch
    p = fed([lambda b: 2.0] * 3, overhead_ms=0.0, sample_ms=6.0)
    assert p.predict_tps(3, 3) == pytest.approx(3 / max(0.012, 3 * 0.008))


def test_a_move_up_is_a_trial_kept_only_when_it_beats_lockstep():
    p = fed([lambda b: 1.0 + 4.0 * b] * 3)
    for i in range(20):  # lockstep: 6 decoding requests, one token each per 50 ms
        p.note_tokens(6, 6, now_s=i * 0.05)
    assert p.choose(6, now_s=1.0) == 3 and p.snapshot()["trial"]  # 3 groups of 2: cycle 28 ms vs 78
    for i in range(1, 45):  # the trial: twice the tokens per second
        p.note_tokens(6, 6, now_s=1.0 + i * 0.025)
    assert p.choose(6, now_s=1.0 + TRIAL_S / 2) == 3  # not judged yet
    assert p.choose(6, now_s=1.0 + TRIAL_S + 0.1) == 3
    (m, rate, base, kept), = p.trials
    assert (m, kept) == (3, True) and rate == pytest.approx(2 * base, rel=0.05)
    t = 1.0 + TRIAL_S + 0.1
    for i in range(1, 60):  # still faster: kept
        p.note_tokens(6, 6, now_s=t + i * 0.025)
    t += 59 * 0.025
    assert p.choose(6, now_s=t) == 3
    for i in range(1, 30):  # the kept M falls below the lockstep rate it beat: back to lockstep
        p.note_tokens(6, 6, now_s=t + i * 0.1)
    assert p.choose(6, now_s=t + 2.9) == 1 and p.trials[-1][3] is False


def test_a_trial_slower_than_lockstep_returns_to_lockstep_and_backs_off():
    p = fed([lambda b: 1.0 + 4.0 * b] * 3)
    for i in range(20):
        p.note_tokens(6, 6, now_s=i * 0.05)
    assert p.choose(6, now_s=1.0) == 3
    for i in range(1, 25):  # overlapped steps slow each other (members sharing cores): half the rate
        p.note_tokens(6, 6, now_s=1.0 + i * 0.1)
    t = 1.0 + 2.4
    assert p.choose(6, now_s=t) == 1 and p.trials[-1][3] is False
    for i in range(1, 30):  # lockstep again, measured afresh
        p.note_tokens(6, 6, now_s=t + i * 0.05)
    assert p.choose(6, now_s=t + BACKOFF_S - 0.1) == 1  # still backing off
    p.overlap_factor = 1.0  # as if the fleet changed: the model predicts a gain again
    assert p.choose(6, now_s=t + BACKOFF_S + 0.1) == 3  # the next trial
    assert p._backoff_s == 2 * BACKOFF_S


def test_a_clearly_losing_trial_is_judged_early():
    p = fed([lambda b: 1.0 + 4.0 * b] * 3)
    for i in range(20):  # lockstep: 6 requests, a token each per 50 ms
        p.note_tokens(6, 6, now_s=i * 0.05)
    assert p.choose(6, now_s=1.0) == 3
    for i in range(1, 4):  # 0.38x the lockstep rate, as 3 micro-batches on 3 daemons sharing 2 cores
        p.note_tokens(6, 6, now_s=1.0 + i * 0.13)
    assert p.choose(6, now_s=1.0 + step_policy.EARLY_S - 0.01) == 3  # too early to judge
    assert p.choose(6, now_s=1.0 + 0.39) == 1  # judged at 0.39 s, not TRIAL_S
    (m, rate, base, kept), = p.trials
    assert (m, kept) == (3, False) and rate == pytest.approx(0.05 / 0.13 * base, rel=0.02)
    assert p.overlap_factor < 1.0  # calibrated as a full trial would


def test_a_trial_a_little_slower_runs_its_full_time():
    p = fed([lambda b: 1.0 + 4.0 * b] * 3)
    for i in range(20):
        p.note_tokens(6, 6, now_s=i * 0.05)
    assert p.choose(6, now_s=1.0) == 3
    for i in range(1, 12):  # 0.91x lockstep: within the noise an early judgement would mistake
        p.note_tokens(6, 6, now_s=1.0 + i * 0.055)
    assert p.choose(6, now_s=1.0 + 0.6) == 3 and p.snapshot()["trial"]


def test_overlapped_steps_are_not_fitted_and_a_pinned_m_is_kept():
    p = StepPolicy(stages=3)
    p.note_step(4, [("h", 0.5), ("m", 0.5)], 1.0, alone=False)
    assert p.predict_tps(4, 1) is None and p.choose(4, now_s=0.0) == 1
    assert StepPolicy(stages=3, pinned=2).choose(1, now_s=0.0) == 2


def test_m_never_exceeds_the_stages_or_the_requests():
    p = fed([lambda b: 1.0 + 10.0 * b] * 4, stages=4)
    for i in range(20):
        p.note_tokens(2, 2, now_s=i * 0.05)
    assert p.choose(2, now_s=2.0) == 2  # two requests: at most two micro-batches


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 20.0), st.floats(0.0, 5.0)), min_size=1, max_size=5),
       st.integers(1, 16), st.floats(0.0, 10.0), st.floats(0.0, 5.0))
def test_the_chosen_m_is_the_best_predicted_within_hysteresis(lines, k, overhead_ms, sample_ms):
    p = fed([(lambda a, b: (lambda rows: a + b * rows))(a, b) for a, b in lines], overhead_ms=overhead_ms,
            sample_ms=sample_ms, stages=len(lines), rows=(1, 3, 8))
    for i in range(20):
        p.note_tokens(k, k, now_s=i * 0.05)
    m = p.choose(k, now_s=2.0)
    limit = max(1, min(len(lines), k))
    assert 1 <= m <= limit
    best = max((p.predict_tps(k, x) or 0.0) for x in range(1, limit + 1))
    margin = step_policy.TRIAL_GAIN if m == 1 else step_policy.HYSTERESIS  # leaving lockstep needs more
    assert (p.predict_tps(k, m) or 0.0) * (1 + margin) >= best


def test_apply_schedule_sets_modes_only_between_requests():
    from kafilad.node.serving.schedule_settings import apply_schedule, parse_schedule
    from kafilad.proto.scheduler import HeadScheduler, RequestArrived

    s = HeadScheduler(policy=StepPolicy(stages=3))
    apply_schedule(s, "per-request")
    assert s.batching is False and s.policy.pinned is None
    apply_schedule(s, "3")
    assert s.batching and s.policy.pinned == 3 and s.policy.choose(1) == 3
    apply_schedule(s, "lockstep")
    assert s.policy.pinned == 1
    apply_schedule(s, "auto")
    assert s.policy.pinned is None and s.policy.current == 1
    for bad, msg in ((0, "not possible"), ("fast", "Unknown schedule"), (True, "Unknown schedule"), (None, "Unknown")):
        with pytest.raises(ValueError, match=msg):
            parse_schedule(bad)
    s.handle(RequestArrived("r", (1, 2), 4, 0.0, 0.0))
    with pytest.raises(ValueError, match="1 are running now"):
        apply_schedule(s, "lockstep")


def test_a_small_predicted_gain_does_not_leave_lockstep():
    # near-flat costs: 3 groups of 2 rows predict ~5-10 % over one step of 6 rows; not worth a trial
    p = fed([lambda b: 5.0 + 0.2 * b] * 3, overhead_ms=3.0)
    for i in range(20):
        p.note_tokens(6, 6, now_s=i * 0.05)
    gain = p.predict_tps(6, 2) / p.predict_tps(6, 1)
    assert 1.05 < gain < 1.15
    assert p.choose(6, now_s=2.0) == 1 and not p.snapshot()["trial"]


def test_a_failed_trial_calibrates_the_model_so_the_next_prediction_of_overlap_is_lower():
    p = fed([lambda b: 1.0 + 4.0 * b] * 3)
    for i in range(20):
        p.note_tokens(6, 6, now_s=i * 0.05)
    predicted_gain = p.predict_tps(6, 3) / p.predict_tps(6, 1)
    assert p.choose(6, now_s=1.0) == 3
    for i in range(1, 25):  # the trial runs at half the lockstep rate
        p.note_tokens(6, 6, now_s=1.0 + i * 0.1)
    assert p.choose(6, now_s=3.4) == 1
    assert p.overlap_factor == pytest.approx(0.5 / predicted_gain, rel=0.1)
    assert p.predict_tps(6, 3) / p.predict_tps(6, 1) == pytest.approx(0.5, rel=0.1)
    for i in range(1, 300):  # lockstep again; long after the back-off no trial starts: overlap measured slower
        p.note_tokens(6, 6, now_s=3.4 + i * 0.05)
    assert p.choose(6, now_s=3.4 + 300 * 0.05) == 1 and not p.snapshot()["trial"]
