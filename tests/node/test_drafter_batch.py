"""The head's speculation state for a lockstep batch (kafilad/node/serving/drafts.py `Drafter`,
issue 24 item 1; proto_spec 05 §3.1): pure, no MLX, a fake clock."""

from __future__ import annotations

from kafilad.node.serving.drafts import Drafter

REPEAT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]  # lookup drafts 7, 8, 9, 5 after "5 6"
NEW = [1, 2, 3, 4]  # nothing recurs


def test_rows_carry_equal_drafts_padded_with_their_last_token():
    d = Drafter(4, None)
    assert d.plan_batch(("a", "b")) == 4
    rows = d.batch_drafts(("a", "b"), [REPEAT, NEW], rooms=[10, 10])
    assert rows == [[7, 8, 9, 5], [4, 4, 4, 4]]
    assert d.batch_returned(("a", "b"), 1.0) == ((7, 8, 9, 5), (4, 4, 4, 4))
    d.batch_verified(("a", "b"), [3, 0], 1.1)
    assert [d.take_trim("a"), d.take_trim("b"), d.take_trim("a")] == [1, 4, 0]
    c = d.status()
    assert (c["passes"], c["drafted"], c["accepted"], c["tokens"], c["batch_passes"]) == (2, 8, 3, 5, 1)
    assert d.forget("a") == {"passes": 1, "drafted": 4, "accepted": 3}


def test_k_is_bounded_by_the_smallest_room_and_needs_the_planned_rows():
    d = Drafter(4, None)
    d.plan_batch(("a", "b"))
    assert d.batch_drafts(("a", "b"), [REPEAT, REPEAT], rooms=[10, 2]) == [[7, 8], [7, 8]]
    d.batch_returned(("a", "b"), 1.0)
    d.batch_verified(("a", "b"), [2, 2], 1.1)
    d.plan_batch(("a", "b"))
    assert d.batch_drafts(("a", "b", "c"), [REPEAT] * 3, rooms=[9, 9, 9]) == []  # another set of rows: plain
    d.plan_batch(("a", "b"))
    assert d.batch_drafts(("a", "b"), [REPEAT, REPEAT], rooms=[0, 9]) == []  # a row may produce one more token only
    assert d.plan_batch(("a",)) == 0  # one row speculates in the single form, not here


def test_adaptive_k_measures_the_batch_and_backs_off_when_nothing_is_drafted():
    d = Drafter(None, None)
    assert d.plan_batch(("a", "b")) == 0  # the first plain passes measure the batch's cycle
    t = 0.0
    for expect in (0, 0):
        assert d.batch_drafts(("a", "b"), [REPEAT, NEW], rooms=[50, 50]) == []
        assert d.batch_returned(("a", "b"), t) == ()
        t += 0.1
        assert d.plan_batch(("a", "b")) == 0 or t > 0.15
    assert d.status()["plain_passes"] == 2  # the second pass was timed: once per row
    assert d._batch_choosers[(2, 8)].c0_s == 0.1
    assert d._batches[0].planned > 0  # with c0 measured, the optimistic start drafts
    for _ in range(12):  # drafted passes that cost more and whose drafts are all rejected drive k to 0
        sent = d.batch_drafts(("a", "b"), [REPEAT, REPEAT], rooms=[50, 50])
        if sent:
            assert d.batch_returned(("a", "b"), t)
            d.batch_verified(("a", "b"), [0, 0], t)
        else:
            d.batch_returned(("a", "b"), t)
        t += 0.1 + 0.02 * len(sent[0] if sent else ())
        d.plan_batch(("a", "b"))
    assert d._batch_choosers[(2, 8)].accept_rate < 0.3 and d._batch_choosers[(2, 8)].c1_s > 0
    assert d._batches[0].planned == 0
    assert d.take_trim("a") > 0  # the rejected drafts are due


def test_off_or_refused_never_drafts_a_batch():
    for d in (Drafter(0, None), Drafter(None, "its caches cannot be trimmed")):
        assert d.plan_batch(("a", "b")) == 0
        assert d.batch_drafts(("a", "b"), [REPEAT, REPEAT], rooms=[9, 9]) == []
        assert d.batch_returned(("a", "b"), 1.0) == ()
        assert d.status()["plain_passes"] == 0


def test_micro_batch_groups_keep_their_own_passes():
    d = Drafter(3, None)
    d.plan_batch(("a", "b"), group=0)
    d.plan_batch(("c", "d"), group=1)
    assert d.batch_drafts(("a", "b"), [REPEAT, REPEAT], rooms=[9, 9], group=0) == [[7, 8, 9]] * 2
    assert d.batch_drafts(("c", "d"), [NEW, REPEAT], rooms=[9, 9], group=1) == [[4, 4, 4], [7, 8, 9]]
    assert d.batch_returned(("c", "d"), 1.0, group=1) == ((4, 4, 4), (7, 8, 9))
    d.batch_verified(("c", "d"), [0, 3], 1.0, group=1)
    assert d.batch_returned(("a", "b"), 1.1, group=0) == ((7, 8, 9),) * 2
    d.batch_verified(("a", "b"), [1, 2], 1.1, group=0)
    assert [d.take_trim(r) for r in "abcd"] == [2, 1, 3, 0]
    assert d.batch_drafts(("a", "b"), [REPEAT, REPEAT], rooms=[9, 9], group=1) == []  # planned for group 0 only


def test_a_drafted_pass_whose_rows_all_ended_twice_is_counted_without_rows():
    """`_verify_batch` reports no rows when every row of a drafted pass ended while it was out;
    twice in a row for one group must not divide by its zero rows."""
    d = Drafter(2, None)
    for t in (1.0, 2.0):
        d.plan_batch(("a", "b"))
        assert d.batch_drafts(("a", "b"), [REPEAT, REPEAT], rooms=[9, 9]) == [[7, 8]] * 2
        assert d.batch_returned(("a", "b"), t)
        d.batch_verified((), [], t)
    assert d.status()["batch_passes"] == 2 and d.status()["passes"] == 0
