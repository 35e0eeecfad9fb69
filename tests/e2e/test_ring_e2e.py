"""Issue 2 "Done when": a rendezvous and 3 daemons (real processes, real sockets, Noise, MLX)
serve a model split across all three, token-identical to single-process mlx-lm, and the relay
never sees plaintext."""

from __future__ import annotations

import msgpack
import pytest

from kafila_testing import STORIES_PROMPT, STORIES_PROMPT_IDS, STORIES_REFERENCE_IDS, reference_tokens
from kafilad.proto.rendezvous import parse_relay_record

pytestmark = pytest.mark.slow

FRAME_TYPES = ["act", "end", "gen", "gen_event", "gen_done", "token", "fetch", "data", "plan", "capability",
               "admitted", "ready"]


def relayed_bytes(cluster) -> bytes:
    records = parse_relay_record(cluster.record_path.read_bytes())
    return b"".join(payload for _, payload in records)


def assert_no_plaintext(blob: bytes, prompt: str, prompt_ids: list[int], generated: list[int]) -> None:
    assert len(blob) > 10_000, "the ring should have relayed its activations through the rendezvous"
    assert prompt.encode() not in blob
    assert msgpack.packb(prompt_ids) not in blob
    assert msgpack.packb(generated) not in blob
    for tok in generated:  # each streamed token as its frame encodes it
        assert b"\xa8token_id" + msgpack.packb(tok) not in blob
    for t in FRAME_TYPES:  # any frame's plaintext header: {"t": <type>, ...}
        assert b"\xa1t" + msgpack.packb(t) not in blob


def check_split(status: dict, n_blocks: int) -> None:
    blocks = status["plan"]["blocks"]
    assert len(blocks) == 3 and all(b - a >= 1 for a, b in blocks.values())
    spans = sorted(tuple(v) for v in blocks.values())
    assert spans[0][0] == 0 and spans[-1][1] == n_blocks
    assert all(spans[i][1] == spans[i + 1][0] for i in range(2))
    assert status["state"] == "ready"
    assert {m["name"] for m in status["members"]} == {"m0", "m1", "m2"}


def test_stories260k_ring_matches_reference(stories260k, cluster3_relayed):
    """Issue 2: every ring edge relayed through the rendezvous, which sees only ciphertext."""
    cluster3 = cluster3_relayed
    formed = cluster3.form(str(stories260k))
    check_split(formed["status"], 5)
    result = cluster3.generate(STORIES_PROMPT, 40)
    assert result["token_ids"] == STORIES_REFERENCE_IDS
    assert result["token_ids"] == reference_tokens(stories260k, STORIES_PROMPT, 40)
    assert result["text"] == (", there was a little girl named Lily. She loved to play outside in the park. "
                              "One day, she saw a big, red ball.")
    assert result["prompt_tokens"] == len(STORIES_PROMPT_IDS)
    assert_no_plaintext(relayed_bytes(cluster3), STORIES_PROMPT, STORIES_PROMPT_IDS, result["token_ids"])
    status = cluster3.call(0, "status")
    assert all(m["measured_stage_s"] and m["measured_stage_s"] > 0 for m in status["members"])
    assert len(status["edges"]) == 3 and all(e["path"] == "relayed" for e in status["edges"])
    assert {d["name"] for d in status["fleet"]["devices"]} == {"m0", "m1", "m2"}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_synthesised_ring_matches_single_process(arch, synth_llama, synth_qwen3, cluster3):
    model = synth_llama if arch == "llama" else synth_qwen3
    prompt = "Kafila serves"
    formed = cluster3.form(str(model))
    check_split(formed["status"], 6 if arch == "llama" else 5)
    expected = reference_tokens(model, prompt, 60)
    result = cluster3.generate(prompt, 60)
    assert result["token_ids"] == expected
    from mlx_lm.utils import load_tokenizer
    prompt_ids = list(load_tokenizer(model).encode(prompt))
    assert_no_plaintext(relayed_bytes(cluster3), prompt, prompt_ids, result["token_ids"])
    edges = cluster3.call(0, "status")["edges"]
    assert len(edges) == 3 and all(e["path"] == "direct" for e in edges), edges


def test_concurrent_requests_match_sequential(tmp_path, synth_llama):
    """--concurrency 2: two requests in flight round the ring at once, each with its own KV cache."""
    import trio

    from kafila_ctl.demo import LoopbackCluster
    prompts = ["Kafila serves", "The ring"]
    with LoopbackCluster(3, root=str(tmp_path / "c")) as c:
        c.form(str(synth_llama), concurrency=2)
        alone = [c.generate(p, 30)["token_ids"] for p in prompts]
        together = {}

        async def both():
            async with trio.open_nursery() as n:
                for p in prompts:
                    async def one(p=p):
                        together[p] = (await c.client(0).call("generate", prompt=p, max_tokens=30))["token_ids"]
                    n.start_soon(one)
        trio.run(both)
        assert [together[p] for p in prompts] == alone
        assert alone[0] != alone[1]


def test_second_session_reuses_cached_tensors(tmp_path, synth_llama):
    """Members fetch by byte range, verify and cache (DESIGN §6); a new session re-uses the cache."""
    from kafila_ctl.demo import LoopbackCluster
    from kafilad.modelinfo import read_model_info
    info = read_model_info(synth_llama)

    def formed_loads(c):
        c.form(str(synth_llama))
        trace = c.call(0, "trace")
        blocks = c.call(0, "status")["plan"]["blocks"]
        head = c.call(0, "status")["plan"]["head"]
        loads = [ev for ev in trace if ev["event"] == "session_formed"][-1]["load"]
        return blocks, head, loads

    with LoopbackCluster(3, root=str(tmp_path / "c")) as c:
        blocks, head, first = formed_loads(c)
        for name in ("m1", "m2"):
            a, b = blocks[name]
            want = sum(t.nbytes for t in info.stage_tensors(a, b, head == name))
            # content-addressed: identical tensors (e.g. norm weights) are fetched once
            assert first[name]["fetched_bytes"] + first[name]["cached_bytes"] == want
            assert first[name]["fetched_bytes"] > first[name]["cached_bytes"]
        expected = c.generate("Kafila serves", 10)["token_ids"]
        for i in range(3):
            c.call(i, "leave")
        blocks2, head2, second = formed_loads(c)
        for name in ("m1", "m2"):
            a, b = blocks2[name]
            now = info.stage_tensors(a, b, head2 == name)
            assert second[name]["fetched_bytes"] + second[name]["cached_bytes"] == sum(t.nbytes for t in now)
            # every tensor this member held before (same bytes) comes from its cache, not the host
            a1, b1 = blocks[name]
            before = {t.name for t in info.stage_tensors(a1, b1, head == name)}
            assert second[name]["cached_bytes"] >= sum(t.nbytes for t in now if t.name in before)
        assert sum(second[n]["cached_bytes"] for n in ("m1", "m2")) > 0
        assert c.generate("Kafila serves", 10)["token_ids"] == expected
