"""The real instruct model through real daemons (issue 21 items 5-6): three kafilad processes on loopback
host SmolLM2-135M-Instruct straight from its GGUF file (Q4_1; the host converts it once into its
state directory), divide it 10 blocks each, and answer chats in English through the official
`openai` client, token-identical to single-process mlx-lm on the converted weights."""

from __future__ import annotations

import pytest

from gguf_testing import need_smollm2
from kafila_ctl.demo import LoopbackCluster
from kafilad.executor import archs
from kafilad.executor.synth import load_tokenizer

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def test_three_daemons_serve_smollm2_from_its_gguf_in_english(tmp_path):
    gguf = need_smollm2()
    with LoopbackCluster(3, root=str(tmp_path / "c")) as c:
        st = c.form(str(gguf), strategy="uniform", context=2048)["status"]
        assert sorted(tuple(b) for b in st["plan"]["blocks"].values()) == [(0, 10), (10, 20), (20, 30)]
        [converted] = list((c.state_dir(0) / "models").glob("gguf-*"))
        cl = openai.OpenAI(base_url=c.call(0, "status")["http"], api_key="unused", max_retries=0, timeout=120)
        model = cl.models.list().data[0].id
        r = cl.chat.completions.create(model=model, max_tokens=24, messages=[
            {"role": "user", "content": "What is the capital of France?"}])
        answer = r.choices[0].message.content
        assert "Paris" in answer, answer
        tok = load_tokenizer(converted)
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                 add_generation_prompt=True, tokenize=False), add_special_tokens=False)
        ref = archs.reference_tokens(converted, ids, 24)
        ended = next((i for i, t in enumerate(ref) if t in tok.eos_token_ids), len(ref))  # the ring stops at EOS
        assert r.choices[0].finish_reason == ("stop" if ended < len(ref) else "length")
        assert answer == tok.decode(ref[:ended])
        words = cl.chat.completions.create(model=model, max_tokens=40, messages=[
            {"role": "user", "content": "Write one sentence about the sea."}]).choices[0].message.content
        english = {"the", "a", "is", "of", "and", "sea", "ocean", "water", "waves"}
        assert len({w.strip(".,!").lower() for w in words.split()} & english) >= 3, words
