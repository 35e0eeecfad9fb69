"""A session across the NAT lab serves token-identical output (issue 3 "Done when"; DESIGN §9.3).

Three members behind O, C and S NATs: the planner's ring mixes direct and relayed edges (C-S relays),
and greedy generation must equal single-process mlx-lm token for token.
"""

from __future__ import annotations

import pytest

from kafila_testing import STORIES_PROMPT, STORIES_REFERENCE_IDS, reference_tokens

from .conftest import require_lab
from .test_paths_lab import LabCluster

CLASSES = ("O", "C", "S")


def _serve(natlab, model_dir, prompt: str, max_tokens: int) -> tuple[dict, dict]:
    require_lab()
    with LabCluster(natlab) as cluster:
        try:
            snap = cluster.form_in_order(str(model_dir))
        except BaseException:
            raise AssertionError("the session did not form in the lab:\n" + cluster.logs()) from None
        result = cluster.generate(prompt, max_tokens)
        return snap, result


def _check_edges(snap: dict) -> None:
    classes = {m["name"]: m["nat_class"] for m in snap["members"]}
    assert sorted(classes.values()) == sorted(CLASSES)
    paths = {(classes[e["from"]], classes[e["to"]]): e["path"] for e in snap["edges"]}
    assert len(paths) == 3
    for (a, b), path in paths.items():
        assert path == ("relayed" if {a, b} == {"C", "S"} else "direct"), snap["edges"]


@pytest.mark.parametrize("natlab", [CLASSES], indirect=True)
def test_stories260k_across_the_lab_matches_the_reference(natlab, stories260k):
    snap, result = _serve(natlab, stories260k, STORIES_PROMPT, 40)
    _check_edges(snap)
    assert result["token_ids"] == STORIES_REFERENCE_IDS


@pytest.mark.parametrize("natlab", [CLASSES], indirect=True)
def test_synthesised_model_across_the_lab_matches_single_process(natlab):
    from kafilad.executor.synth import default_synth_model_dir
    model = default_synth_model_dir()
    snap, result = _serve(natlab, model, "Hello lab", 24)
    _check_edges(snap)
    assert result["token_ids"] == reference_tokens(model, "Hello lab", 24)
