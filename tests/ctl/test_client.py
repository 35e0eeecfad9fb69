"""The typed control client (kafila_ctl/client.py) against a scripted daemon on a real Unix socket.

The daemon dying mid-frame must read as RemoteProtocolError, not as a clean end (issue 7 §3).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from trio.testing import trio_test

from kafila_ctl.client import ControlClient, DaemonNotRunning, DaemonStopped
from kafilad.control.api import API_VERSION, FramedStream
from kafilad.errors import KafilaError, RemoteProtocolError, collapse_groups
from kafilad.proto.frames import encode_frame


async def _serve_once(path: Path, script, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Accept one control connection on `path`, read the request, then run `script(stream, request)`."""
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(str(path))
    sock.listen(1)
    listener = trio.SocketListener(sock)
    task_status.started()
    stream = await listener.accept()
    await listener.aclose()
    async with stream:
        request = await FramedStream(stream).receive()
        await script(stream, request)


async def _run(tmp_path: Path, script, op: str = "status") -> list:
    path = tmp_path / "kafilad.sock"
    got: list = []
    with collapse_groups():  # the client's error, not a group (trio >= 0.25)
        async with trio.open_nursery() as nursery:
            await nursery.start(_serve_once, path, script)
            async for item in ControlClient(path).stream(op, verbose=True):
                got.append(item)
    return got


@trio_test
async def test_events_then_a_reply(tmp_path):
    seen: dict = {}

    async def script(stream, request):
        seen["request"] = request
        conn = FramedStream(stream)
        await conn.send({"t": "event", "kind": "token", "text": "Once"})
        await conn.send({"t": "reply", "ok": True, "result": {"state": "ready"}})

    got = await _run(tmp_path, script, "generate")
    assert seen["request"] == {"t": "request", "v": API_VERSION, "op": "generate", "args": {"verbose": True}}
    assert got == [("event", {"t": "event", "kind": "token", "text": "Once"}), ("result", {"state": "ready"})]


@trio_test
async def test_a_daemon_dying_inside_a_frame_is_a_remote_protocol_error(tmp_path):
    frame = encode_frame({"t": "reply", "ok": True, "result": {"state": "ready", "pad": "x" * 200}})

    async def script(stream, request):
        await stream.send_all(frame[: len(frame) // 2])  # then the connection closes

    with pytest.raises(RemoteProtocolError) as info:
        await _run(tmp_path, script)
    assert str(info.value) == (
        f"kafilad closed the control connection during 'status': The stream ended inside a frame "
        f"({len(frame) // 2} bytes of an unfinished frame).")


@trio_test
async def test_a_daemon_closing_between_frames_is_a_clean_end_without_reply(tmp_path):
    async def script(stream, request):
        await FramedStream(stream).send({"t": "event", "kind": "progress"})

    with pytest.raises(DaemonStopped) as info:
        await _run(tmp_path, script)
    assert not isinstance(info.value, RemoteProtocolError)
    sock = tmp_path / "kafilad.sock"  # nothing answers on it any more: the daemon stopped
    assert str(info.value) == (
        f"kafilad stopped during 'status': it closed the control connection without a reply, and nothing answers "
        f"on {sock} now. Its log says why: {tmp_path / 'kafilad.log'} (as a service: `systemctl --user status "
        f"kafilad` or `journalctl --user -u kafilad`); start it again as it was started (`systemctl --user start "
        f"kafilad`, or its own command line with `--state-dir {tmp_path}` and the same --rendezvous and --http).")


@trio_test
async def test_a_daemon_still_answering_that_closed_one_connection_did_not_stop(tmp_path):
    path = tmp_path / "kafilad.sock"
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(str(path))
    sock.listen(4)
    listener = trio.SocketListener(sock)
    async with listener:
        with pytest.raises(KafilaError) as info:
            with collapse_groups():
                async with trio.open_nursery() as nursery:
                    async def close_first():
                        stream = await listener.accept()
                        await FramedStream(stream).receive()
                        await stream.aclose()  # the listener goes on: the daemon still answers ...
                        probe = FramedStream(await listener.accept())
                        assert (await probe.receive())["op"] == "keys"  # ... the client's probe
                        await probe.send({"t": "reply", "ok": True, "result": {"name": "alpha"}})
                        await probe.aclose()
                    nursery.start_soon(close_first)
                    await ControlClient(path).call("watch")
    assert not isinstance(info.value, DaemonStopped)
    assert str(info.value) == (f"kafilad closed the control connection during 'watch' without a reply; its log may "
                               f"say why: {tmp_path / 'kafilad.log'}.")


@trio_test
async def test_an_error_reply_is_raised_with_its_sentence(tmp_path):
    async def script(stream, request):
        await FramedStream(stream).send({"t": "reply", "ok": False, "error": "No session is running."})

    with pytest.raises(KafilaError, match=r"^No session is running\.$"):
        await _run(tmp_path, script)


@trio_test
async def test_no_daemon(tmp_path):
    with pytest.raises(DaemonNotRunning, match=f"kafilad is not running at {tmp_path / 'kafilad.sock'}"):
        await ControlClient(tmp_path / "kafilad.sock").call("status")
