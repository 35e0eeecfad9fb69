"""Batched decode across a ring with mlx-lm's BatchKVCache (DESIGN §6): same tokens as alone."""

from __future__ import annotations

import pytest

from kafilad.errors import RemoteProtocolError
from kafilad.executor.runner import StageRunner, array_from_wire, array_to_wire, generate_local, prefill_chunks
from kafilad.executor.stage import load_stage_from_dir
from kafilad.executor.synth import synthesize_model
from tests.conftest import STORIES_PROMPT_IDS, STORIES_REFERENCE_IDS


def hop(a):
    return array_from_wire(array_to_wire(a))


class Ring:
    """Drives runners the way the node does: prefill alone, then batched steps with ordered ids."""

    def __init__(self, model_dir, bounds):
        self.runners = [StageRunner(load_stage_from_dir(model_dir, a, b, head=(i == 0)))
                        for i, (a, b) in enumerate(bounds)]

    def prefill(self, rid, prompt):
        head = self.runners[0]
        for chunk in prefill_chunks(prompt):
            h = head.head_embed_and_run(rid, chunk)
            for r in self.runners[1:]:
                h = r.run(rid, hop(h))
        return head.head_sample(rid, hop(h), 0.0)

    def step(self, rids, tokens):
        head = self.runners[0]
        h = head.head_embed_and_run_batch(rids, tokens)
        for r in self.runners[1:]:
            h = r.run_batch(rids, hop(h))
        return head.head_sample_batch(rids, hop(h), 0.0)

    def drop(self, rid):
        for r in self.runners:
            r.drop(rid)


def run_schedule(ring, prompts, n, join_late=None, leave_at=None):
    """Decode prompts (rid -> ids) in one batch; `join_late` joins after 3 steps; `leave_at` maps a
    rid to the number of tokens after which it leaves. Returns rid -> generated ids."""
    limit = lambda rid: (leave_at or {}).get(rid, n)  # noqa: E731
    out = {rid: [ring.prefill(rid, p)] for rid, p in prompts.items() if rid != join_late}
    steps = 0
    while any(len(v) < limit(rid) for rid, v in out.items()) or (join_late and join_late not in out):
        if join_late and steps == 3:
            out[join_late] = [ring.prefill(join_late, prompts[join_late])]
        active = [rid for rid, v in out.items() if len(v) < limit(rid)]
        for rid in [r for r in out if r not in active and r in ring.runners[0].active_requests]:
            ring.drop(rid)
        active = sorted(active, key=lambda r: (steps * 7 + hash(r)) % 5)  # the head may reorder
        toks = ring.step(active, [out[r][-1] for r in active])
        for rid, t in zip(active, toks):
            out[rid].append(t)
        steps += 1
    return out


def test_stories_batch_matches_reference_and_alone(stories260k):
    ring = Ring(stories260k, [(0, 2), (2, 4), (4, 5)])
    prompts = {"a": STORIES_PROMPT_IDS, "b": [1, 403, 407], "c": STORIES_PROMPT_IDS + [432, 383, 286]}
    got = run_schedule(ring, prompts, 16)
    assert got["a"] == STORIES_REFERENCE_IDS[:16]
    for rid, p in prompts.items():
        assert got[rid] == generate_local(ring.runners, p, 16), rid
    assert got["c"] == STORIES_REFERENCE_IDS[3:19]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def synth_dir(request, tmp_path_factory):
    return synthesize_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=11)


def test_synth_batch_join_leave_reorder_match_alone(synth_dir):
    ring = Ring(synth_dir, [(0, 2), (2, 3), (3, 6)])
    prompts = {"x": [256] + list(b"Once upon a time"), "y": [256, 72, 105], "z": [256] + list(b"The cat sat"),
               "w": [256] + list(b"late joiner")}
    got = run_schedule(ring, prompts, 14, join_late="w", leave_at={"y": 6})
    assert len(got["y"]) == 6 and len(got["w"]) == 14
    for rid, p in prompts.items():
        alone = generate_local(ring.runners, p, len(got[rid]), request_id="alone-" + rid)
        assert got[rid] == alone, rid
    for r in ring.runners:
        for rid in list(r.active_requests):
            r.drop(rid)
        assert r.active_requests == [] and r.batch_ids == []


def test_batch_refuses_unprefilled_and_duplicate_ids(synth_dir):
    ring = Ring(synth_dir, [(0, 3), (3, 6)])
    ring.prefill("p", [256, 1, 2])
    with pytest.raises(RemoteProtocolError, match=r"Stage \[0, 3\) has no KV cache for request\(s\) \['q'\]"):
        ring.runners[0].head_embed_and_run_batch(["p", "q"], [5, 6])
    with pytest.raises(RemoteProtocolError, match="listed a request twice"):
        ring.runners[0].head_embed_and_run_batch(["p", "p"], [5, 6])
    with pytest.raises(RemoteProtocolError, match="listed no requests"):
        ring.runners[1].run_batch([], ring.runners[0].head_embed_and_run("p", [3])[:0])
    with pytest.raises(RemoteProtocolError, match="has 1 requests but 2 tokens"):
        ring.runners[0].head_embed_and_run_batch(["p"], [5, 6])


def test_request_leaves_batch_and_continues_alone(stories260k):
    """A batched request taken out of the batch (extract) decodes on alone, still on reference."""
    ring = Ring(stories260k, [(0, 1), (1, 4), (4, 5)])
    a = [ring.prefill("a", STORIES_PROMPT_IDS)]
    b = [ring.prefill("b", [1, 403])]
    for _ in range(5):
        ta, tb = ring.step(["a", "b"], [a[-1], b[-1]])
        a.append(ta)
        b.append(tb)
    assert ring.runners[2].batch_ids == ["a", "b"]
    assert ring.runners[2].cache_length("a") == len(STORIES_PROMPT_IDS) + 5
    assert ring.runners[2].batch_ids == ["b"]
    for _ in range(5):
        h = ring.runners[0].head_embed_and_run("a", [a[-1]])
        for r in ring.runners[1:]:
            h = r.run("a", hop(h))
        a.append(ring.runners[0].head_sample("a", h, 0.0))
    assert a == STORIES_REFERENCE_IDS[:11]
    assert all(r.batch_ids == [] or r.batch_ids == ["b"] for r in ring.runners)


def test_micro_batch_groups_keep_their_own_caches_and_rows_move_between_groups(synth_dir):
    """Two decode micro-batches at every stage (proto_spec 05 §3 `mb`): each group's batch cache
    holds its rows; a row that moves to the other group carries its cache; tokens equal alone."""
    ring = Ring(synth_dir, [(0, 1), (1, 2)])
    prompts = {"a": [5, 6, 7], "b": [9, 3], "c": [4, 4, 4, 4], "d": [8]}
    out = {rid: [ring.prefill(rid, p)] for rid, p in prompts.items()}

    def step(rids, group):
        head = ring.runners[0]
        h = head.head_embed_and_run_batch(rids, [out[r][-1] for r in rids], group)
        for r in ring.runners[1:]:
            h = r.run_batch(rids, hop(h), group)
        for rid, t in zip(rids, head.head_sample_batch(rids, hop(h), 0.0)):
            out[rid].append(t)

    for _ in range(3):
        step(["a", "b"], 0)
        step(["c", "d"], 1)
    for r in ring.runners:
        assert (r.group_ids(0), r.group_ids(1)) == (["a", "b"], ["c", "d"])
    for _ in range(3):  # b moves to group 1, d to group 0
        step(["a", "d"], 0)
        step(["c", "b"], 1)
    for r in ring.runners:
        assert (r.group_ids(0), r.group_ids(1)) == (["a", "d"], ["c", "b"]) and r.batch_ids == ["a", "d", "c", "b"]
    for rid, p in prompts.items():
        assert out[rid] == generate_local(ring.runners, p, 7), rid
    with pytest.raises(RemoteProtocolError, match="micro-batch group"):
        ring.runners[1].run_batch(["a", "b"], hop(ring.runners[0].head_embed_and_run_batch(["a", "b"], [1, 2])), 99)
