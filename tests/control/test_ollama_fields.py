"""A refusal of an Ollama request names the option the client sent (kafilad/control/ollama_api.py
`OLLAMA_FIELDS`), never the OpenAI field it maps to.

A new user's report: `options.num_predict` past the session's context was refused as "The prompt
(5 tokens) plus 'max_tokens' 10000 exceeds ...", a field their request did not have. The real
HttpServer and API handler over trio's memory streams (tests/control/http_harness.py) serve a
real HostSession (a ready HostMachine, tests/node/healing_host.py) holding the packaged
stories260K's tokenizer; its `generate` refuses the request before the ring is used.
"""

from __future__ import annotations

import json

import pytest
import trio

from kafila_ctl.demo import packaged_model_dir
from kafilad.modelinfo import read_model_info
from kafilad.control.node_view import SessionOnly

from control.http_harness import exchange, http_request
from node.healing_host import ready_host

PROMPT = "Once upon a time"  # 5 tokens of stories260K's tokenizer, BOS included


async def answer(path: str, body: dict) -> tuple[int, bytes]:
    h = await ready_host()
    h.model_dir = str(packaged_model_dir())
    h.info = read_model_info(h.model_dir)
    h.context = 512
    h._chat_tokenizer = None  # loaded from model_dir on first use, as before a session runs
    status, _, out = await exchange(http_request("POST", path, body=json.dumps(body).encode()), SessionOnly(h))
    return status, out


@pytest.mark.parametrize("stream", [False, True])
def test_num_predict_past_the_context_is_refused_naming_num_predict(stream):
    status, body = trio.run(answer, "/api/generate",
                            {"prompt": PROMPT, "stream": stream, "options": {"num_predict": 10000}})
    assert status == 400 and json.loads(body) == {
        "error": "The prompt (5 tokens) plus 'options.num_predict' 10000 exceeds the session's context of 512 tokens."}


def test_the_openai_route_still_names_max_tokens():
    status, body = trio.run(answer, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10000})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "max_tokens" and error["message"] == (
        "The prompt (5 tokens) plus 'max_tokens' 10000 exceeds the session's context of 512 tokens.")
