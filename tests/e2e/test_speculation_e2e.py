"""Speculative decoding through three real daemons (issue 24 item 1): the head drafts by prompt
lookup and the ring's stages trim what it rejects; greedy output is token-identical with
speculation off (`kafila-ctl speculate off`) and on, the head's status counts accepted drafts, and
a generation's trace record carries its drafted and accepted counts."""

from __future__ import annotations

import pytest

from kafila_testing import STORIES_PROMPT, reference_tokens

pytestmark = pytest.mark.slow


def test_three_daemons_speculate_with_the_same_greedy_tokens(stories260k, cluster3):
    c = cluster3
    c.form(str(stories260k))
    assert c.call(0, "status")["speculation"]["on"] is True  # on by default
    first = c.generate(STORIES_PROMPT, 64)
    prompt = f"{STORIES_PROMPT}{first['text']}\n{STORIES_PROMPT}"  # the story again: lookup drafts well
    off_status = c.call(0, "speculate", mode="off")
    assert off_status["on"] is False and "KAFILA_SPECULATE=0" in off_status["why"]
    off = c.generate(prompt, 48)
    assert c.call(0, "speculate")["passes"] == off_status["passes"]  # nothing drafted while off
    on_status = c.call(0, "speculate", mode="k=4")
    on = c.generate(prompt, 48)
    after = c.call(0, "status")["speculation"]
    assert on["token_ids"] == off["token_ids"] and on["text"] == off["text"]
    assert len(on["token_ids"]) == 48
    assert after["accepted"] > on_status["accepted"] and after["passes"] > on_status["passes"]
    assert on["accepted"] == after["accepted"] - on_status["accepted"] and on["drafted"] > 0
    assert on["decode_tokens"] == 47  # the decode rate counts tokens, not passes
    ids = reference_tokens(stories260k, prompt, 48)
    assert on["token_ids"] == ids[:48]  # and both are single-process mlx-lm's
    records = [r for r in c.call(0, "trace") if r.get("event") == "generation"]
    assert records[-1]["accepted"] == on["accepted"]
    with pytest.raises(Exception, match="speculation mode"):
        c.call(0, "speculate", mode="fast")


def test_a_draft_model_on_the_host_proposes_the_drafts_and_the_tokens_stay_the_models(stories260k, cluster3):
    """`host --draft-model` (issue 24 item 1): the draft model, here the model itself, runs on the host,
    which heads; its drafts are nearly all accepted on a prompt prompt lookup could not draft from,
    and greedy output is single-process mlx-lm's."""
    c = cluster3
    code = c.call(0, "host", model_dir=str(stories260k), members=3, context=512, open=True, strategy="kafila",
                  draft_model=str(stories260k))["code"]  # kafila: every member holds blocks
    for i in (1, 2):
        c.call(i, "join", code=code)
    st = c.call(0, "wait", states=["ready"], timeout_s=120)
    assert st["plan"]["head"] == "m0" and len([m for m in st["members"] if m["blocks"]]) == 3
    assert st["speculation"]["drafts"] == f"draft model {stories260k.name}"
    c.call(0, "speculate", mode="k=4")
    out = c.generate("Lily", 40)  # two tokens: nothing to look up
    assert out["token_ids"] == reference_tokens(stories260k, "Lily", 40)
    assert out["drafted"] >= 20 and out["accepted"] >= 0.9 * out["drafted"], out


#: the host slow, m1 fast, m2 mid, by their reports (trusted: `host --head any`): the paper's division
#: moves the head off the slow host to m1
SPEEDS_BPS = {0: 2e8, 1: 5e10, 2: 1e10}


def test_a_member_head_fetches_the_draft_model_and_drafts_with_it(stories260k, tmp_path):
    """`host --draft-model` with the head on a member (issue 24 item 1): the member fetches the draft
    model from the host with its share (proto_spec 05 §2 `plan` `draft_files`), checked by sha256,
    and proposes every pass's drafts with it; greedy output is single-process mlx-lm's."""
    import json
    from kafila_ctl.demo import LoopbackCluster
    from kafilad.node.serving.stagehost import TEST_CAPABILITY_ENV

    class Speeds(LoopbackCluster):
        def daemon_env(self, i: int) -> dict:
            return {**super().daemon_env(i), TEST_CAPABILITY_ENV: json.dumps({"bandwidth_Bps": SPEEDS_BPS[i],
                                                                              "step_overhead_s": 0.0})}

    with Speeds(3, root=str(tmp_path / "c")) as c:
        code = c.call(0, "host", model_dir=str(stories260k), members=3, context=512, open=True, strategy="kafila",
                      head="any", draft_model=str(stories260k))["code"]
        for i in (1, 2):
            c.call(i, "join", code=code)
        st = c.call(0, "wait", states=["ready"], timeout_s=120)
        assert st["plan"]["head"] == "m1", st["plan"]
        # the draft model's weights count in the head's share, not the host's
        weights = sum(p.stat().st_size for p in stories260k.glob("*.safetensors"))
        assert st["plan"]["resident_bytes"]["m1"] > weights
        fetched = list(c.root.rglob("draft-*/model.safetensors"))  # on the head, from the host's copy
        assert len(fetched) == 1 and fetched[0].is_relative_to(c.state_dir(1))
        assert fetched[0].read_bytes() == (stories260k / "model.safetensors").read_bytes()
        out = c.generate("Lily", 40)  # two tokens: nothing for prompt lookup to draft from
        assert out["token_ids"] == reference_tokens(stories260k, "Lily", 40)
        assert out["drafted"] >= 20 and out["accepted"] >= 0.9 * out["drafted"], out


def test_a_draft_model_with_another_tokenizer_fails_the_session_naming_it(stories260k, synth_llama, tmp_path):
    from kafila_ctl.demo import LoopbackCluster
    with LoopbackCluster(1, root=str(tmp_path / "c")) as c:
        c.call(0, "host", model_dir=str(stories260k), members=1, context=256, draft_model=str(synth_llama))
        with pytest.raises(Exception, match="does not share the model's tokenizer"):
            c.call(0, "wait", states=["ready"], timeout_s=60)


def test_concurrent_requests_speculate_in_one_batch_with_their_own_tokens(stories260k, cluster3):
    """Three concurrent greedy requests through three real daemons decode in one lockstep batch with
    drafts (issue 24 item 1: every row the same k, each accepting its own count, the members
    trimming rows in place): each request's tokens are single-process mlx-lm's, and drafts were
    accepted across the batch."""
    from tests.e2e.test_batching import head_batches, run_concurrently
    c = cluster3
    c.form(str(stories260k), concurrency=3)
    story = c.generate(STORIES_PROMPT, 64)["text"]
    prompts = [(f"{STORIES_PROMPT}{story}\n{STORIES_PROMPT}", 40), (f"{STORIES_PROMPT}{story}\nOnce", 36),
               (STORIES_PROMPT, 32)]
    c.call(0, "schedule", mode="lockstep")  # one batch of three (auto may try micro-batches here)
    before = c.call(0, "speculate", mode="k=4")
    out = run_concurrently(c, prompts)
    after = c.call(0, "speculate")
    for prompt, n in prompts:
        assert out[prompt]["token_ids"] == reference_tokens(stories260k, prompt, n)[:len(out[prompt]["token_ids"])]
        assert len(out[prompt]["token_ids"]) == n
    assert after["accepted"] > before["accepted"] and after["passes"] > before["passes"]
    assert sum(out[p]["accepted"] for p, _ in prompts) == after["accepted"] - before["accepted"]
    assert max(out[p]["accepted"] for p, _ in prompts[:2]) > 0
    assert after["batch_passes"] > before["batch_passes"]  # drafted passes of the batch of three
    assert max(head_batches(c, c.call(0, "status"))) == 3
