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
                           input="hello\n/help\nwhat now\n", capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "kafila-ctl:" not in r.stderr, r.stderr
        replies = [p for p in r.stdout.split("\n\n") if p.strip()]
        assert len(replies) == 2, r.stdout  # piped replies end with a blank line, so they stay apart
        assert "/clear  forget the conversation" in r.stderr  # /help answered by chat, not sent to the model


# ---- issue 9: every input that once killed the host daemon, kept as a test --------------------------

import http.client  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402

#: a chat template that refuses a system message, as Gemma's and Mistral's do (jinja2 raise_exception)
STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                   "{{ raise_exception('System role not supported') }}{% endif %}"
                   "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")


def raw_request(port: int, data: bytes, timeout_s: float = 30) -> tuple[int, dict, bytes]:
    """Send raw bytes as one request (the connection closes after it); return status, headers, body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def post_raw(port: int, path: str, body: bytes) -> tuple[int, str]:
    status, _, answer = raw_request(port, f"POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                                          f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
                                          .encode() + body)
    return status, json.loads(answer)["error"]["message"] if status != 200 else answer.decode()


@pytest.fixture
def strict_chat_model(tmp_path, synth_llama):
    model = tmp_path / "synth-strict"
    shutil.copytree(synth_llama, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": STRICT_TEMPLATE}))
    return model


def test_hostile_inputs_get_sentences_and_the_daemon_keeps_serving(tmp_path, strict_chat_model):
    with LoopbackCluster(2, root=str(tmp_path / "c")) as c:
        base = c.call(0, "status")["http"]
        port = int(base.split(":")[2].split("/")[0])
        # while the session forms, the 503 says so (and never names a command-line flag)
        code = c.call(0, "host", model_dir=str(strict_chat_model), members=2, context=512, open=True)["code"]
        status, headers, body = raw_request(port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        message = json.loads(body)["error"]["message"]
        assert status == 503 and message.startswith("The session is forming") and "ready" in message
        assert headers["retry-after"] == "5" and "--" not in message
        c.call(1, "join", code=code)
        c.call(0, "wait", states=["ready"], timeout_s=120)
        expected = c.generate("Kafila serves", 8)

        # HEAD: the headers of GET, no body, and the connection stays usable (keep-alive)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("HEAD", "/v1/models")
        r = conn.getresponse()
        assert r.status == 200 and int(r.getheader("content-length")) > 0 and r.read() == b""
        conn.request("GET", "/v1/models")
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["data"][0]["id"] == "synth-strict"
        conn.close()

        cases = [
            ("/v1/completions", b"\xff", "not UTF-8"),
            ("/v1/completions", b"[" * 1100, "nests JSON"),
            ("/v1/completions", b'{"prompt": "a\\ud800c", "max_tokens": 2}', "lone surrogate (\\ud800"),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800c"}], "max_tokens": 2}',
             "messages[0].content contains a lone surrogate"),
            ("/v1/completions", b'{"prompt": "Once", "temperature": 1' + b"0" * 400 + b"}", "'temperature' must be"),
            ("/v1/completions", b'{"prompt": "Once", "max_tokens": 1' + b"0" * 5000 + b"}", "not valid JSON"),
            ("/v1/chat/completions", b'{"messages": [{"role": "system", "content": "be brief"}, '
                                     b'{"role": "user", "content": "hi"}], "max_tokens": 2}',
             "chat template refused these messages: System role not supported"),
            ("/v1/completions", json.dumps({"prompt": "x" * 600, "max_tokens": 8}).encode(), "context of 512 tokens"),
            ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', "'stream' must be true or false"),
        ]
        for path, body, words in cases:
            status, message = post_raw(port, path, body)
            assert status == 400 and words in message, (body[:60], status, message)
            assert "--" not in message and message.endswith(".")
        status, _ = post(base + "/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert status == 200  # the same template formats a user turn
        status, body = post(base + "/completions", {"prompt": "Kafila serves", "max_tokens": 8})
        assert status == 200 and json.loads(body)["choices"][0]["text"] == expected["text"]
        assert c.daemons[0].poll() is None and c.daemons[1].poll() is None
    log = (tmp_path / "c" / "m0.log").read_text(errors="replace")
    assert "Traceback" not in log and "internal error" not in log
