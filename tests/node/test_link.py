"""Secure links (kafilad/node/paths/link.py): LinkEnded vs LinkBroken, HandshakeTimeout vs HandshakeRefused.

In-memory transports only; the handshake timeout runs under trio's MockClock.
"""

from __future__ import annotations

import functools
import logging

import pytest
import trio
import trio.testing
from trio.testing import trio_test

from kafilad import errors
from kafilad.errors import (
    HandshakeError,
    HandshakeRefused,
    HandshakeTimeout,
    KafilaError,
    LinkBroken,
    LinkClosed,
    LinkEnded,
)
from kafilad.net.frame_stream import FrameStream
from kafilad.net.transport import StreamMessageTransport, memory_message_transport_pair
from kafilad.node.paths import link as link_mod
from kafilad.node.paths.link import Link, secure_link
from kafilad.proto import identity
from kafilad.proto.frames import encode_frame
from kafilad.proto.noise import generate_keypair

SESSION = "k3v9q2xa"


def test_link_closed_is_the_one_in_the_error_hierarchy():
    assert link_mod.LinkClosed is errors.LinkClosed
    assert issubclass(LinkClosed, KafilaError)
    assert issubclass(LinkEnded, LinkClosed) and issubclass(LinkBroken, LinkClosed)
    assert issubclass(Link, FrameStream)


def _links() -> tuple[Link, Link, trio.abc.Stream]:
    left, right = trio.testing.memory_stream_pair()
    a = Link(left, peer_id="pb", peer_name="m2", label="ring")
    b = Link(right, peer_id="pa", peer_name="m1", label="ring")
    return a, b, left


# --- LinkEnded / LinkBroken ----------------------------------------------------------------------


@trio_test
async def test_a_clean_close_by_the_peer_ends_the_link():
    a, b, _ = _links()
    n = await a.send({"t": "act", "x": 1})
    assert n == a.bytes_sent == len(encode_frame({"t": "act", "x": 1}))
    await a.close()
    assert await b.receive() == {"t": "act", "x": 1}
    with pytest.raises(LinkEnded) as info:
        await b.receive()
    assert info.value.reason == "m1 closed the link" == b.closed_reason
    assert not isinstance(info.value, LinkBroken)


@trio_test
async def test_our_own_close_ends_the_link_with_our_reason():
    a, b, _ = _links()
    await a.close("member left the session")
    with pytest.raises(LinkEnded, match="member left the session"):
        await a.send({"t": "late"})
    with pytest.raises(LinkEnded, match="member left the session"):
        await a.receive()
    assert a.closed_reason == "member left the session"


@trio_test
async def test_a_malformed_frame_breaks_the_link_and_is_logged(caplog):
    a, b, left = _links()
    await left.send_all(b"\x00\x00\x00\x04\x93\x01\x02\x03")  # a msgpack array, not a map
    with caplog.at_level(logging.WARNING, logger="kafilad.link"):
        with pytest.raises(LinkBroken, match="malformed frame from m1: .*not a map") as info:
            await b.receive()
    assert info.value.reason == b.closed_reason
    assert "closing ring link with m1: malformed frame from m1" in caplog.text
    with pytest.raises(LinkBroken, match="malformed frame from m1"):  # later calls say the same
        await b.send({"t": "x"})
    with pytest.raises(LinkBroken, match="malformed frame from m1"):
        await b.receive()


@trio_test
async def test_the_peer_dying_inside_a_frame_breaks_the_link():
    a, b, left = _links()
    frame = encode_frame({"t": "act", "h": b"\x00" * 100})
    await left.send_all(frame[:50])
    await left.aclose()
    with pytest.raises(LinkBroken, match="malformed frame from m1: The stream ended inside a frame"):
        await b.receive()


@trio_test
async def test_sending_to_a_peer_that_is_gone_breaks_the_link():
    a, b, _ = _links()
    await b.close()
    with pytest.raises(LinkBroken, match="link to m2 broke while sending"):
        await a.send({"t": "act"})


# --- secure_link ---------------------------------------------------------------------------------


def _hello(name: str) -> dict:
    return {"peer_id": name + "-id", "name": name, "role": "ring"}


def _accept(remote_static: bytes, hello: dict) -> str:
    return hello["name"]


async def _secure_pair(t_init, t_resp, *, check_init=_accept, check_resp=_accept, timeout_s=20.0):
    """Both sides of secure_link at once; each result is (link, static, hello) or the exception."""
    (ip, _), (rp, _) = generate_keypair(), generate_keypair()
    out: dict = {}

    async def side(key, transport, initiator, priv, name, check):
        try:
            out[key] = await secure_link(transport, initiator=initiator, static_private=priv, session_id=SESSION,
                                         hello=_hello(name), check_remote=check, label="ring", timeout_s=timeout_s)
        except HandshakeError as e:
            out[key] = e

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, "i", t_init, True, ip, "m1", check_init)
        nursery.start_soon(side, "r", t_resp, False, rp, "m2", check_resp)
    return out["i"], out["r"]


@trio_test
async def test_secure_link_carries_frames_and_names_the_peer():
    ti, tr = memory_message_transport_pair()
    (li, static_r, hello_r), (lr, static_i, hello_i) = await _secure_pair(ti, tr)
    assert (li.peer_name, li.peer_id, lr.peer_name, lr.peer_id) == ("m2", "m2-id", "m1", "m1-id")
    assert hello_r == _hello("m2") and len(static_r) == len(static_i) == 32
    await li.send({"t": "act", "x": 7})
    assert await lr.receive() == {"t": "act", "x": 7}
    await li.close()
    with pytest.raises(LinkEnded, match="m1 closed the link"):
        await lr.receive()


@trio_test
async def test_undecryptable_message_breaks_the_link():
    ti, tr = memory_message_transport_pair()
    (li, _, _), (lr, _, _) = await _secure_pair(ti, tr)
    await li.stream.transport.send_message(b"\x00" * 40)  # not sealed with the link's key (a tampering relay)
    with pytest.raises(LinkBroken, match="undecryptable message from m1: .*failed authentication"):
        await lr.receive()
    with pytest.raises(LinkBroken, match="undecryptable message from m1"):
        await lr.send({"t": "x"})


def test_a_silent_peer_is_a_handshake_timeout():
    async def main():
        ti, tr = memory_message_transport_pair()  # nobody answers on tr
        with pytest.raises(HandshakeTimeout, match="the Noise handshake on the ring link did not finish within 5 s"):
            await secure_link(ti, initiator=True, static_private=generate_keypair()[0], session_id=SESSION,
                              hello=_hello("m1"), check_remote=_accept, label="ring", timeout_s=5.0)
        assert trio.current_time() == pytest.approx(5.0)
        with pytest.raises(trio.BrokenResourceError):  # the transport was closed
            await tr.send_message(b"late")

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@trio_test
async def test_a_transport_lost_during_the_handshake_is_a_handshake_timeout():
    left, right = trio.testing.memory_stream_pair()
    await right.send_all(b"\x00\x40partial")  # a 64-byte message that never completes
    await right.aclose()
    with pytest.raises(HandshakeTimeout, match=r"the ring link closed during the Noise handshake \(BrokenResourceError\)"):
        await secure_link(StreamMessageTransport(left), initiator=True, static_private=generate_keypair()[0],
                          session_id=SESSION, hello=_hello("m1"), check_remote=_accept, label="ring")


@trio_test
async def test_a_key_refused_by_check_remote_is_handshake_refused_on_both_sides():
    def roster_check(remote_static, hello):
        raise HandshakeError(f"peer {identity.peer_id(remote_static)} is not in this session's roster")

    ti, tr = memory_message_transport_pair()
    i, r = await _secure_pair(ti, tr, check_resp=roster_check)
    assert isinstance(r, HandshakeRefused) and "is not in this session's roster" in str(r)
    assert str(r).startswith("peer ")  # the check's message, kept
    assert isinstance(i, HandshakeRefused) and not isinstance(i, HandshakeTimeout)
    assert "The peer refused the secure channel: peer " in str(i)


@trio_test
async def test_an_initiator_refusal_is_handshake_refused_on_both_sides():
    def code_check(remote_static, hello):
        raise HandshakeError("the host's key does not match the session code; refusing to join")

    ti, tr = memory_message_transport_pair()
    i, r = await _secure_pair(ti, tr, check_init=code_check)
    assert isinstance(i, HandshakeRefused) and "does not match the session code" in str(i)
    assert isinstance(r, HandshakeRefused) and "before Noise handshake message 3" in str(r)


@trio_test
async def test_another_session_is_neither_timeout_nor_refusal():
    ti, tr = memory_message_transport_pair()
    (ip, _), (rp, _) = generate_keypair(), generate_keypair()
    out: dict = {}

    async def side(key, transport, initiator, priv, session_id):
        try:
            await secure_link(transport, initiator=initiator, static_private=priv, session_id=session_id,
                              hello=_hello(key), check_remote=_accept, label="ring")
        except HandshakeError as e:
            out[key] = e

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, "i", ti, True, ip, SESSION)
        nursery.start_soon(functools.partial(side, "r", tr, False, rp, "otherid1"))
    assert "prologue" in str(out["i"])
    assert not isinstance(out["i"], (HandshakeTimeout, HandshakeRefused))
