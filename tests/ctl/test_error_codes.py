"""Callers decide on an error's code, never on its text (issue 25 item 3).

A real control server (kafilad/control/server.py) on a real socket, with handlers of the test's own,
answers kafila-ctl's client (kafila_ctl/client.py): the error's `code` (proto_spec 05 §4) reaches the
client as DaemonRefused.code, and the chat loop's "the conversation no longer fits" decision follows
that code; the daemon's rejoin and re-host loops decide on JoinRefused / RendezvousRefused codes
(kafilad/proto/comeback.py).
"""

from __future__ import annotations

import pytest
import trio

from kafila_ctl.client import ControlClient, DaemonRefused
from kafilad.control.server import serve_control
from kafilad.errors import (ALREADY_IN_SESSION, CONTEXT_LENGTH_EXCEEDED, DENIED, DUPLICATE_PEER, HOST_KEY_MISMATCH,
                            SESSION_COMPLETE, ContextTooLongError, JoinRefused, KafilaError, RendezvousRefused,
                            SessionError, collapse_groups)
from kafilad.proto.comeback import rehost_gives_up, rejoin_gives_up


def _handlers():
    async def too_long(args, emit):
        raise ContextTooLongError("The prompt (9 tokens) plus --max-tokens 8 exceeds the session's admitted "
                                  "context of 16 tokens.", prompt_tokens=9, max_tokens=8, context=16)

    async def says_admitted_context(args, emit):  # the same words, no code: not a context refusal
        raise KafilaError("The session's admitted context is 16 tokens.")

    async def in_a_nursery(args, emit):  # a refusal wrapped by a nursery keeps its code
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            raise ContextTooLongError("too long", prompt_tokens=9, max_tokens=8, context=16)

    return {"too_long": too_long, "says_admitted_context": says_admitted_context, "in_a_nursery": in_a_nursery}


async def _refusal(op: str, tmp_path) -> DaemonRefused:
    with collapse_groups():
        async with trio.open_nursery() as nursery:
            path = await nursery.start(lambda task_status: serve_control(
                tmp_path / "k.sock", _handlers(), task_status=task_status))
            try:
                with trio.fail_after(30):
                    await ControlClient(path).call(op)
            except DaemonRefused as e:
                return e
            finally:
                nursery.cancel_scope.cancel()
    raise AssertionError(f"'{op}' was not refused")


@pytest.mark.parametrize("op, code", [("too_long", CONTEXT_LENGTH_EXCEEDED), ("says_admitted_context", ""),
                                      ("in_a_nursery", CONTEXT_LENGTH_EXCEEDED)])
def test_a_refusal_reaches_kafila_ctl_with_its_code(tmp_path, op, code):
    e = trio.run(_refusal, op, tmp_path)
    assert e.code == code
    assert ("admitted context" in str(e)) == (op != "in_a_nursery")  # the text alone would have mis-decided


@pytest.mark.parametrize("error, gives_up", [
    (JoinRefused("The host refused this device: the session is already complete.", SESSION_COMPLETE), True),
    (JoinRefused("The host refused this device with `kafila-ctl deny`.", DENIED), True),
    (JoinRefused("Refusing to join session abcd2345: the host's key does not match.", HOST_KEY_MISMATCH), True),
    # the words the old loop stopped on, without a host's refusal behind them: retried
    (SessionError("The host refused this device: it cannot be reached."), False),
    (SessionError("Refusing to join: the rendezvous is unreachable."), False),
    # the host still holds this device's old link: a later try may pass
    (JoinRefused("The host refused this device: this device is already in the session.", ALREADY_IN_SESSION), False),
])
def test_the_rejoin_loop_gives_up_on_a_refusal_code_alone(error, gives_up):
    assert rejoin_gives_up(error) is gives_up


@pytest.mark.parametrize("error, gives_up", [
    (RendezvousRefused("Session 'abcd2345' is held by another host key.", DUPLICATE_PEER), True),
    (RendezvousRefused("Session 'abcd2345' is held by another host key.", "rate_limited"), False),
    (KafilaError("Session 'abcd2345' is held by another host key."), False),
    (RendezvousRefused("The rendezvous is full.", "session_full"), False),
])
def test_the_rehost_loop_forgets_the_session_on_duplicate_peer_alone(error, gives_up):
    assert rehost_gives_up(error) is gives_up
