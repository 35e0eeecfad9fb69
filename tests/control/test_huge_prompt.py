"""One HTTP client's huge prompt never holds up the host's event loop (a new user's trial: a 3.9 MB
prompt was tokenized on the trio thread for 3 s, the ring's links went silent, the ring broke).

The real HttpServer and API handler over trio's memory streams (tests/control/http_harness.py)
serve a real HostSession (tests/node/healing_host.py) holding stories260K's real tokenizer, in a
subclass that records, for each call that reads the prompt, how much text it read, whether it ran
on the trio thread, and how often the event loop ran a ticker task meanwhile. A prompt past the
context is refused by the tokenizer's lower bound without being encoded
(kafilad/executor/tokenizer.py `min_tokens`); one the bound lets through is encoded in a worker
thread while the loop keeps ticking (kafilad/node/serving/host_requests.py `off_loop`). The tests count
what ran where, never how long it took: a loaded machine makes everything slower, not different.
"""

from __future__ import annotations

import json
import threading

import attrs
import pytest
import trio

from kafila_ctl.demo import packaged_model_dir
from kafilad.executor.tokenizer import Tokenizer, load_tokenizer
from kafilad.modelinfo import read_model_info
from kafilad.control.node_view import SessionOnly

from control.http_harness import exchange, http_request
from node.healing_host import ready_host

SENTENCE = "the cat sat on the mat and the dog ran far away. "  # 49 characters, 21 tokens


@attrs.frozen
class Call:
    """One tokenizer call on the prompt: `method`, the characters it read, whether it ran on the trio
    thread, and how many times the loop's ticker ran while it did (`ticks_meanwhile`)."""
    method: str
    chars: int
    on_loop: bool
    ticks_meanwhile: int


class RecordingTokenizer(Tokenizer):
    """stories260K's tokenizer, recording a :class:`Call` for each `encode`, `min_tokens` and
    `apply_chat_template`; `loop_ticks` is counted up by a task on the event loop (`post`)."""

    def __init__(self, wrapper):
        super().__init__(wrapper)
        self.loop_thread = threading.get_ident()  # made on the trio thread
        self.loop_ticks = 0
        self.calls: list[Call] = []

    def _recorded(self, method: str, chars: int, fn, *args, **kwargs):
        before = self.loop_ticks
        out = fn(*args, **kwargs)
        self.calls.append(Call(method, chars, threading.get_ident() == self.loop_thread, self.loop_ticks - before))
        return out

    def encode(self, text, *args, **kwargs):
        return self._recorded("encode", len(text), self._wrapper.encode, text, *args, **kwargs)

    def min_tokens(self, text: str) -> int:
        return self._recorded("min_tokens", len(text), super().min_tokens, text)

    def apply_chat_template(self, messages, *args, **kwargs):
        chars = sum(len(m.get("content", "")) for m in messages)
        return self._recorded("apply_chat_template", chars, self._wrapper.apply_chat_template, messages, *args, **kwargs)

    def encoded_chars(self) -> list[int]:
        return [c.chars for c in self.calls if c.method == "encode"]


async def host(context: int):
    h = await ready_host()
    h.model_dir = str(packaged_model_dir())
    h.info = read_model_info(h.model_dir)
    h.context = context
    h._chat_tokenizer = RecordingTokenizer(load_tokenizer(h.model_dir)._wrapper)
    return h


async def post(h, path: str, body: dict) -> tuple[int, dict]:
    """(status, answer) of one request, while a task on the loop counts up `loop_ticks` at every turn."""
    tok = h._chat_tokenizer

    async def ticker():
        while True:
            await trio.sleep(0)
            tok.loop_ticks += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        status, _, out = await exchange(http_request("POST", path, body=json.dumps(body).encode()),
                                        SessionOnly(h))
        nursery.cancel_scope.cancel()
    return status, json.loads(out)


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
        return h, *await post(h, path, body)
    h, status, answer = trio.run(main)
    error = answer["error"]
    assert status == 400 and (error if isinstance(error, str) else error["message"]) == message
    calls = h._chat_tokenizer.calls
    assert max(h._chat_tokenizer.encoded_chars(), default=0) < 10_000  # the 3.9 MB text was never encoded
    assert any(c.method == "min_tokens" and c.chars >= len(SENTENCE) * 80000 for c in calls), calls  # the bound refused it
    assert [c for c in calls if c.on_loop] == []  # nothing read the prompt on the trio thread


def test_the_loop_serves_on_while_a_long_prompt_is_tokenized():
    async def main():
        h = await host(300_000)  # the bound (280000) lets the 2 MB prompt through: it is encoded
        return h, *await post(h, "/v1/completions", {"prompt": SENTENCE * 40000, "max_tokens": 1})
    h, status, answer = trio.run(main)
    assert status == 400 and answer["error"]["message"] == (
        "The prompt (840002 tokens) plus 'max_tokens' 1 exceeds the session's context of 300000 tokens.")
    encodes = [c for c in h._chat_tokenizer.calls if c.method == "encode"]
    assert [c.chars for c in encodes] == [len(SENTENCE) * 40000]
    assert not encodes[0].on_loop, encodes  # in a worker thread ...
    assert encodes[0].ticks_meanwhile > 0, encodes  # ... while the loop ran other tasks (the encoder lets go of the GIL)
