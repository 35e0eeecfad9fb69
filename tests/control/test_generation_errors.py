"""What an HTTP client is told when its generation fails (kafilad/control/api_common.py `generation_error`).

A new user's report (2026-12-01): a streaming request in flight when a member was SIGKILLed ended
with "The session is loading; it serves requests once it is ready." — the sentence naming the lost
member, which `kafila-ctl generate` shows, was replaced by the session's state.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import trio

from kafila_ctl.demo import packaged_model_dir
from kafilad.modelinfo import read_model_info

from control.http_harness import exchange, http_request
from node.healing_host import ready_host

from kafilad.control.api_common import generation_error
from kafilad.errors import INVALID_LOGIT_BIAS, ContextTooLongError, GenerationError, SessionNotReadyError
from kafilad.node.session.host import HostSession
from kafilad.proto.session import HostState
from kafilad.control.node_view import SessionOnly


def session_in(state: HostState) -> HostSession:
    s = object.__new__(HostSession)  # only its state is read here
    s.machine = SimpleNamespace(state=state)
    return s


def test_a_request_failed_by_a_lost_member_names_it_and_then_the_state():
    dropped = "the connection dropped without a goodbye (network loss, or the other side was killed)"
    e = GenerationError(f"member mc (qyjt2e4o) left the session: {dropped}")
    err = generation_error(e, session_in(HostState.LOADING))
    assert err.status == 503 and err.kind == "service_unavailable"
    assert err.message == (f"Member mc (qyjt2e4o) left the session: {dropped}. "
                           "The session is loading; it serves requests once it is ready.")
    assert any(name == "retry-after" for name, _ in err.headers)


def test_a_request_that_never_started_is_told_the_state_alone():
    err = generation_error(SessionNotReadyError("The session is not ready to generate (state: loading).", state="loading"),
                           session_in(HostState.LOADING))
    assert err.status == 503 and err.message == "The session is loading; it serves requests once it is ready."


def test_in_a_ready_session_a_failure_is_a_500_with_its_sentence():
    err = generation_error(GenerationError("member mb is unreachable: the ring link closed"), session_in(HostState.READY))
    assert err.status == 500 and err.message == "member mb is unreachable: the ring link closed"


def test_a_stream_the_host_ended_by_leaving_is_told_in_whole_sentences_and_what_to_do():
    """A new user's trial: "the host closed the session. The session is closed; no session is being served..."."""
    err = generation_error(GenerationError("the host closed the session"), session_in(HostState.CLOSED))
    assert err.status == 503 and err.message == (
        "The host closed the session. The session is closed, so no session is being served by this daemon; host one "
        "with `kafila-ctl host --model MODEL` and admit its members, or send requests to the API of the daemon "
        "hosting a session.")


async def answer(path: str, body: dict) -> tuple[int, dict]:
    """POST `body` to a real HostSession holding stories260K's tokenizer, context 512 (as tests/control/
    test_ollama_fields.py): its generate refuses a prompt that does not fit before the ring is used."""
    h = await ready_host()
    h.model_dir = str(packaged_model_dir())
    h.info = read_model_info(h.model_dir)
    h.context = 512
    h._chat_tokenizer = None
    status, _, out = await exchange(http_request("POST", path, body=json.dumps(body).encode()), SessionOnly(h))
    return status, json.loads(out)


def test_a_prompt_that_fills_the_context_without_max_tokens_does_not_blame_max_tokens():
    """A new user's trial: a long chat with no max_tokens was told "... plus 'max_tokens' 256 exceeds ...", a field
    the request did not have; the default is what the context leaves, and here it leaves nothing."""
    long = "Once upon a time " * 200
    for path, body, field in [("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages"),
                              ("/v1/completions", {"prompt": long}, "prompt")]:
        status, out = trio.run(answer, path, body)
        error = out["error"]
        assert status == 400 and error["param"] == field and error["code"] == "context_length_exceeded", out
        assert "max_tokens" not in error["message"] and error["message"].endswith(
            f"tokens) leaves no room to generate in the session's context of 512 tokens; shorten the {field}."), out
    status, out = trio.run(answer, "/v1/completions", {"prompt": long, "max_tokens": 4})  # one it sent is named
    assert status == 400 and "plus 'max_tokens' 4 exceeds" in out["error"]["message"]


def test_the_default_max_tokens_note_needs_the_numbers():
    e = ContextTooLongError("x", prompt_tokens=600, max_tokens=256, context=512)
    e.prompt_field = "prompt"
    err = generation_error(e, session_in(HostState.READY))
    assert (err.status, err.param, err.message) == (
        400, "prompt", "The prompt (600 tokens) leaves no room to generate in the session's context of 512 tokens; "
                       "shorten the prompt.")


def test_a_head_refusing_the_sampling_is_a_400_by_its_code_not_its_words():
    """Issue 25 item 3: `generation_error` decides on the error's type and code (the head's `gen_error`
    carries INVALID_LOGIT_BIAS), never on its text: the same words without the code are a 500."""
    said = "The head mb cannot sample this request: 'logit_bias' names token 99999, outside the vocabulary."
    err = generation_error(GenerationError(said, INVALID_LOGIT_BIAS), session_in(HostState.READY))
    assert (err.status, err.param) == (400, "logit_bias")
    assert generation_error(GenerationError(said), session_in(HostState.READY)).status == 500


def test_words_about_the_admitted_context_are_not_a_context_refusal():
    e = GenerationError("member mb failed: the session's admitted context was changed under it")
    assert generation_error(e, session_in(HostState.READY)).status == 500
    too_long = ContextTooLongError("x", prompt_tokens=9, max_tokens=8, context=16)
    assert generation_error(too_long, session_in(HostState.READY)).code == "context_length_exceeded"
