"""A request through a remote head, and the typed frames on its channel (kafilad/node/serving/host_requests.py).

``HostRequests._generate_remote`` reads one channel per request: the head's ``GenEvent`` /
``GenDone`` / ``GenError`` (forwarded by the host's member loop), ``Cancel`` from ``generate`` when
the client goes away, and ``RequestFailed`` from ``HostSession._fail_requests`` when the session
fails the request (a member lost, the ring broken). The head here is the test, at the far end of a
real :class:`~kafilad.node.paths.link.Link` over trio's memory streams; it reads the frames the host
sends (proto_spec 05 §2 `gen`, §2.4 `cancel`).
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from trio.testing import trio_test

from kafilad.errors import GenerationError
from kafilad.node.session.host import HostSession
from kafilad.node.serving.host_requests import HostRequests, RequestFailed
from kafilad.node.paths.link import Link
from kafilad.proto import control as cf
from kafilad.proto.session_events import MemberEntry

HEAD = MemberEntry(peer_id="p-m2", name="m2", public_key=b"\x02" * 32)
REQ = "r-1"


class _Host:
    """The state `_generate_remote` and `_fail_requests` use of a HostSession: its links and channels,
    and its requests part."""

    def __init__(self, link: Link):
        self.links = {HEAD.peer_id: link}
        self.generations: dict = {}
        self.ring = None
        self.requests = HostRequests(self)

    fail_requests = HostSession._fail_requests


async def _request_cancelled_then(answer) -> dict | Exception:
    """Run one remote request, cancel it as `generate` does, then `answer(host, head_link)`; its outcome."""
    left, right = trio.testing.memory_stream_pair()
    host = _Host(Link(left, peer_id=HEAD.peer_id, peer_name="m2", label="ctl"))
    head = Link(right, peer_id="p-host", peer_name="host", label="ctl")
    events: list = []
    out: dict = {}

    async def emit(ev: dict) -> None:
        events.append(ev)

    async def run() -> None:
        try:
            out["result"] = await host.requests._generate_remote(HEAD, REQ, "Once", 8, 0.0, emit)
        except GenerationError as e:
            out["result"] = e

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        gen = cf.decode_control(await head.receive())
        assert isinstance(gen, cf.Gen) and (gen.req, gen.prompt, gen.max_tokens) == (REQ, "Once", 8)
        host.generations[REQ].send_nowait(cf.GenEvent(req=REQ, event={"t": "token", "token_id": 7, "text": " upon"}))
        host.generations[REQ].send_nowait(cf.Cancel(req=REQ, reason="The client went away."))
        cancel = cf.decode_control(await head.receive())
        assert cancel == cf.Cancel(req=REQ, reason="The client went away.")
        await answer(host)
    assert events == [{"t": "token", "token_id": 7, "text": " upon"}]
    assert REQ not in host.generations
    return out["result"]


@trio_test
async def test_the_heads_gen_error_after_a_cancel_ends_the_request_as_cancelled():
    async def head_answers(host) -> None:
        host.generations[REQ].send_nowait(cf.GenError(req=REQ, message="the request had not started"))

    result = await _request_cancelled_then(head_answers)
    assert result["finish_reason"] == "cancelled" and result["cancel_reason"] == "The client went away."
    assert result["token_ids"] == [7] and result["text"] == " upon" and result["cancelled_at_tokens"] == 1


@trio_test
async def test_a_session_failure_after_a_cancel_still_fails_the_request():
    async def session_fails(host) -> None:
        host.fail_requests("member m3 (p-m3) left the session: it stopped", "m3")

    result = await _request_cancelled_then(session_fails)
    assert isinstance(result, GenerationError) and str(result) == "member m3 (p-m3) left the session: it stopped"


@trio_test
async def test_fail_requests_puts_the_typed_gen_error_on_every_channel():
    left, _ = trio.testing.memory_stream_pair()
    host = _Host(Link(left, peer_id=HEAD.peer_id, peer_name="m2", label="ctl"))
    channels = {req: trio.open_memory_channel(4) for req in ("a", "b")}
    host.generations = {req: send for req, (send, _) in channels.items()}
    host.fail_requests("the ring broke", None)
    for req, (_, recv) in channels.items():
        f = recv.receive_nowait()
        assert isinstance(f, RequestFailed) and isinstance(f, cf.GenError)
        assert f.to_wire() == {"t": "gen_error", "req": req, "message": "the ring broke", "code": ""}
        with pytest.raises(trio.WouldBlock):
            recv.receive_nowait()
