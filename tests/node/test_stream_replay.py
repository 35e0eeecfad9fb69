"""The pure parts of a stream that survives a member's loss (kafilad/node/serving/host_requests.py
`StreamReplay`, `resumable`; issue 25 item 4)."""

from __future__ import annotations

import trio
from trio.testing import trio_test

from kafilad.node.serving.host_requests import StreamReplay, resumable
from kafilad.proto.sampling import Sampling


def ev(tok, text):
    return {"t": "token", "token_id": tok, "text": text}


@trio_test
async def test_a_second_run_hands_the_client_only_what_follows_the_pause():
    got = []

    async def emit(e):
        got.append(e)
    s = StreamReplay(emit)
    for e in (ev(5, "a"), ev(6, "b")):
        await s.emit(e)
    s.rewind()  # the member was lost: the request runs again from its prompt
    for e in (ev(5, "a"), ev(6, "b"), ev(7, "c"), ev(None, "!")):
        await s.emit(e)
    assert [(e["token_id"], e["text"]) for e in got] == [(5, "a"), (6, "b"), (7, "c"), (None, "!")]
    assert s.sent == [(5, "a"), (6, "b"), (7, "c"), (None, "!")] and s.diverged is None


@trio_test
async def test_a_run_that_differs_from_what_was_sent_hands_nothing_more_and_says_where():
    got = []

    async def emit(e):
        got.append(e["token_id"])
    s = StreamReplay(emit)
    await s.emit(ev(5, "a"))
    await s.emit(ev(6, "b"))
    s.rewind()
    await s.emit(ev(5, "a"))
    await s.emit(ev(9, "z"))
    await s.emit(ev(10, "y"))
    assert got == [5, 6] and s.diverged is not None and "event 2" in s.diverged


@trio_test
async def test_the_client_raising_ends_the_stream_as_before():
    async def emit(e):
        raise trio.BrokenResourceError("gone")
    s = StreamReplay(emit)
    try:
        await s.emit(ev(1, "x"))
    except trio.BrokenResourceError:
        pass
    else:
        raise AssertionError("the client's error was swallowed")


def test_only_requests_whose_tokens_follow_from_the_prompt_resume():
    assert resumable(0.0, None)
    assert not resumable(0.8, None)
    assert resumable(0.0, Sampling(temperature=0.0, presence_penalty=0.5))
    assert resumable(0.0, Sampling(temperature=0.9, seed=3, frequency_penalty=0.2))
    assert not resumable(0.0, Sampling(temperature=0.9))
