"""The prompt cache through real daemons (issue 23 item 3): a 3-member ring on loopback serves a
conversation's next turn from the last turn's kept caches, with the host as the head and with a
remote head; each answer is single-process mlx-lm's greedy answer to the whole prompt, and the
OpenAI usage reports the reused tokens as `prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

import pytest

from kafila_testing import head_after_reports_checked, reference_tokens
from tests.e2e.test_requests import HeadCluster

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

TURN1 = "The lighthouse keeper counted the ships that passed the rocks at night."


@pytest.mark.parametrize("capability", [{"bandwidth_Bps": 1e13, "step_overhead_s": 0.0}, {"bandwidth_Bps": 1e6}],
                         ids=["host-head", "remote-head"])
def test_the_next_turn_starts_from_the_last(tmp_path, synth_llama, capability):
    with HeadCluster(3, root=str(tmp_path / "c"), host_capability=capability) as c:
        c.form(str(synth_llama), context=2048, head="auto")
        if capability["bandwidth_Bps"] < 1e9:  # a member heads once its report is confirmed (issue 22 item 5)
            assert head_after_reports_checked(c) != "m0"
        first = c.generate(TURN1, 24)
        assert first["cached_tokens"] == 0 and first["token_ids"] == reference_tokens(synth_llama, TURN1, 24)
        turn2 = TURN1 + first["text"] + " Then the fog came in over the water."
        second = c.generate(turn2, 24)
        assert first["prompt_tokens"] <= second["cached_tokens"] < second["prompt_tokens"]
        assert second["token_ids"] == reference_tokens(synth_llama, turn2, 24)
        cl = openai.OpenAI(base_url=c.call(0, "status")["http"], api_key="unused", max_retries=0, timeout=120)
        turn3 = turn2 + second["text"] + " And the bell rang."
        third = cl.completions.create(model=synth_llama.name, prompt=turn3, max_tokens=8)
        assert third.usage.prompt_tokens_details.cached_tokens >= second["prompt_tokens"]
