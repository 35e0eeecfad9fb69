"""One HTTP client's huge prompt never holds up the host's event loop (a new user's trial: a 3.9 MB
prompt was tokenized on the trio thread for 3 s, the ring's links went silent, the ring broke).

The real HttpServer and API handler over trio's memory streams (tests/control/http_harness.py)
serve a real HostSession (tests/node/healing_host.py) holding stories260K's real tokenizer, in a
subclass that records the length of each text it encodes. A prompt past the context is refused by
the tokenizer's lower bound without being encoded (kafilad/executor/tokenizer.py `min_tokens`);
one the bound lets through is encoded in a worker thread while the loop keeps ticking
(kafilad/node/host_requests.py `off_loop`).
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import trio

from kafila_ctl.demo import packaged_model_dir
from kafilad.executor.tokenizer import Tokenizer, load_tokenizer
from kafilad.modelinfo import read_model_info

from control.http_harness import exchange, http_request
from node.healing_host import ready_host

SENTENCE = "the cat sat on the mat and the dog ran far away. "  # 49 characters, 21 tokens


class RecordingTokenizer(Tokenizer):
    """stories260K's tokenizer, recording the length of every text it encodes."""

    def __init__(self, wrapper):
        super().__init__(wrapper)
        self.encoded_chars: list[int] = []

    def encode(self, text, *args, **kwargs):
        self.encoded_chars.append(len(text))
        return self._wrapper.encode(text, *args, **kwargs)


async def host(context: int):
    h = await ready_host()
    h.model_dir = str(packaged_model_dir())
    h.info = read_model_info(h.model_dir)
    h.context = context
    h._chat_tokenizer = RecordingTokenizer(load_tokenizer(h.model_dir)._wrapper)
    return h


async def post(h, path: str, body: dict) -> tuple[int, dict, float, float]:
    """(status, answer, seconds it took, the longest the event loop went without running a 10 ms ticker)."""
    ticks = [time.perf_counter()]

    async def ticker():
        while True:
            await trio.sleep(0.01)
            ticks.append(time.perf_counter())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        t0 = time.perf_counter()
        status, _, out = await exchange(http_request("POST", path, body=json.dumps(body).encode()),
                                        SimpleNamespace(session=h))
        took_s = time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    return status, json.loads(out), took_s, max(b - a for a, b in zip(ticks, ticks[1:]))


@pytest.mark.parametrize("path,body,message", [
    ("/v1/completions", {"prompt": SENTENCE * 80000, "max_tokens": 1},
     "The prompt (at least 560000 tokens) plus 'max_tokens' 1 exceeds the session's context of 512 tokens."),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SENTENCE * 80000}], "max_tokens": 1},
     "The prompt (at least 560003 tokens) plus 'max_tokens' 1 exceeds the session's context of 512 tokens."),
    ("/api/chat", {"messages": [{"role": "user", "content": SENTENCE * 80000}], "stream": False},
     "The prompt (at least 560003 tokens) leaves no room to generate in a context of 512 tokens."),
    ("/api/generate", {"prompt": SENTENCE * 80000, "stream": False},
     "The prompt (at least 560000 tokens) leaves no room to generate in a context of 512 tokens."),
])
def test_a_prompt_past_the_context_is_refused_without_being_tokenized(path, body, message):
    async def main():
        h = await host(512)
        status, answer, took_s, _ = await post(h, path, body)
        return h, status, answer, took_s
    h, status, answer, took_s = trio.run(main)
    error = answer["error"]
    assert status == 400 and (error if isinstance(error, str) else error["message"]) == message
    assert max(h._chat_tokenizer.encoded_chars, default=0) < 10_000  # the 3.9 MB text was never encoded
    assert took_s < 1.0, took_s  # encoding it took 3 s


def test_the_loop_serves_on_while_a_long_prompt_is_tokenized():
    async def main():
        h = await host(300_000)  # the bound (280000) lets the 2 MB prompt through: it is encoded
        return h, *await post(h, "/v1/completions", {"prompt": SENTENCE * 40000, "max_tokens": 1})
    h, status, answer, took_s, stall_s = trio.run(main)
    assert status == 400 and answer["error"]["message"] == (
        "The prompt (840002 tokens) plus 'max_tokens' 1 exceeds the session's context of 300000 tokens.")
    assert h._chat_tokenizer.encoded_chars == [len(SENTENCE) * 40000]
    assert stall_s < 0.3 < took_s, (stall_s, took_s)  # ~1.5 s of encoding, in a worker thread
