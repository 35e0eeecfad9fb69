"""The prompt cache across requests (issue 23 item 3; kafilad/executor/prefix.py, kafilad/node/serving/ring.py):
real stages on a ring of RingMembers in one trio process (in-memory links, the real frame codec).

A conversation's next turn starts from the previous turn's kept caches and prefills only its new
tokens; its output is token-identical to the same turn on a ring without the cache; every stage
holds the same entries; the budget (context x concurrency, less the running requests' context)
bounds them; a broken ring forgets them everywhere; a model whose caches cannot be cut back runs
without it."""

from __future__ import annotations

import pytest
import trio
from trio.testing import trio_test

from kafilad.executor import archs
from kafilad.executor.prefix import PrefixIndex, common_prefix_len
from kafilad.executor.synth import synthesize_model
from tests.node.test_ring_batch import generate_all, ring_of

BOUNDS = [(0, 2), (2, 4), (4, 6)]
TURN1 = "The lighthouse keeper counted the ships that passed."


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synthesize_model(tmp_path_factory.mktemp("pc") / "llama", arch="llama", seed=9, num_hidden_layers=6,
                            hidden_size=64)


async def conversation(model_dir, *, cache: bool, budget=(4096, 4096)):
    async with ring_of(model_dir, BOUNDS) as ring:
        head = ring[0]
        if cache:
            head.runner.prefix_index = PrefixIndex(*budget)
        first = (await generate_all(head, {"t1": (TURN1, 24, None)}))["t1"]
        turn2 = TURN1 + first.text + " Then the fog came in."
        second = (await generate_all(head, {"t2": (turn2, 24, None)}))["t2"]
        entries = [sorted(m.runner.prefix.entries) for m in ring]
        index = head.runner.prefix_index
        return first, second, entries, (index.hits, index.tokens_saved) if index else None, ring


@trio_test
async def test_the_next_turn_reuses_the_last_and_answers_the_same(model):
    with trio.fail_after(120):
        plain1, plain2, entries, _, _ = await conversation(model, cache=False)
        assert entries == [[], [], []]
        got1, got2, entries, (hits, saved), ring = await conversation(model, cache=True)
    assert (got1.generated, got2.generated) == (plain1.generated, plain2.generated)
    held = (tuple(got1.prompt_ids) + tuple(got1.generated))[:len(got1.prompt_ids) + len(got1.generated) - 1]
    # all but turn 1's last token went round the ring; turn 2 reuses what its prompt shares with them (the
    # random reply's bytes may re-tokenize otherwise), at least turn 1's whole prompt
    assert hits == 1 and saved == common_prefix_len(held, got2.prompt_ids) >= len(got1.prompt_ids)
    assert entries[0] == entries[1] == entries[2] and "t2" in entries[0]  # every stage holds the same entries
    assert all(m.runner.prefix.entries["t2"][1] == len(got2.prompt_ids) + len(got2.generated) - 1 for m in ring)


@trio_test
async def test_the_budget_bounds_the_entries(model):
    """Context 64, concurrency 1: nothing is kept past 64 tokens, and a running request leaves no room."""
    with trio.fail_after(120):
        _, _, entries, (hits, _), _ = await conversation(model, cache=True, budget=(64, 64))
    assert hits == 0 and entries == [[], [], []]
    index = PrefixIndex(128, 64)
    assert index.keep("a", tuple(range(60)), running=0) == (True, [])
    assert index.keep("b", tuple(range(100, 160)), running=0) == (True, [])
    assert index.claim(tuple(range(30)) + (999,), running=1) == ("a", 30, ["b"])  # one running: room for 64
    assert index.keep("c", tuple(range(100, 190)), running=1) == (False, [])
    assert index.keep("d", tuple(range(60)) + (7, 8), running=0) == (True, ["a"])  # replaces its own prefix
    assert list(index.tokens) == ["d"]


@trio_test
async def test_a_broken_ring_forgets_every_entry(model):
    with trio.fail_after(120):
        async with ring_of(model, BOUNDS) as ring:
            ring[0].runner.prefix_index = PrefixIndex(4096, 4096)
            await generate_all(ring[0], {"a": (TURN1, 8, None)})
            assert all(m.runner.prefix.entries for m in ring)
            for m in ring:
                m.fail_all("test", member=None)
                await m.runner_drop_all()
            assert not any(m.runner.prefix.entries for m in ring) and not ring[0].runner.prefix_index.tokens


def test_models_with_other_caches_run_without_it(tmp_path):
    from kafilad.executor.stage import load_stage_from_dir

    assert load_stage_from_dir(synthesize_model(tmp_path / "l", arch="llama", num_hidden_layers=2), 0, 2,
                               True).prefix_cacheable
    for arch in ("gemma3_text", "qwen3_next"):  # rotating windows; linear attention
        d = archs.synthesize_arch(tmp_path / arch, arch)
        assert not load_stage_from_dir(d, 0, 3, True).prefix_cacheable
