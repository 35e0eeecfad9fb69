"""The host's OpenAI-compatible HTTP API (DESIGN §7), exercised with a plain HTTP client against
real daemons on loopback: the same tokens as `kafila-ctl generate`, streaming as SSE."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from kafila_ctl.demo import LoopbackCluster

pytestmark = pytest.mark.slow


def post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_completions_models_and_streaming(tmp_path, synth_llama):
    with LoopbackCluster(2, root=str(tmp_path / "c")) as c:
        base = c.call(0, "status")["http"]
        assert base and base.startswith("http://127.0.0.1:")
        status, body = post(base + "/completions", {"prompt": "Kafila", "max_tokens": 4})
        assert status == 503 and "No session is being served" in json.loads(body)["error"]["message"]
        c.form(str(synth_llama))
        expected = c.generate("Kafila serves", 12)
        with urllib.request.urlopen(base + "/models", timeout=30) as r:
            models = json.loads(r.read())
        assert models["data"][0]["id"] == "synth-llama"
        status, body = post(base + "/completions", {"model": "synth-llama", "prompt": "Kafila serves", "max_tokens": 12})
        assert status == 200
        out = json.loads(body)
        assert out["object"] == "text_completion" and out["choices"][0]["text"] == expected["text"]
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 12 and out["usage"]["prompt_tokens"] == expected["prompt_tokens"]
        status, body = post(base + "/completions", {"prompt": "Kafila serves", "max_tokens": 12, "stream": True})
        assert status == 200
        events = [ln[6:] for ln in body.decode().split("\n\n") if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == expected["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        status, body = post(base + "/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        assert status == 200 and json.loads(body)["choices"][0]["message"]["role"] == "assistant"
        status, body = post(base + "/completions", {"prompt": "x", "max_tokens": 0})
        assert status == 400 and "'max_tokens' must be a positive integer" in json.loads(body)["error"]["message"]
        status, _ = post(base + "/nowhere", {})
        assert status == 404
        status, body = post(base + "/completions", {"prompt": "x", "max_tokens": 3, "temperature": 1e999})
        assert status == 400 and "finite" in json.loads(body)["error"]["message"]
        # `kafila-ctl chat`: the second turn no longer fits 512 tokens with 256 to generate, so the
        # oldest exchange is forgotten rather than the chat ending
        import subprocess
        import sys
        r = subprocess.run([sys.executable, "-m", "kafila_ctl.cli", "--state-dir", str(c.state_dir(0)), "chat"],
                           input="hello\nwhat now\n", capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "kafila-ctl:" not in r.stderr, r.stderr
        assert len([ln for ln in r.stdout.splitlines() if ln.strip()]) >= 2
