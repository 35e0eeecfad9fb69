"""The API's route table, CORS and request models without sockets or daemons (kafilad/control/
openai_api.py, api_common.py, openai_schema.py, ollama_api.py): the handler is served over trio's
in-memory streams to a node that hosts no session, and the typed models are fed JSON objects."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import trio

from kafilad.proto.status import NodeStatus
from kafilad.control import openai_api
from kafilad.control.api_common import HttpError, json_object
from kafilad.control.cors import origin_allowed
from kafilad.control.ollama_api import ChatRequest, GenerateRequest, _parse
from kafilad.control.openai_schema import parse_chat, parse_completion
from kafilad.control.node_view import SessionOnly

from control.http_harness import exchange, http_request

IDLE = SessionOnly(None, NodeStatus.from_json({"role": None, "state": "idle"}))


def request(method: str, path: str, headers: dict | None = None, body: bytes = b"") -> bytes:
    """A request with a `content-length` (0 without a body)."""
    return http_request(method, path, headers, body)


def run(raw: bytes) -> tuple[int, dict, bytes]:
    return trio.run(exchange, raw, IDLE)


def test_methods_paths_and_health_without_a_session():
    status, headers, body = run(request("GET", "/v1/completions"))
    assert status == 405 and headers["allow"] == "POST"
    assert json.loads(body)["error"]["message"] == "/v1/completions answers POST, not GET."
    status, _, body = run(request("GET", "/v1/nothing"))
    assert status == 404 and "/v1/models/{id}" in json.loads(body)["error"]["message"]
    status, headers, _ = run(request("OPTIONS", "/v1/models"))
    assert status == 204 and headers["allow"] == "GET, HEAD, OPTIONS"
    status, _, body = run(request("GET", "/health"))
    assert status == 503 and json.loads(body) == {"status": "unavailable"}  # ready or not: nothing more (issue 22)
    status, _, body = run(request("GET", "/v1/models/stories260K"))
    assert status == 503 and json.loads(body)["error"]["type"] == "service_unavailable"
    status, _, body = run(request("POST", "/v1/completions", body=b'{"prompt": "x", "temperature": 9}'))
    assert status == 400 and json.loads(body)["error"]["param"] == "temperature"  # checked before the session
    status, _, body = run(request("GET", "/api/version"))
    assert status == 200 and json.loads(body)["version"]
    status, _, body = run(request("GET", "/api/tags"))
    assert status == 200 and json.loads(body) == {"models": []}
    status, _, body = run(request("POST", "/api/generate", body=b'{"model": "m", "prompt": "x"}'))
    assert status == 503 and set(json.loads(body)) == {"error"}  # Ollama's error shape


def test_every_api_path_answers_errors_in_ollamas_shape():
    """Ollama clients read {"error": sentence}: `ollama.Client().pull("llama3")` got an OpenAI error object."""
    for method, path, code in [("POST", "/api/pull", 404), ("POST", "/api/embed", 404), ("DELETE", "/api/delete", 404),
                               ("GET", "/api/nothing/", 404), ("GET", "/api/generate", 405), ("POST", "/api/tags", 405)]:
        status, _, body = run(request(method, path, body=b'{"model": "llama3"}'))
        error = json.loads(body)
        assert status == code and list(error) == ["error"] and isinstance(error["error"], str), (path, body)
    status, _, body = run(request("POST", "/api/pull", body=b'{"model": "llama3"}'))
    assert json.loads(body)["error"] == (
        "This server does not offer POST /api/pull: it is a Kafila host serving its session's one model, so it does "
        "not pull, push, create, copy, delete or embed models. Its Ollama routes are /api/chat, /api/generate, "
        "/api/ps, /api/show, /api/tags, /api/version.")
    status, _, body = run(request("POST", "/v1/nothing"))
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found"  # the OpenAI shape elsewhere


def test_cors_preflight_and_origins(monkeypatch):
    preflight = {"origin": "http://localhost:8080", "access-control-request-method": "POST",
                 "access-control-request-headers": "Content-Type, X-Bad Header, Authorization"}
    status, headers, body = run(request("OPTIONS", "/v1/chat/completions", preflight))
    assert status == 204 and body == b""
    assert headers["access-control-allow-origin"] == "http://localhost:8080" and headers["vary"] == "origin"
    assert headers["access-control-allow-methods"] == "POST, OPTIONS"
    assert headers["access-control-allow-headers"] == "Content-Type, Authorization"  # a malformed name is left out
    assert "access-control-allow-private-network" not in headers
    status, headers, body = run(request("OPTIONS", "/api/chat", {**preflight, "origin": "https://chat.example"}))
    assert status == 403 and "'https://chat.example' may not call this API" in json.loads(body)["error"]  # Ollama's
    status, headers, _ = run(request("GET", "/api/version", {"origin": "https://chat.example"}))
    assert status == 200 and "access-control-allow-origin" not in headers and headers["vary"] == "origin"
    status, headers, _ = run(request("GET", "/api/version", {"origin": "http://[::1]:3000"}))
    assert headers["access-control-allow-origin"] == "http://[::1]:3000"
    # a "simple" cross-origin POST (text/plain: no preflight) from a page not allowed never runs (a new
    # user's trial: any web page could start generations on the ring)
    for path in ("/v1/completions", "/api/generate"):
        status, headers, body = run(request("POST", path, {"origin": "https://evil.example",
                                                           "content-type": "text/plain"},
                                            body=b'{"prompt": "a", "max_tokens": 2}'))
        assert status == 403 and "'https://evil.example' may not call this API" in body.decode(), (path, body)
    for origin, ok in [("http://127.0.0.1", True), ("https://localhost:5173", True), ("http://0.0.0.0:1", True),
                       ("null", False), ("file://", False), ("http://localhost.evil.example", False),
                       ("ftp://localhost", False), ("http://[zz", False)]:
        assert origin_allowed(origin, {}) is ok, origin
    env = {"KAFILA_HTTP_ORIGINS": "https://chat.example, https://other.example/"}
    assert origin_allowed("https://chat.example", env) and origin_allowed("https://other.example", env)
    assert not origin_allowed("https://third.example", env) and origin_allowed("https://x.y", {"KAFILA_HTTP_ORIGINS": "*"})


@pytest.mark.parametrize("parse, body, param, words", [
    (parse_completion, {"prompt": "x", "max_tokens": 0}, "max_tokens", "'max_tokens' must be a positive integer"),
    (parse_completion, {"prompt": "x", "max_tokens": True}, "max_tokens", "'max_tokens' must be a positive integer"),
    (parse_completion, {"prompt": "x", "max_tokens": "5"}, "max_tokens", "'max_tokens' must be a positive integer"),
    (parse_completion, {"prompt": "x", "max_tokens": 10**11}, "max_tokens",
     "'max_tokens' must be a positive integer of at most 2147483647 (or null)."),
    (parse_completion, {"prompt": "x", "temperature": 1e308 * 10}, "temperature", "finite number between 0 and 2"),
    (parse_completion, {"prompt": "x", "temperature": 10**400}, "temperature", "finite number between 0 and 2"),
    (parse_completion, {"prompt": [1, 2, 3]}, "prompt", "'prompt' as token ids is not supported"),
    (parse_completion, {"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    (parse_completion, {}, "prompt", "'prompt' is required."),
    (parse_completion, {"prompt": "x", "echo": True}, "echo", "'echo': true is not supported"),
    (parse_completion, {"prompt": "x", "suffix": "y"}, "suffix", "'suffix' is not supported"),
    (parse_completion, {"prompt": "x", "logprobs": 6}, "logprobs", "between 0 and 5"),
    (parse_completion, {"prompt": "x", "logit_bias": {"a1": 1}}, "logit_bias", "key 'a1' is not a token id"),
    (parse_completion, {"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias", "between -100 and 100"),
    (parse_completion, {"prompt": "x", "seed": 2**64}, "seed", "'seed' must be an integer (64 bits)."),
    (parse_completion, {"prompt": "x", "stop": [""]}, "stop", "non-empty strings"),
    (parse_completion, {"prompt": "x", "stream": 1}, "stream", "'stream' must be true or false."),
    (parse_chat, {"messages": []}, "messages", "'messages' must be a non-empty list"),
    (parse_chat, {"messages": [{"role": "tool", "content": "x"}]}, "messages[0]",
     "'messages[0]' has role 'tool' and must carry the 'tool_call_id'"),
    (parse_chat, {"messages": [{"role": "critic", "content": "x"}]}, "messages[0].role", "'messages[0].role' is invalid"),
    (parse_chat, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "always"}, "tool_choice",
     "'tool_choice' must be \"none\", \"auto\", \"required\""),
    (parse_chat, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format", "needs 'json_schema'"),
    (parse_chat, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content",
     "must hold parts of the form"),
    (parse_chat, {"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs",
     "'logprobs' must be true or false."),
    (parse_chat, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True},
     "top_logprobs", "between 0 and 20"),
    (parse_chat, {"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions",
     "'functions' is not supported: use 'tools' and 'tool_choice'"),
])
def test_every_field_gets_a_precise_400(parse, body, param, words):
    with pytest.raises(HttpError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message
    assert e.value.message.endswith(".") and "--" not in e.value.message


def test_accepted_bodies_and_their_defaults():
    r = parse_chat({"messages": [{"role": "developer", "content": None},
                                 {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                    "max_tokens": None, "temperature": None, "stop": "END", "logit_bias": {"7": -5},
                    "stream": True, "stream_options": {"include_usage": True}, "n": 1, "user": "u"})
    assert r.prompt_messages() == [{"role": "system", "content": ""}, {"role": "user", "content": "ab"}]
    assert r.max_tokens is None and r.temperature is None and r.stop == ("END",) and r.logit_bias == ((7, -5.0),)
    sampling = openai_api.sampling_of(SimpleNamespace(info=SimpleNamespace(config={"vocab_size": 8})), r)
    assert sampling.temperature == 0 and sampling.logit_bias == ((7, -5.0),) and sampling.logprobs is None
    with pytest.raises(HttpError, match="names token 7, outside this model.s vocabulary of 7 tokens"):
        openai_api.sampling_of(SimpleNamespace(info=SimpleNamespace(config={"vocab_size": 7})), r)
    c = parse_completion({"prompt": ["once"], "logprobs": 0, "top_p": 0.5, "seed": -1, "top_k": 3})
    s = openai_api.sampling_of(SimpleNamespace(info=None), c)
    assert c.prompt == "once" and (s.logprobs, s.top_p, s.seed, s.top_k) == (0, 0.5, -1, 3)


def test_ollama_bodies():
    r = _parse(GenerateRequest, {"model": "m", "prompt": "p", "options": {"num_predict": -1, "stop": "x",
                                                                          "num_gpu": 1}, "keep_alive": 0})
    assert r.options.stop == ("x",) and r.options.num_predict == -1
    for body, words in [({"model": "m", "options": {"typical_p": 0.5}}, "'options.typical_p' is not supported"),
                        ({"model": "m", "options": {"num_predict": 0}}, "'options.num_predict' must be at least 1"),
                        ({"model": "m", "think": True}, "'think' is not supported"),
                        ({"model": "m", "context": [1, 2]}, "'context' is not supported"),
                        ({"model": "m", "top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true."),
                        ({"model": "", "prompt": "p"}, "'model' is invalid")]:
        with pytest.raises(HttpError) as e:
            _parse(GenerateRequest, body)
        assert words in e.value.message, (body, e.value.message)
    assert _parse(GenerateRequest, {"prompt": "p"}).model is None  # left out: the served model (README)
    assert _parse(ChatRequest, {"messages": []}).model is None


def test_bodies_with_lone_surrogates_name_the_field():
    with pytest.raises(HttpError) as e:
        json_object(b'{"messages": [{"role": "user", "content": "a\\udc00"}]}')
    assert e.value.message.startswith("messages[0].content contains a lone surrogate (\\udc00 at character 1)")
    with pytest.raises(HttpError, match="a key of options contains a lone surrogate"):
        json_object(b'{"options": {"\\ud800": 1}}')


def test_a_hugging_face_snapshot_is_served_by_its_repo_id(tmp_path):
    from kafilad.control.api_common import check_model, model_id
    snap = tmp_path / "hub" / "models--mlx-community--Qwen3-8B-4bit" / "snapshots" / "0123abcd"
    s = SimpleNamespace(model_dir=str(snap), info=SimpleNamespace(model_id="0123abcd"))
    assert model_id(s) == "mlx-community/Qwen3-8B-4bit"
    assert check_model(s, "mlx-community/Qwen3-8B-4bit") == check_model(s, "0123abcd") == model_id(s)
    assert check_model(s, "mlx-community/Qwen3-8B-4bit:latest", suffixes=(":latest",)) == model_id(s)
    with pytest.raises(HttpError) as e:
        check_model(s, "Qwen3-8B-4bit")
    assert e.value.status == 404 and e.value.code == "model_not_found"
    plain = SimpleNamespace(model_dir=str(tmp_path / "stories260K"), info=SimpleNamespace(model_id="stories260K"))
    assert model_id(plain) == "stories260K"
