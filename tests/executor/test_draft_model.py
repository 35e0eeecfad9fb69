"""The head's draft model (kafilad/executor/draft.py, issue 24 item 1, `host --draft-model`): it proposes
the model's own greedy continuation when it is the model itself, keeps each request's cache in step
with the history however many drafts were rejected, and is refused by name when its tokenizer
differs. On models the project synthesises and the packaged stories260K."""

from __future__ import annotations

import pytest

from kafila_ctl.demo import packaged_model_dir
from kafilad.errors import StageBuildError
from kafilad.executor.draft import DRAFT_MODEL_UNUSABLE, DraftModel, draft_model_bytes
from kafilad.executor.synth import load_tokenizer, synthesize_model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return synthesize_model(tmp_path_factory.mktemp("t") / "target", arch="llama", seed=7, num_hidden_layers=4,
                            hidden_size=64)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another model with the same (byte-level) tokenizer: a draft model that is not the target."""
    return synthesize_model(tmp_path_factory.mktemp("o") / "other", arch="qwen3", seed=3, num_hidden_layers=2,
                            hidden_size=64)


def greedy(model_dir, ids: list[int], n: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    model, _ = load(str(model_dir))
    return [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), model, max_tokens=n), range(n))]


def test_the_model_as_its_own_draft_proposes_its_greedy_continuation(target):
    draft = DraftModel.load(target, load_tokenizer(target))
    prompt = load_tokenizer(target).encode("Once upon a time")
    ref = greedy(target, prompt, 12)
    assert draft.propose("r", prompt, 5) == ref[:5]
    assert draft.held_tokens("r") == len(prompt) + 4  # the last draft is never fed
    # all 5 accepted and the next token sampled: the next proposal goes on from there
    assert draft.propose("r", prompt + ref[:6], 4) == ref[6:10]
    assert draft_model_bytes(target) > 0 and draft.nbytes > 0


def test_after_rejected_drafts_its_cache_follows_the_history_as_a_fresh_one_would(target, other):
    draft = DraftModel.load(other, load_tokenizer(target))
    prompt = load_tokenizer(target).encode("The caravan left at dawn")
    first = draft.propose("r", prompt, 6)
    # the target accepted 2 of them and sampled a token of its own instead of the third
    history = prompt + first[:2] + [(first[2] + 1) % 256]
    again = draft.propose("r", history, 4)
    fresh = DraftModel.load(other).propose("s", history, 4)
    assert again == fresh and draft.held_tokens("r") == len(history) + 3
    draft.forget("r")
    assert draft.held_tokens("r") is None
    assert draft.propose("r", history, 0) == [] and draft.propose("r", [], 3) == []


def test_a_draft_model_with_another_tokenizer_is_refused_by_name(target):
    with pytest.raises(StageBuildError) as e:
        DraftModel.load(target, load_tokenizer(packaged_model_dir()))
    assert e.value.code == DRAFT_MODEL_UNUSABLE and "tokenizer" in str(e.value)
