"""The pure parts of a stream that survives a member's loss (kafilad/node/serving/host_requests.py
`StreamReplay`, `resumable`, `seeded`, `Continuation`; issue 25 item 4)."""

from __future__ import annotations

import trio
from trio.testing import trio_test

from kafilad.node.serving.host_requests import Continuation, StreamReplay, continuable, resumable, seeded
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
    assert not resumable(0.8, None)  # goes on by `Continuation` instead
    assert resumable(0.0, Sampling(temperature=0.0, presence_penalty=0.5))
    assert resumable(0.0, Sampling(temperature=0.9, seed=3, frequency_penalty=0.2))
    assert not resumable(0.0, Sampling(temperature=0.9))


def test_a_request_sampled_beyond_the_temperature_gets_a_seed_and_a_temperature_only_one_goes_on():
    top_p = seeded(0.0, Sampling(temperature=0.9, top_p=0.5))
    assert top_p.seed is not None and resumable(0.0, top_p)  # replayed exactly after a loss
    assert seeded(0.0, Sampling(temperature=0.9, seed=4, top_p=0.5)).seed == 4  # the client's own kept
    plain = Sampling(temperature=0.9)
    assert seeded(0.0, plain) is plain and seeded(0.9, None) is None  # the fast path is kept
    assert continuable(plain) and continuable(None) and not continuable(Sampling(temperature=0.9, top_k=3))
    assert seeded(0.0, Sampling(temperature=0.0, top_k=3)).seed is None  # greedy: nothing to draw


def test_a_continuation_joins_the_earlier_tokens_and_text_to_the_last_run():
    c = Continuation()
    assert c.joined({"text": "x", "token_ids": [1]}) == {"text": "x", "token_ids": [1]}  # nothing resumed
    c.raw.extend(["Once", " upon", " a"])  # the ring's text of each event handed (before stop sequences)
    c.keep([(5, "Once"), (6, " upon")])  # the third event never reached the client
    assert c.ids == [5, 6] and c.raw == ["Once", " upon"]
    out = c.joined({"text": " a time", "token_ids": [7, 8], "prompt_tokens": 9, "finish_reason": "length"})
    assert out == {"text": "Once upon a time", "token_ids": [5, 6, 7, 8], "prompt_tokens": 7, "finish_reason": "length"}
    done = c.joined(c.finished(7))  # every token was handed; only the end was lost
    assert done["token_ids"] == [5, 6] and done["text"] == "Once upon" and done["prompt_tokens"] == 7


@trio_test
async def test_a_continued_run_hands_every_event_to_the_client():
    got = []

    async def emit(e):
        got.append(e["token_id"])
    s = StreamReplay(emit)
    await s.emit(ev(5, "a"))
    s.go_on()  # the new run prefilled token 5: its first event is the next token
    await s.emit(ev(7, "c"))
    assert got == [5, 7] and s.sent == [(5, "a"), (7, "c")] and s.diverged is None
