"""GGUF models (issue 21 items 5-6; kafilad/executor/gguf.py, kafilad/modelref.py): a llama GGUF written
as llama.cpp writes one converts back to the very weights it came from (names, the Q/K rope
permutation undone) and answers as they do; Ollama's store is resolved as Ollama lays it out; and
the real SmolLM2-135M-Instruct GGUF (Q4_1, Q8_0) divided 3 ways answers a chat in English,
token-identical to single-process mlx-lm on the converted weights."""

from __future__ import annotations

import hashlib
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from gguf_testing import llama_cpp_permute, need_smollm2, write_llama_gguf
from kafilad.errors import KafilaError, ModelFormatError
from kafilad.executor import archs
from kafilad.executor.gguf import convert_gguf, unpermute_rows
from kafilad.executor.synth import load_tokenizer, synthesize_model
from kafilad.modelref import resolve_model_ref

pytest.importorskip("gguf")
PROMPT = [256] + list(b"The keeper of the light counted ships.")


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    src = synthesize_model(tmp_path_factory.mktemp("src") / "llama", arch="llama", seed=4, num_hidden_layers=4,
                           hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    path = write_llama_gguf(src, tmp_path_factory.mktemp("gguf") / "twin.gguf")
    return src, path


def test_unpermute_inverts_llama_cpp(tmp_path):
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        assert np.array_equal(np.array(unpermute_rows(mx.array(llama_cpp_permute(w, heads)), heads)), w)


def test_a_gguf_converts_back_to_its_weights_and_answers_the_same(twin, tmp_path):
    src, path = twin
    out = convert_gguf(path, tmp_path / "conv")
    from safetensors.numpy import load_file
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    cfg, src_cfg = json.loads((out / "config.json").read_text()), json.loads((src / "config.json").read_text())
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size", "tie_word_embeddings", "rope_theta", "head_dim", "bos_token_id", "eos_token_id"):
        assert cfg[k] == src_cfg[k], k
    ref = archs.reference_tokens(src, PROMPT, 24)
    assert archs.ring_tokens(out, [(0, 1), (1, 3), (3, 4)], PROMPT, 24) == ref
    assert load_tokenizer(out).encode("abc", add_special_tokens=False) == list(b"abc")


def test_other_architectures_are_refused(tmp_path):
    import gguf

    g = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "qwen35moe")
    g.add_block_count(1)
    g.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    with pytest.raises(ModelFormatError, match="architecture is 'qwen35moe'"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def ollama_store(root, blob_src, name="library/twin", tag="latest"):
    data = blob_src.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    manifest = root / "manifests" / "registry.ollama.ai" / name / tag
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                                    "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                                               "digest": "sha256:" + "0" * 64, "size": 1},
                                    "layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": f"sha256:{digest}", "size": len(data)},
                                               {"mediaType": "application/vnd.ollama.image.template",
                                                "digest": "sha256:" + "1" * 64, "size": 1}]}))


def test_ollama_names_resolve_in_a_store_laid_out_as_ollama_does(twin, tmp_path, monkeypatch):
    src, path = twin
    ollama_store(tmp_path / "store", path)
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "store"))
    first = resolve_model_ref("ollama:twin", tmp_path / "models")
    assert first == resolve_model_ref("ollama:twin:latest", tmp_path / "models")  # converted once, reused
    assert archs.ring_tokens(first, [(0, 2), (2, 4)], PROMPT, 16) == archs.reference_tokens(src, PROMPT, 16)
    with pytest.raises(KafilaError, match="has no model twin:7b .*ollama pull twin:7b"):
        resolve_model_ref("ollama:twin:7b", tmp_path / "models")
    with pytest.raises(KafilaError, match="not an Ollama model name"):
        resolve_model_ref("ollama:../x", tmp_path / "models")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "nowhere"))
    with pytest.raises(KafilaError, match="no Ollama model store at"):
        resolve_model_ref("ollama:twin", tmp_path / "models")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return convert_gguf(need_smollm2(), tmp_path_factory.mktemp("smollm2") / "model")


def chat_ids(model_dir, question: str) -> list[int]:
    tok = load_tokenizer(model_dir)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              tokenize=False), add_special_tokens=False)


def test_smollm2_divided_three_ways_answers_in_english_as_mlx_lm(smollm2):
    ids = chat_ids(smollm2, "What is the capital of France?")
    ref = archs.reference_tokens(smollm2, ids, 24)
    assert archs.ring_tokens(smollm2, [(0, 10), (10, 20), (20, 30)], ids, 24) == ref
    text = load_tokenizer(smollm2).decode(ref)
    assert "Paris" in text and "capital" in text, text
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    _ = shutil
