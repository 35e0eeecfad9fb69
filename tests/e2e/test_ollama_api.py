"""The official `ollama` client against the host (issue 10): /api/tags, /api/show, /api/ps,
/api/version, /api/generate and /api/chat (NDJSON streaming and whole), with real daemons on
loopback and the packaged stories260K. Greedy text equals the OpenAI API's and `kafila-ctl
generate`'s; `options` reach the head's sampler (a seeded request equals the OpenAI API's with
the same seed and temperature); refusals are sentences in Ollama's `{"error"}` shape."""

from __future__ import annotations

import json
import urllib.request

import pytest

from kafila_ctl.demo import LoopbackCluster, packaged_model_dir

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LoopbackCluster(2, root=str(tmp_path_factory.mktemp("c"))) as c:
        base = c.call(0, "status")["http"].removesuffix("/v1")
        idle = ollama.Client(host=base)
        assert idle.list().models == [] and idle.ps().models == []  # no session yet
        with pytest.raises(ollama.ResponseError) as e:
            idle.generate(model="stories260K", prompt=PROMPT)
        assert e.value.status_code == 503 and "not hosting one" in e.value.error
        c.form(str(packaged_model_dir()), context=512)
        c.base = base
        c.ollama = ollama.Client(host=base, timeout=120)
        c.openai = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield c


def test_models_version_show_and_ps(cluster):
    client = cluster.ollama
    [m] = client.list().models
    from kafilad.modelinfo import read_model_info
    assert m.model == "stories260K:latest"
    assert m.size == sum(t.nbytes for t in read_model_info(packaged_model_dir()).tensors.values())
    assert m.details.family == "llama" and m.details.format == "safetensors" and len(m.digest) == 64
    assert m.details.parameter_size.endswith("K")
    shown = client.show("stories260K")
    assert shown.details.family == "llama" and shown.modelinfo["llama.block_count"] == 5
    assert shown.modelinfo["kafila.session_context_length"] == 512 and shown.capabilities == ["completion"]
    assert client.show("stories260K:latest").modelinfo == shown.modelinfo
    [running] = client.ps().models
    assert running.model == "stories260K:latest" and running.context_length == 512
    with urllib.request.urlopen(cluster.base + "/api/version", timeout=30) as r:
        assert json.loads(r.read())["version"].count(".") == 2
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3")
    assert e.value.status_code == 404 and e.value.error.startswith("model 'llama3' not found")


def test_generate_and_chat_greedy_whole_and_streamed(cluster):
    client = cluster.ollama
    expected = cluster.generate(PROMPT, 12)
    out = client.generate(model="stories260K", prompt=PROMPT, options={"num_predict": 12, "temperature": 0})
    assert out.response == expected["text"] and out.done and out.done_reason == "length"
    assert out.eval_count == 12 and out.prompt_eval_count == expected["prompt_tokens"]
    assert out.total_duration >= out.eval_duration > 0
    parts = list(client.generate(model="stories260K:latest", prompt=PROMPT, options={"num_predict": 12}, stream=True))
    assert "".join(p.response for p in parts) == expected["text"]
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].done_reason == "length"

    messages = [{"role": "user", "content": "Tell me a story."}]
    reply = cluster.openai.chat.completions.create(model="stories260K", messages=messages,
                                                   max_tokens=10).choices[0].message.content
    chat = client.chat(model="stories260K", messages=messages, options={"num_predict": 10}, stream=False)
    assert chat.message.role == "assistant" and chat.message.content == reply and chat.eval_count == 10
    pieces = list(client.chat(model="stories260K", messages=messages, options={"num_predict": 10}, stream=True))
    assert "".join(p.message.content for p in pieces) == reply and pieces[-1].done_reason == "length"
    load = client.generate(model="stories260K", prompt="")
    assert load.done and load.done_reason == "load" and load.response == ""
    # `model` left out (README): the served one, named in the answer
    req = urllib.request.Request(cluster.base + "/api/generate", method="POST", data=json.dumps(
        {"prompt": PROMPT, "stream": False, "options": {"num_predict": 12, "temperature": 0}}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        whole = json.loads(r.read())
    assert whole["response"] == expected["text"] and whole["model"] == "stories260K" and whole["done"]


def test_options_reach_the_sampler(cluster):
    client = cluster.ollama
    full = cluster.generate(PROMPT, 40)["text"]
    stop = full[12:15]
    out = client.generate(model="stories260K", prompt=PROMPT, options={"num_predict": 40, "stop": [stop]})
    assert out.response == full[:full.find(stop)] and out.done_reason == "stop"
    parts = list(client.generate(model="stories260K", prompt=PROMPT, options={"num_predict": 40, "stop": [stop]},
                                 stream=True))
    assert "".join(p.response for p in parts) == full[:full.find(stop)]

    opts = {"num_predict": 16, "temperature": 1.0, "top_p": 0.9, "seed": 42}
    seeded = client.generate(model="stories260K", prompt=PROMPT, options=opts).response
    assert seeded == client.generate(model="stories260K", prompt=PROMPT, options=opts).response
    assert seeded == cluster.openai.completions.create(model="stories260K", prompt=PROMPT, max_tokens=16,
                                                       temperature=1.0, top_p=0.9, seed=42).choices[0].text
    assert seeded != full[:len(seeded)]
    penalised = client.generate(model="stories260K", prompt=PROMPT, options={
        "num_predict": 40, "presence_penalty": 1.5, "frequency_penalty": 0.5, "repeat_last_n": 20}).response
    assert penalised == cluster.openai.completions.create(model="stories260K", prompt=PROMPT, max_tokens=40,
                                                          presence_penalty=1.5, frequency_penalty=0.5).choices[0].text
    assert penalised != full
    lp = client.generate(model="stories260K", prompt=PROMPT, options={"num_predict": 4}, logprobs=True, top_logprobs=2)
    assert len(lp.logprobs) == 4 and "".join(t.token for t in lp.logprobs) == lp.response
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob for t in lp.logprobs)
    assert all(t.top_logprobs[0].token == t.token for t in lp.logprobs)  # its own text, leading space kept


def test_refusals_are_sentences(cluster):
    client = cluster.ollama
    cases = [
        (dict(options={"mirostat": 2}), 400, "'options.mirostat' is not supported: this server does not implement it"),
        (dict(options={"temperature": "hot"}), 400, "'options.temperature' is invalid"),
        (dict(options={"num_ctx": 4096}), 400, "exceeds the session's context of 512 tokens"),
        (dict(options={"num_predict": 10000}), 400, "plus 'options.num_predict' 10000 exceeds the session's context"),
        (dict(format="xml"), 400, "'format' must be \"json\" or a JSON schema"),
        (dict(images=["aGk="]), 400, "'images' is not supported"),
        (dict(model="llama3"), 404, "model 'llama3' not found"),
    ]
    for kw, status, words in cases:
        with pytest.raises(ollama.ResponseError) as e:
            client.generate(**{"model": "stories260K", "prompt": PROMPT, **kw})
        assert e.value.status_code == status and words in e.value.error, (kw, e.value.error)
    ok = client.generate(model="stories260K", prompt=PROMPT, options={"num_predict": 2, "num_thread": 4, "num_gpu": 0},
                         keep_alive="5m")
    assert ok.done and ok.eval_count == 2  # runtime options are about Ollama's machine, not the output
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="stories260K", messages=[{"role": "user", "content": "hi"}], format="xml")
    assert e.value.status_code == 400 and "'format' must be \"json\" or a JSON schema" in e.value.error
