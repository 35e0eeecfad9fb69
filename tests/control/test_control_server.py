"""The control server (kafilad/control/server.py) with handler tables of the test's own: failures
injected into handlers end one connection, never the server; connection and request-size limits,
the total bound on unfinished request frames, the request timeout (MockClock), a client that does
not read its events, and a client that leaves."""

from __future__ import annotations

import struct

import msgpack
import pytest
import trio
import trio.testing

from kafilad.control.api import API_VERSION, FramedStream, request
from kafilad.control.server import ControlLimits, ControlServer, serve_control
from kafilad.proto.frames import encode_frame


class Boom(Exception):
    pass


def table(log: list):
    async def ok(args, emit):
        return {"echo": args}

    async def boom(args, emit):
        raise Boom("injected")

    async def group(args, emit):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            raise Boom("injected in a nursery")

    async def unencodable(args, emit):
        return {"a set": {1, 2}}

    async def bad_event(args, emit):
        await emit({"t": "token", "value": object()})
        return "unreachable"

    async def hold(args, emit):
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            log.append("hold cancelled")
            raise

    async def flood(args, emit):
        for i in range(args["n"]):
            await emit({"t": "token", "i": i, "pad": b"p" * args.get("pad", 0)})
            await trio.sleep(0.001)
        return "done"

    return {"ok": ok, "boom": boom, "group": group, "unencodable": unencodable, "bad_event": bad_event,
            "hold": hold, "flood": flood}


async def call(path, op, **args):
    stream = FramedStream(await trio.open_unix_socket(str(path)))
    await stream.send(request(op, args))
    events = []
    while True:
        msg = await stream.receive()
        if msg is None or msg["t"] == "reply":
            await stream.aclose()
            return msg, events
        events.append(msg)


def with_server(test, limits=ControlLimits(), log=None):
    async def main(tmp):
        async with trio.open_nursery() as nursery:
            path = await nursery.start(lambda task_status: serve_control(
                tmp / "k.sock", table(log if log is not None else []), limits=limits,
                cancel_on_disconnect=frozenset({"hold"}), task_status=task_status))
            with trio.fail_after(30):
                await test(path)
            nursery.cancel_scope.cancel()
    return main


@pytest.mark.parametrize("op, words", [
    ("boom", "Internal error in 'boom': Boom('injected')"),
    ("group", "Internal error in 'group'"),
    ("unencodable", "could not encode its reply"),
    ("bad_event", "msgpack cannot encode"),
])
def test_a_failing_handler_gets_an_error_reply_and_the_server_goes_on(tmp_path, op, words):
    async def test(path):
        reply, _ = await call(path, op)
        assert reply["ok"] is False and words in reply["error"]
        reply, _ = await call(path, "ok", x=1)
        assert reply == {"t": "reply", "ok": True, "result": {"echo": {"x": 1}}}
    trio.run(with_server(test), tmp_path)


async def _raw_exchange(path, raw: bytes) -> dict:
    """Send `raw` on a fresh connection; the one reply frame the server sent before closing."""
    s = await trio.open_unix_socket(str(path))
    await s.send_all(raw)
    data = b""
    while chunk := await s.receive_some(65536):
        data += chunk
    await s.aclose()
    assert len(data) >= 4 and struct.unpack(">I", data[:4])[0] == len(data) - 4, data
    return msgpack.unpackb(data[4:])


HINT = "a control request is a u32 big-endian length, then that many bytes of one msgpack map (proto_spec 02 §1)."
SHAPE = 'a control request is {"t": "request", "v": 1, "op": NAME, "args": {NAME: VALUE, ...}}.'


@pytest.mark.parametrize("raw, error", [
    (b"\x00\x00\x00\x00", f"The control request's length prefix announces 0 bytes (first bytes 00 00 00 00), not 1 "
                          f"to 16777216; {HINT}"),
    (b"\xff\xff\xff\xff", "The control request's length prefix announces 4294967295 bytes (first bytes ff ff ff ff), "
                          f"not 1 to 16777216; {HINT}"),
    (b"hello kafila\n", "The control request's length prefix announces 1751477356 bytes (first bytes 68 65 6c 6c), "
                        f"not 1 to 16777216; {HINT}"),
    (struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1",
     f"The control request's 5 bytes are not msgpack: its first byte 0xc1 is not a msgpack type; {HINT}"),
    (struct.pack(">I", 2) + b"\x92\x01", f"The control request's 2 bytes are not msgpack: the bytes end inside a "
                                        f"msgpack value; {HINT}"),
    (struct.pack(">I", 3) + msgpack.packb([1, 2]), f"The control request is an array, not a map; {HINT}"),
    (struct.pack(">I", 3) + msgpack.packb("op"), f"The control request is a string, not a map; {HINT}"),
    (struct.pack(">I", 8) + msgpack.packb({"v": 1, "op": 2}), f'This frame\'s "t" is missing, not "request"; {SHAPE}'),
    (encode_frame({"t": "request"}), f'The control request has no "v" (the control API version; this kafilad speaks '
                                     f'v1); {SHAPE}'),
    (encode_frame({"t": "request", "v": API_VERSION}), f'The control request has no "op" naming its operation; {SHAPE}'),
    (encode_frame({"t": "request", "v": API_VERSION, "op": 5}),
     'The control request\'s "op" is an integer, not a string naming an operation.'),
    (encode_frame({"t": "reply", "v": API_VERSION, "op": "ok"}), f'This frame\'s "t" is \'reply\', not "request"; {SHAPE}'),
    (encode_frame({"t": "request", "v": API_VERSION, "op": "ok", "args": [1, 2]}),
     'The control request\'s "args" is an array; it must be a map of argument names to values (an empty map for '
     'none).'),
    (encode_frame({"t": "request", "v": API_VERSION, "op": "ok", "args": []}),
     'The control request\'s "args" is an array; it must be a map of argument names to values (an empty map for '
     'none).'),
])
def test_a_malformed_request_gets_an_error_reply_naming_the_fault_then_the_connection_closes(tmp_path, raw, error):
    """A new user's trial: raw bytes, invalid msgpack, a list or a string body, an impossible length prefix
    got a hang-up without a reply (the log read "... not valid msgpack (FormatError: )"); {"t": "request"}
    got only "Malformed control request."; "args": [] was taken for no arguments. Each gets an error reply
    in the protocol's shape (kafilad/control/api.py) saying what was wrong, and only its connection closes."""
    async def test(path):
        reply = await _raw_exchange(path, raw)
        assert reply == {"t": "reply", "ok": False, "error": error}
        reply, _ = await call(path, "ok")
        assert reply["ok"] is True
    trio.run(with_server(test), tmp_path)


def test_a_request_without_args_is_still_served(tmp_path):
    async def test(path):
        for body in ({"t": "request", "v": API_VERSION, "op": "ok"},
                     {"t": "request", "v": API_VERSION, "op": "ok", "args": None}):
            reply = await _raw_exchange(path, encode_frame(body))
            assert reply == {"t": "reply", "ok": True, "result": {"echo": {}}}
    trio.run(with_server(test), tmp_path)


def test_connections_past_the_limit_are_refused_with_a_sentence(tmp_path):
    log = []

    async def test(path):
        held = []
        for _ in range(2):
            s = FramedStream(await trio.open_unix_socket(str(path)))
            await s.send(request("hold"))
            held.append(s)
        await trio.sleep(0.2)
        reply, _ = await call(path, "ok")
        assert reply["ok"] is False and "answering 2 control connections, its limit" in reply["error"]
        for s in held:
            await s.aclose()
        await trio.sleep(0.2)
        assert log == ["hold cancelled"] * 2  # a client leaving ends its operation
        reply, _ = await call(path, "ok")
        assert reply["ok"] is True
    trio.run(with_server(test, ControlLimits(max_connections=2), log), tmp_path)


def test_unfinished_request_frames_are_bounded_in_total(tmp_path):
    async def test(path):
        big = encode_frame({"t": "request", "v": API_VERSION, "op": "ok", "args": {"pad": b"x" * 700_000}})
        a = await trio.open_unix_socket(str(path))
        await a.send_all(big[:600_000])
        await trio.sleep(0.2)
        b = await trio.open_unix_socket(str(path))
        with trio.move_on_after(5):
            await b.send_all(big[:600_000])  # the server discards the rest once it refused
        data = await b.receive_some(65536)
        reply = msgpack.unpackb(data[4:])
        assert reply["ok"] is False and "unfinished control requests, its limit" in reply["error"]
        await b.aclose()
        await a.send_all(big[600_000:])
        reply = FramedStream(a)
        got = await reply.receive()
        assert got["ok"] is True and len(got["result"]["echo"]["pad"]) == 700_000
        await a.aclose()
        big2 = encode_frame({"t": "request", "v": API_VERSION, "op": "ok", "args": {"pad": b"x" * 900_000}})
        c = await trio.open_unix_socket(str(path))
        await c.send_all(big2)  # over max_request_bytes: refused from its header, the rest discarded
        data = b""
        while chunk := await c.receive_some(65536):
            data += chunk
        assert msgpack.unpackb(data[4:])["error"].startswith(
            f"The control request's length prefix announces {len(big2) - 4} bytes (first bytes ")
        await c.aclose()
        reply, _ = await call(path, "ok")
        assert reply["ok"] is True
    trio.run(with_server(test, ControlLimits(max_request_bytes=800_000, max_total_request_bytes=1_000_000)), tmp_path)


def test_a_request_that_never_finishes_times_out():
    async def main():
        server = ControlServer(table([]))
        client, srv = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve_stream, srv)
            t0 = trio.current_time()
            await client.send_all(encode_frame({"t": "request", "v": API_VERSION, "op": "ok"})[:6])
            data = await client.receive_some(65536)
            assert trio.current_time() - t0 == pytest.approx(30.0)
            assert msgpack.unpackb(data[4:])["error"] == "The control request did not arrive within 30 s."
        assert server.held_request_bytes == 0 and server.connections == 0
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_client_that_does_not_read_its_events_has_its_operation_ended(tmp_path):
    async def test(path):
        s = FramedStream(await trio.open_unix_socket(str(path)))
        await s.send(request("flood", {"n": 100_000, "pad": 10_000}))
        await trio.sleep(1)  # not reading: the socket buffers fill, then the queue of 64 events
        n, reply = 0, None
        while (msg := await s.receive()) is not None:
            if msg["t"] == "reply":
                reply = msg
                break
            n += 1
        assert reply["ok"] is False and "did not read the events of 'flood' in time (64 waiting)" in reply["error"]
        assert n < 100_000
        reply, events = await call(path, "flood", n=5)
        assert reply["result"] == "done" and [e["i"] for e in events] == list(range(5))
    trio.run(with_server(test, ControlLimits(max_queued_events=64, send_timeout_s=5.0)), tmp_path)


def test_a_client_leaving_makes_the_next_emit_raise_instead_of_cancelling(tmp_path):
    """Ops not in cancel_on_disconnect (e.g. generate) end at their next emit, never mid-await."""
    log = []

    async def test(path):
        s = FramedStream(await trio.open_unix_socket(str(path)))
        await s.send(request("careful"))
        await trio.sleep(0.2)
        await s.aclose()
        await trio.sleep(0.5)
        assert log == ["emit raised ClientGone"]

    async def careful(args, emit):
        await trio.sleep(0.4)  # not cancelled although the client left meanwhile
        try:
            await emit({"t": "token"})
        except Exception as e:
            log.append(f"emit raised {type(e).__name__}")
            raise

    async def main(tmp):
        async with trio.open_nursery() as nursery:
            path = await nursery.start(lambda task_status: serve_control(
                tmp / "k.sock", {"careful": careful}, task_status=task_status))
            with trio.fail_after(30):
                await test(path)
            nursery.cancel_scope.cancel()
    trio.run(main, tmp_path)


def test_an_operation_running_when_the_daemon_stops_gets_an_error_reply_not_a_closed_connection(tmp_path):
    """Chaos run (seed 21, 2026-12-01): requests in flight when the host daemon got SIGTERM ended as
    "kafilad closed the control connection during 'generate' without a reply". The server's
    cancellation answers each operation not yet answered with a sentence, then closes."""
    log: list = []

    async def main(tmp):
        out = {}
        with trio.CancelScope() as daemon:
            async with trio.open_nursery() as nursery:
                path = await nursery.start(lambda task_status: serve_control(
                    tmp / "k.sock", table(log), cancel_on_disconnect=frozenset({"hold"}), task_status=task_status))
                s = FramedStream(await trio.open_unix_socket(str(path)))
                await s.send(request("flood", {"n": 10**9}))  # streams events until the daemon stops
                assert (await s.receive())["t"] == "event"
                daemon.cancel()
        events = 0
        while (msg := await s.receive()) is not None:
            if msg["t"] == "reply":
                out = msg
                break
            events += 1
        assert out["ok"] is False, out
        assert out["error"] == ("The daemon is shutting down, so 'flood' was not finished; send it again once "
                                "the daemon is back.")
    trio.run(main, tmp_path)


def test_an_argument_an_operation_does_not_take_is_refused_with_a_sentence(tmp_path):
    """A new user's trial: `schedule` with set="banana" answered the status, as if nothing was wrong;
    a misspelt argument was ignored silently. The daemon's operations take the arguments of
    kafilad/control/api.py OP_ARGS; anything else is refused naming it and what the op takes."""
    from kafilad.control.api import OP_ARGS, OPS

    async def status(args, emit):
        return {"state": "idle"}

    async def schedule(args, emit):
        return {"mode": args.get("mode", "auto")}

    async def main(tmp):
        async with trio.open_nursery() as nursery:
            path = await nursery.start(lambda task_status: serve_control(
                tmp / "k.sock", {"status": status, "schedule": schedule}, task_status=task_status))
            reply, _ = await call(path, "schedule", set="banana")
            assert reply["ok"] is False
            assert reply["error"] == "'schedule' takes no argument 'set'; it takes mode."
            reply, _ = await call(path, "status", verbose=True)
            assert reply["error"] == "'status' takes no argument 'verbose'; it takes none."
            reply, _ = await call(path, "schedule", mode="lockstep")
            assert reply["ok"] is True and reply["result"] == {"mode": "lockstep"}
            nursery.cancel_scope.cancel()
    assert set(OP_ARGS) == set(OPS)
    trio.run(main, tmp_path)
