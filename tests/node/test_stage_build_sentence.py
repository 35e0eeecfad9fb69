"""What a stage that could not be built says (kafilad/node/serving/stagehost.py `build_failure`, issue 21 item 3):
one sentence naming the member, the architecture, its share and the reason; never the bare repr of
the exception mlx-lm's code raised (a trial's member said "could not load its stage: KeyError('lm_head')")."""

from __future__ import annotations

import pytest

from kafilad.errors import ModelFormatError, StageBuildError
from kafilad.node.serving.stagehost import build_failure

GEMMA = {"model_type": "gemma3_text", "num_hidden_layers": 6}


def test_a_missing_weight_the_architecture_needs_is_named_without_its_repr():
    e = build_failure("laptop", GEMMA, 0, 2, True, KeyError("lm_head"))
    assert isinstance(e, StageBuildError)
    assert str(e) == ("Member laptop could not build its stage (blocks [0, 2) and the head) of this gemma3_text "
                      "model: mlx-lm's gemma3_text code needs 'lm_head', which this share of the model does not hold "
                      "(Kafila cannot split this architecture this way yet).")
    assert "KeyError" not in str(e)


def test_the_executors_own_sentence_is_kept():
    err = ModelFormatError("Weights for stage [2, 4) head=False do not fit the model: missing layers.3.mlp.")
    assert str(build_failure("m1", {"model_type": "llama"}, 2, 4, False, err)) == (
        "Member m1 could not build its stage (blocks [2, 4)) of this llama model: Weights for stage [2, 4) head=False "
        "do not fit the model: missing layers.3.mlp.")


@pytest.mark.parametrize("config", [{"model_type": "deepseek_v3"}, {}, None])
def test_any_other_error_names_its_kind_and_says_what_it_means(config):
    said = str(build_failure("m2", config, 4, 6, False,
                             ValueError("Invalid type str received\n in array initialization.")))
    arch = (config or {}).get("model_type", "unknown")
    assert said == (f"Member m2 could not build its stage (blocks [4, 6)) of this {arch} model: mlx-lm's {arch} code "
                    "stopped with a ValueError while building it (Invalid type str received in array initialization.), "
                    "so Kafila cannot split this architecture this way yet.")
