"""Rendezvous server with real clients over real WebSockets on loopback (proto_spec/03-rendezvous.md).

`trio.fail_after` below guards against hangs only; nothing here asserts on timing.
"""

from __future__ import annotations

import contextlib
import hashlib
from contextlib import AsyncExitStack
from functools import partial

import msgpack
import pytest
import trio
import trio_websocket

from kafilad.errors import LocalProtocolError, SessionError
from kafilad.node.session.rdv_client import (
    Disconnected,
    MemberJoined,
    MemberLeft,
    RendezvousErrorEvent,
    SessionClosed,
    Signal,
    open_rendezvous,
)
from kafilad.proto.rendezvous import (
    RendezvousLimits,
    close_clause,
    decode_message,
    encode_control,
    encode_relay,
    parse_relay_record,
)
from kafilad.proto.identity import fingerprint, peer_id
from kafilad.proto.rendezvous_proof import Challenge, make_proof, public_key
from kafilad.rendezvous.server import OUTBOUND_QUEUE_MESSAGES, serve_rendezvous

HANG_GUARD_S = 20


def key(label: str) -> bytes:
    """A fixed X25519 static private key per test peer label ("H", "A", ...)."""
    return hashlib.blake2b(label.encode(), digest_size=32).digest()


def pid(label: str) -> str:
    """The peer id of `key(label)` (proto_spec 01 §1.1)."""
    return peer_id(public_key(key(label)))


H, A, B, C, R = (pid(x) for x in "HABCR")
#: the host fingerprint of key("H")'s sessions (the code's part after '-'), which a join carries
HFP = fingerprint(public_key(key("H")))


def rdv(url: str, label: str, name: str):
    """open_rendezvous as the daemon whose static key is `key(label)`."""
    return open_rendezvous(url, static_private=key(label), name=name)


async def raw_challenge(raw) -> Challenge:
    """Read the `challenge` a raw WebSocket gets on connect (proto_spec §2.4)."""
    hello = decode_message(await raw.get_message()).fields
    assert hello["t"] == "challenge"
    return Challenge(hello["server_public"], hello["nonce"])


def join_msg(label: str, sid: str, name: str, challenge: Challenge, **override) -> bytes:
    """A `join` proven with `key(label)` against `challenge`; `override` replaces fields."""
    static_public, proof = make_proof(key(label), challenge, "join", sid, name)
    return encode_control({"t": "join", "session_id": sid, "host_fingerprint": HFP, "peer_id": pid(label), "name": name,
                           "static_public": static_public, "proof": proof, **override})


async def raw_join(raw, label: str, sid: str, name: str) -> None:
    """Join `sid` over a raw WebSocket as the holder of `key(label)`."""
    await raw.send_message(join_msg(label, sid, name, await raw_challenge(raw)))
    assert decode_message(await raw.get_message()).type == "joined"


def run_with_server(test_fn, **server_kwargs):
    """Start a real rendezvous on 127.0.0.1:0, run `test_fn(url)`, stop the server."""

    async def main():
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_rendezvous, "127.0.0.1", 0, **server_kwargs))
            with trio.fail_after(HANG_GUARD_S):
                await test_fn(f"ws://127.0.0.1:{port}")
            nursery.cancel_scope.cancel()

    trio.run(main)


async def session(stack: AsyncExitStack, url: str, peers: list[str], members: int | None = None):
    """Host "H" registers; each peer in `peers` joins. Returns (sid, host client, member clients)."""
    host = await stack.enter_async_context(rdv(url, "H", "host"))
    sid = await host.register("stories260K", members or len(peers) + 1, {"memory_bytes": 1 << 30})
    clients = []
    for peer in peers:
        client = await stack.enter_async_context(rdv(url, peer, peer.lower()))
        assert await client.join(sid, HFP) == H
        assert await host.events.receive() == MemberJoined(pid(peer), peer.lower())
        for earlier in clients:
            assert await earlier.events.receive() == MemberJoined(pid(peer), peer.lower())
        clients.append(client)
    return sid, host, clients


def test_register_join_unknown_and_full_session():
    async def body(url):
        async with AsyncExitStack() as stack:
            sid, host, [a] = await session(stack, url, ["A"], members=2)
            assert len(sid) == 8 and sid == host.session_id
            assert a.roster == [{"peer_id": H, "name": "host"}, {"peer_id": A, "name": "a"}]
            late = await stack.enter_async_context(rdv(url, "B", "b"))
            with pytest.raises(SessionError) as full:
                await late.join(sid, HFP)
            assert str(full.value) == f"Session {sid!r} already has all 2 members."
            with pytest.raises(SessionError, match="No session 'zzzzzzzz' is open at this rendezvous"):
                await late.join("zzzzzzzz", HFP)
            with pytest.raises(SessionError, match="is the host of session"):
                await (await stack.enter_async_context(rdv(url, "H", "x"))).join(sid, HFP)

    run_with_server(body)


def test_unreachable_rendezvous_is_a_session_error():
    async def main():
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        port = listener.socket.getsockname()[1]
        await listener.aclose()  # nothing listens there now
        with pytest.raises(SessionError, match=f"Cannot reach the rendezvous at ws://127.0.0.1:{port}: ") as e:
            async with rdv(f"ws://127.0.0.1:{port}", "H", "h"):
                pass
        assert "HandshakeError()" not in str(e.value)  # a sentence, not the library's repr (new-user report)
        for url in ("notaurl", "http://127.0.0.1:9"):
            with pytest.raises(SessionError, match=rf"^The rendezvous URL '{url}' is not a WebSocket URL: it must "
                                                   r"look like ws://HOST:PORT or wss://HOST:PORT\.$"):
                async with rdv(url, "H", "h"):
                    pass

    trio.run(main)


def test_circuits_relay_bytes_both_ways_ids_unique_and_close_propagates():
    async def body(url):
        async with AsyncExitStack() as stack:
            _, host, [a, b] = await session(stack, url, ["A", "B"])
            c_ha = await host.open_circuit(A, "ring")
            c_ah = await a.accept_circuit()
            assert (c_ah.circuit_id, c_ah.peer_id, c_ah.label) == (c_ha.circuit_id, H, "ring")
            assert (c_ha.peer_id, c_ha.label) == (A, "ring")
            payloads = [b"", b"\x00" * 9, bytes(range(256)) * 4, b"x" * a.limits.max_relay_payload_bytes]
            for p in payloads:
                await c_ha.send_message(p)
                await c_ah.send_message(p[::-1])
            assert [await c_ah.receive_message() for _ in payloads] == payloads
            assert [await c_ha.receive_message() for _ in payloads] == [p[::-1] for p in payloads]
            c_ab = await a.open_circuit(B, "ring")
            c_bh = await b.open_circuit(H, "shards")
            c_ha2 = await host.open_circuit(A, "ring")
            assert (await b.accept_circuit()).label == "ring"
            assert (await host.accept_circuit()).label == "shards"
            assert (await a.accept_circuit()).circuit_id == c_ha2.circuit_id
            ids = {c_ha.circuit_id, c_ab.circuit_id, c_bh.circuit_id, c_ha2.circuit_id}
            assert len(ids) == 4 and all(0 < i < 2**64 for i in ids)
            await c_ha.send_message(b"last words")
            await c_ha.aclose()
            assert await c_ah.receive_message() == b"last words"
            with pytest.raises(trio.EndOfChannel):
                await c_ah.receive_message()
            assert c_ah.close_reason == "closed by peer"
            with pytest.raises(trio.BrokenResourceError, match=f"The circuit to {H} is closed"):
                await c_ah.send_message(b"too late")
            with pytest.raises(trio.ClosedResourceError):
                await c_ha.send_message(b"after my own close")
            await c_ha2.send_message(b"other circuits still work")
            assert await (await _circuit(a, c_ha2.circuit_id)).receive_message() == b"other circuits still work"

    run_with_server(body)


async def _circuit(client, circuit_id):
    return client._circuits[circuit_id]


def test_member_disconnect_closes_its_circuits_and_notifies_others():
    async def body(url):
        async with AsyncExitStack() as stack:
            _, host, [a, b] = await session(stack, url, ["A", "B"], members=4)
            async with rdv(url, "C", "c") as c:
                await c.join(host.session_id, HFP)
                for client in (host, a, b):
                    assert await client.events.receive() == MemberJoined(C, "c")
                c_hc = await host.open_circuit(C, "ring")
                c_bc = await b.open_circuit(C, "ring")
                await c.accept_circuit()
                await c.accept_circuit()
                c_hb = await host.open_circuit(B, "ring")
            # C's connection is closed now
            for client in (host, a, b):
                event = await client.events.receive()
                assert isinstance(event, MemberLeft) and event.peer_id == C and event.type == "member_left"
                assert event.reason == "it closed the connection"  # plain words, no close code (new user's report)
            for circuit in (c_hc, c_bc):
                with pytest.raises(trio.EndOfChannel):
                    await circuit.receive_message()
                assert circuit.close_reason.startswith("Peer 'c' left the session")
            await c_hb.send_message(b"survivors unaffected")
            assert await (await b.accept_circuit()).receive_message() == b"survivors unaffected"

    run_with_server(body)


def test_a_dropped_member_connection_is_told_in_plain_words_and_its_code_logged(caplog):
    """A new user's report: "its connection closed (1006 ABNORMAL_CLOSURE)" is jargon; the others are
    told what happened in words, and the close code stays in the rendezvous's log."""
    caplog.set_level("INFO", logger="kafilad.rendezvous.server")

    async def body(url):
        async with AsyncExitStack() as stack:
            _, host, [a] = await session(stack, url, ["A"], members=3)
            await a._ws._stream.aclose()  # its TCP connection ends without a WebSocket close, as a killed process's
            assert await host.events.receive() == MemberLeft(
                A, "the connection dropped without a goodbye (network loss, or the other side was killed)")

    run_with_server(body)
    assert "closed (1006 ABNORMAL_CLOSURE)" in caplog.text


def test_a_member_whose_daemon_stops_says_goodbye(caplog):
    """A new user's trial (2026-12-02): `kafila-ctl stop` on a member showed in the host's trace as
    "the connection dropped without a goodbye (network loss, or the other side was killed)": the
    stopping daemon's cancellation cut its WebSocket close short. It closes with 1001 now."""
    caplog.set_level("INFO", logger="kafilad.rendezvous.server")

    async def body(url):
        async with AsyncExitStack() as stack:
            sid, host, _ = await session(stack, url, [], members=3)
            with trio.CancelScope() as daemon:  # the member daemon's root scope
                async with rdv(url, "A", "a") as a:
                    assert await a.join(sid, HFP) == H
                    assert await host.events.receive() == MemberJoined(A, "a")
                    daemon.cancel()  # SIGTERM
                    await trio.sleep_forever()
            assert await host.events.receive() == MemberLeft(A, "it is going away (shutting down)")

    run_with_server(body)
    assert "1001 GOING_AWAY" in caplog.text


def test_close_codes_read_as_sentences():
    assert close_clause(1000) == "it closed the connection"
    assert close_clause(1001) == "it is going away (shutting down)"
    assert close_clause(1001, "no pong", who="the rendezvous") == "the rendezvous is going away (shutting down): no pong"
    assert close_clause(None, peer="the rendezvous") == close_clause(1006, peer="the rendezvous") == (
        "the connection dropped without a goodbye (network loss, or the rendezvous was killed)")
    assert close_clause(1008, "A control message of 9 bytes exceeds the limit.") == (
        "it closed the connection: A control message of 9 bytes exceeds the limit")
    assert close_clause(4999) == "it closed the connection"
    for code in (1000, 1001, 1002, 1006, 1008, 1009, 1011, 4001, 4999):
        assert str(code) not in close_clause(code) and "CLOSURE" not in close_clause(code)


def test_host_leaving_closes_the_session_for_members():
    async def body(url):
        async with AsyncExitStack() as stack:
            _, host, [a] = await session(stack, url, ["A"])
            sid = host.session_id
            circuit = await a.open_circuit(H, "ring")
            await host.accept_circuit()
            await host.leave("shutting down")
            with pytest.raises(trio.EndOfChannel):
                await circuit.receive_message()
            assert await a.events.receive() == SessionClosed(
                sid, "The host 'host' left the session: shutting down")
            assert a.session_id is None
            probe = await stack.enter_async_context(rdv(url, "Z", "z"))
            with pytest.raises(SessionError, match="No session"):
                await probe.join(sid, HFP)

    run_with_server(body)


def test_signal_is_delivered_with_its_sender():
    async def body(url):
        async with AsyncExitStack() as stack:
            _, host, [a] = await session(stack, url, ["A"])
            await a.send_signal(H, {"candidates": ["192.0.2.1:4000"], "ufrag": b"\x01\x02"})
            assert await host.events.receive() == Signal(A, {"candidates": ["192.0.2.1:4000"], "ufrag": b"\x01\x02"})
            await a.send_signal("nobody", 1)
            event = await a.events.receive()
            assert event == RendezvousErrorEvent(
                "unknown_peer", f"Peer 'nobody' is not a member of session {host.session_id!r}.")

    run_with_server(body)


def test_losing_the_rendezvous_breaks_circuits_and_reports_disconnected():
    async def main():
        async with trio.open_nursery() as outer:
            server_scope = trio.CancelScope()

            async def server(task_status=trio.TASK_STATUS_IGNORED):
                with server_scope:
                    await serve_rendezvous("127.0.0.1", 0, task_status=task_status)

            port = await outer.start(server)
            url = f"ws://127.0.0.1:{port}"
            with trio.fail_after(HANG_GUARD_S):
                async with AsyncExitStack() as stack:
                    _, host, [a] = await session(stack, url, ["A"])
                    circuit = await host.open_circuit(A, "ring")
                    await a.accept_circuit()
                    server_scope.cancel()
                    with pytest.raises(trio.BrokenResourceError, match=f"The circuit to {A} broke"):
                        await circuit.receive_message()
                    event = await host.events.receive()
                    assert isinstance(event, Disconnected) and event.type == "disconnected"
                    assert event.reason == ("the connection dropped without a goodbye (network loss, or the "
                                            "rendezvous was killed)")
                    with pytest.raises(trio.BrokenResourceError, match="rendezvous at ws://127.0.0.1.* is lost"):
                        await a.accept_circuit()
                    with pytest.raises(trio.EndOfChannel):
                        await host.events.receive()
                    with pytest.raises(trio.BrokenResourceError, match=f"The circuit to {A} is closed"):
                        await circuit.send_message(b"x")
                    with pytest.raises(SessionError, match="lost"):
                        await host.open_circuit(A, "ring")

    trio.run(main)


@pytest.mark.parametrize(
    "bad, code, close_code",
    [
        (b"\x05garbage", "malformed", 1008),
        ("a text message", "malformed", 1008),
        (encode_control({"t": "join", "session_id": None}), "malformed", 1008),
        (encode_relay(1, b"y" * 70_000), "message_too_large", 1009),
    ],
    ids=["unknown-kind", "text", "mistyped-field", "oversized-relay"],
)
def test_malformed_message_closes_that_connection_only(bad, code, close_code):
    async def body(url):
        async with AsyncExitStack() as stack:
            _, host, [a] = await session(stack, url, ["A"], members=4)
            circuit = await host.open_circuit(A, "ring")
            peer_side = await a.accept_circuit()
            async with trio_websocket.open_websocket_url(url) as raw:
                await raw_join(raw, "R", host.session_id, "raw")
                await raw.send_message(bad)
                err = decode_message(await raw.get_message()).fields
                assert (err["t"], err["code"], err["fatal"]) == ("error", code, True)
                with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                    await raw.get_message()
                assert closed.value.reason.code == close_code
                assert closed.value.reason.reason == err["reason"][:120]
            for client in (host, a):
                assert await client.events.receive() == MemberJoined(R, "raw")
                left = await client.events.receive()
                assert left == MemberLeft(R, f"it sent a bad message: {err['reason']}")
            await circuit.send_message(b"still relaying")
            assert await peer_side.receive_message() == b"still relaying"
            newcomer = await stack.enter_async_context(rdv(url, "N", "n"))
            assert await newcomer.join(host.session_id, HFP) == H

    run_with_server(body)


def test_relay_record_holds_exactly_the_forwarded_payloads(tmp_path):
    record = tmp_path / "relay.bin"
    sent = [b"\x00\x01ciphertext", b"", b"z" * 65_535]

    async def body(url):
        async with AsyncExitStack() as stack:
            _, host, [a] = await session(stack, url, ["A"])
            c1 = await host.open_circuit(A, "ring")
            c2 = await a.accept_circuit()
            for p in sent:
                await c1.send_message(p)
                assert await c2.receive_message() == p
            await c2.send_message(b"back")
            assert await c1.receive_message() == b"back"
            await a.send_signal(H, {"cand": "x"})
            await host.events.receive()
            parsed = parse_relay_record(record.read_bytes())
            assert parsed == [(c1.circuit_id, p) for p in sent] + [(c1.circuit_id, b"back"),
                                                                   (0, msgpack.packb({"cand": "x"}))]

    run_with_server(body, record_path=str(record))


def test_record_path_from_environment(tmp_path, monkeypatch):
    record = tmp_path / "env-relay.bin"
    monkeypatch.setenv("KAFILA_RELAY_RECORD", str(record))

    async def body(url):
        async with AsyncExitStack() as stack:
            _, host, [a] = await session(stack, url, ["A"])
            c1 = await host.open_circuit(A, "ring")
            await c1.send_message(b"opaque")
            assert await (await a.accept_circuit()).receive_message() == b"opaque"
            assert parse_relay_record(record.read_bytes()) == [(c1.circuit_id, b"opaque")]

    run_with_server(body)


def test_oversized_message_is_refused_locally_with_a_clear_error():
    async def body(url):
        async with AsyncExitStack() as stack:
            _, host, [a] = await session(stack, url, ["A"])
            circuit = await host.open_circuit(A, "ring")
            limit = host.limits.max_relay_payload_bytes
            with pytest.raises(LocalProtocolError) as exc:
                await circuit.send_message(b"x" * (limit + 1))
            assert str(exc.value) == (f"A relayed message of {limit + 1} bytes exceeds the relay's limit of "
                                      f"{limit} bytes; chunk it into Noise messages first.")
            await circuit.send_message(b"ok")
            assert await (await a.accept_circuit()).receive_message() == b"ok"

    run_with_server(body)


def test_session_byte_budget_exhausted_closes_the_circuit_with_a_clear_error():
    async def body(url):
        async with AsyncExitStack() as stack:
            sid, host, [a] = await session(stack, url, ["A"])
            sender = await host.open_circuit(A, "ring")
            receiver = await a.accept_circuit()
            await sender.send_message(b"a" * 600)
            await sender.send_message(b"b" * 600)  # 1,200 > 1,000: dropped
            assert await receiver.receive_message() == b"a" * 600
            with pytest.raises(trio.EndOfChannel):
                await receiver.receive_message()
            reason = f"Session {sid!r} has used its relay budget of 1000 bytes; the circuit is closed."
            assert receiver.close_reason == reason
            assert await host.events.receive() == RendezvousErrorEvent("budget_exhausted", reason)
            with pytest.raises(trio.EndOfChannel):
                await sender.receive_message()

    run_with_server(body, limits=RendezvousLimits(session_budget_bytes=1000))


def test_rate_limit_slows_but_delivers_everything():
    async def body(url):
        async with AsyncExitStack() as stack:
            _, host, [a] = await session(stack, url, ["A"])
            sender = await host.open_circuit(A, "ring")
            receiver = await a.accept_circuit()
            chunks = [bytes([i]) * 1000 for i in range(20)]  # 20 kB at 100 kB/s after a 5 kB burst

            async def send_all():
                for chunk in chunks:
                    await sender.send_message(chunk)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_all)
                assert [await receiver.receive_message() for _ in chunks] == chunks

    run_with_server(body, limits=RendezvousLimits(session_rate_Bps=100_000.0, session_burst_bytes=5_000.0))


# --- identity: proof of the static key (proto_spec §2.4) -----------------------------------------


def test_squatter_with_a_stolen_peer_id_is_refused_and_the_real_member_joins_the_last_slot():
    async def body(url):
        async with AsyncExitStack() as stack:
            sid, host, _ = await session(stack, url, [], members=2)
            async with trio_websocket.open_websocket_url(url) as squatter:
                challenge = await raw_challenge(squatter)
                await squatter.send_message(encode_control({"t": "join", "session_id": sid, "peer_id": A,
                                                            "name": "a"}))  # A's id, shown in `status`
                err = decode_message(await squatter.get_message()).fields
                assert (err["code"], err["fatal"]) == ("proof_required", False)
                # A's public key with a proof made by the squatter's own key
                forged = decode_message(join_msg("S", sid, "a", challenge)).fields
                await squatter.send_message(encode_control({**forged, "peer_id": A,
                                                            "static_public": public_key(key("A"))}))
                err = decode_message(await squatter.get_message()).fields
                assert err["code"] == "bad_proof" and err["reason"].startswith(f"The proof for peer {A!r}")
                async with rdv(url, "A", "a") as real:
                    assert await real.join(sid, HFP) == H
                    assert await host.events.receive() == MemberJoined(A, "a")
                    await squatter.send_message(join_msg("S", sid, "s", challenge))  # its own key: session full
                    err = decode_message(await squatter.get_message()).fields
                    assert (err["code"], err["reason"]) == ("session_full",
                                                            f"Session {sid!r} already has all 2 members.")

    run_with_server(body)


def test_a_proof_seen_on_one_connection_is_refused_on_another():
    async def body(url):
        async with AsyncExitStack() as stack:
            sid, host, _ = await session(stack, url, [], members=3)
            async with trio_websocket.open_websocket_url(url) as victim, \
                    trio_websocket.open_websocket_url(url) as replayer:
                seen = join_msg("A", sid, "a", await raw_challenge(victim))
                await raw_challenge(replayer)
                await replayer.send_message(seen)
                err = decode_message(await replayer.get_message()).fields
                assert (err["code"], err["fatal"]) == ("bad_proof", False)
                await victim.send_message(seen)
                assert decode_message(await victim.get_message()).type == "joined"
                assert await host.events.receive() == MemberJoined(A, "a")

    run_with_server(body)


def test_a_proven_reconnect_replaces_the_stale_connection():
    async def body(url):
        async with AsyncExitStack() as stack:
            sid, host, [old] = await session(stack, url, ["A"])  # a full session of 2
            stale = await host.open_circuit(A, "ring")
            await old.accept_circuit()
            new = await stack.enter_async_context(rdv(url, "A", "a"))
            assert await new.join(sid, HFP) == H
            reason = f"Peer {A!r} joined session {sid!r} again from a newer connection, which replaces this one."
            assert await old.events.receive() == RendezvousErrorEvent("superseded", reason)
            gone = await old.events.receive()
            assert gone == Disconnected(f"the rendezvous closed the connection: {reason}")
            assert await host.events.receive() == MemberLeft(A, "it rejoined from a new connection")
            assert await host.events.receive() == MemberJoined(A, "a")
            with pytest.raises(trio.EndOfChannel):
                await stale.receive_message()
            fresh = await host.open_circuit(A, "ring")
            await fresh.send_message(b"to the new connection")
            assert await (await new.accept_circuit()).receive_message() == b"to the new connection"

    run_with_server(body)


def test_a_rendezvous_without_challenge_is_a_clear_session_error():
    async def silent(request):
        ws = await request.accept()
        await ws.get_message()  # never says a word

    async def main():
        async with trio.open_nursery() as nursery:
            server = await nursery.start(partial(trio_websocket.serve_websocket, silent, "127.0.0.1", 0, None))
            url = f"ws://127.0.0.1:{server.port}"
            with pytest.raises(SessionError) as exc:
                async with open_rendezvous(url, static_private=key("A"), name="a", connect_timeout_s=0.5):
                    pass
            assert str(exc.value) == (f"Cannot use the rendezvous at {url}: it sent no key challenge within 0.5 s; "
                                      "it may run a Kafila version without key proofs (proto_spec 03 §2.4), so "
                                      "upgrade it.")
            with pytest.raises(LocalProtocolError, match="32 bytes"):
                async with open_rendezvous(url, static_private=b"short", name="a"):
                    pass
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_wedged_stale_connection_does_not_stall_the_reconnect():
    """The stale connection reads nothing and its queue is full: it is aborted, the rejoin completes."""
    async def body(url):
        async with AsyncExitStack() as stack:
            sid, host, _ = await session(stack, url, [], members=2)
            wedged_ws = trio_websocket.open_websocket_url(url, message_queue_size=1, disconnect_timeout=1)
            # a client that reads nothing cannot finish its own close handshake either
            with contextlib.suppress(trio_websocket.DisconnectionTimeout):
                async with wedged_ws as wedged, trio.open_nursery() as nursery:
                    await raw_join(wedged, "A", sid, "a")  # then never reads again
                    assert await host.events.receive() == MemberJoined(A, "a")

                    circuit = await host.open_circuit(A, "ring")
                    sent = []

                    async def flood():  # fills the TCP buffers, then the server's queue to `wedged`
                        with contextlib.suppress(trio.BrokenResourceError):  # until the circuit closes
                            while True:
                                await circuit.send_message(b"x" * 60_000)
                                sent.append(1)
                    nursery.start_soon(flood)
                    await trio.sleep(0.5)  # let the flood reach the server (not asserted on)
                    async with rdv(url, "A", "a") as new:
                        assert await new.join(sid, HFP) == H
                    assert len(sent) > OUTBOUND_QUEUE_MESSAGES  # the queue to `wedged` was full
                    assert await host.events.receive() == MemberLeft(A, "it rejoined from a new connection")

    run_with_server(body)


def test_a_websocket_that_never_registers_is_closed_after_the_deadline():
    """Issue 9: idle WebSockets cannot pile up; registered and joined ones stay past the deadline."""
    async def body(url):
        async with AsyncExitStack() as stack:
            _, host, [a] = await session(stack, url, ["A"], members=3)
            t0 = trio.current_time()
            async with trio_websocket.open_websocket_url(url) as idle:
                await raw_challenge(idle)
                with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                    await idle.get_message()
                assert closed.value.reason.code == 1008
                assert closed.value.reason.reason == f"did not register or join a session within {REGISTER_S:g} s"
            assert trio.current_time() - t0 >= REGISTER_S  # closed by its deadline, not before (hang guard: run_with_server)
            await trio.sleep(REGISTER_S + 0.1)  # the registered host and the joined member are still served
            newcomer = await stack.enter_async_context(rdv(url, "N", "n"))
            assert await newcomer.join(host.session_id, HFP) == H
            assert await host.events.receive() == MemberJoined(N, "n")
            assert await a.events.receive() == MemberJoined(N, "n")

    run_with_server(body, register_timeout_s=REGISTER_S)


#: the register deadline in the test above: long enough for a loaded machine to connect and register
#: the clients that do (each must within it, in real time), short enough to wait out
REGISTER_S = 2.0
N = pid("N")


async def raw_http(url: str, request: bytes) -> bytes:
    """Send `request` over a plain TCP connection to the rendezvous at `url`; all it answers until it closes."""
    host, port = url.removeprefix("ws://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(request)
        out = b""
        while data := await stream.receive_some(65536):
            out += data
    return out


def test_a_plain_http_request_is_told_this_is_a_rendezvous_websocket():
    """A new user's trial: `curl localhost:17400/` got "400" with an empty body."""
    async def body(url):
        got = await raw_http(url, b"GET / HTTP/1.1\r\nHost: x\r\nUser-Agent: curl/8\r\nAccept: */*\r\n\r\n")
        head, _, text = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 426 Upgrade Required\r\n") and b"upgrade: websocket" in head
        assert text == (b"This is a Kafila rendezvous: connect with a WebSocket "
                        b"(kafilad --rendezvous ws://HOST:PORT).\n")
        got = await raw_http(url, b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 426 ") and got.endswith(b"\r\n\r\n")  # no body for HEAD
        async with AsyncExitStack() as stack:  # WebSockets are served as before
            _, host, [a] = await session(stack, url, ["A"], members=3)

    run_with_server(body)


def test_the_log_names_the_close_code_the_rendezvous_sent(caplog):
    """A new user's trial: the log read "connection 1 closed (1000 NORMAL_CLOSURE)" for a connection the
    rendezvous had just closed with 1008 (the 1000 was the peer's echo of the close)."""
    caplog.set_level("INFO", logger="kafilad.rendezvous.server")

    async def body(url):
        async with trio_websocket.open_websocket_url(url) as idle:
            await raw_challenge(idle)
            with pytest.raises(trio_websocket.ConnectionClosed):
                await idle.get_message()

    run_with_server(body, register_timeout_s=0.2)
    assert ("connection 1 closed by the rendezvous (1008 POLICY_VIOLATION: did not register or join a session "
            "within 0.2 s)") in caplog.text
    assert "NORMAL_CLOSURE" not in caplog.text
