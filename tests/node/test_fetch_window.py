"""Byte-range fetches in flight (proto_spec 05 §2.1): the member's window and the host's bound.

The host answers a member's `fetch` frames from a task of its own, so its reading of that
member's link never waits on a 4 MiB `data` send (a member blocked sending to the host while the
host was blocked sending to it stalled both until liveness dropped the member, seen in CI), and
it closes the link of a member with more than `FETCHES_IN_FLIGHT_MAX` unanswered. The member
keeps `FETCH_WINDOW` ranges in flight and puts the answers back in order.
"""

from __future__ import annotations

import pytest
import trio
from trio.testing import trio_test

from kafilad.errors import SessionError, collapse_groups
from kafilad.node.shards import fetcher as fetcher_mod
from kafilad.node.shards.fetcher import FETCH_WINDOW, Fetcher
from kafilad.proto import control as cf
from kafilad.proto.session import HostState, MemberState
from node.session_harness import generate, session_world

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BLOB = bytes(range(256)) * 41  # 10,496 bytes


class HeldHost:
    """Answers nothing until `release()`; then every fetch asked, last asked first."""

    def __init__(self, fail_offset: int | None = None):
        self.fetcher: Fetcher | None = None
        self.asked: list[cf.Fetch] = []
        self.most_unanswered = 0
        self.fail_offset = fail_offset

    async def send(self, wire: dict) -> int:
        f = cf.decode_control(wire)
        assert isinstance(f, cf.Fetch)
        self.asked.append(f)
        self.most_unanswered = max(self.most_unanswered, len(self.fetcher._waiters))
        return len(wire)

    def release(self) -> None:
        for f in reversed(self.asked):
            if f.offset == self.fail_offset:
                self.fetcher.deliver(cf.FetchError(f.id, "no such range"))
            else:
                self.fetcher.deliver(cf.Data(f.id, BLOB[f.offset:f.offset + f.length]))
        self.asked.clear()


async def fetch_while_releasing(host: HeldHost, fetcher: Fetcher, offset: int, length: int) -> bytes:
    got = {}
    with collapse_groups():
        async with trio.open_nursery() as nursery:
            async def fetch():
                got["data"] = await fetcher.fetch("model.safetensors", offset, length)
                nursery.cancel_scope.cancel()
            nursery.start_soon(fetch)
            while True:
                await trio.sleep(0.01)
                host.release()
    return got["data"]


@trio_test
async def test_a_fetch_keeps_a_window_of_ranges_in_flight_and_reassembles_them_in_order(monkeypatch, tmp_path):
    monkeypatch.setattr(fetcher_mod, "FETCH_CHUNK_BYTES", 1000)
    host = HeldHost()
    host.fetcher = fetcher = Fetcher(host.send, tmp_path)
    data = await fetch_while_releasing(host, fetcher, 37, 9_000)  # 9 chunks of 1,000 bytes
    assert data == BLOB[37:9_037]
    assert host.most_unanswered == FETCH_WINDOW
    assert fetcher._waiters == {}


@trio_test
async def test_a_refused_range_fails_the_fetch_with_the_hosts_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(fetcher_mod, "FETCH_CHUNK_BYTES", 1000)
    host = HeldHost(fail_offset=3_000)
    host.fetcher = fetcher = Fetcher(host.send, tmp_path)
    with pytest.raises(SessionError, match="could not serve model.safetensors: no such range"):
        await fetch_while_releasing(host, fetcher, 0, 8_000)
    assert fetcher._waiters == {}


@trio_test
async def test_the_host_reads_on_while_serving_and_drops_a_member_past_the_bound(tmp_path, monkeypatch):
    from kafilad.executor.synth import synthesize_model
    model_dir = synthesize_model(tmp_path / "synth", arch="llama", seed=7, num_hidden_layers=3, hidden_size=32)
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, (m1, m2) = await w.form(2)
        serving, release = trio.Event(), trio.Event()
        serve = h._serve_fetch

        async def held_serve(link, f):  # the host's fetch server for m1 is stuck mid-answer
            if link.peer_name != "m1":
                return await serve(link, f)
            serving.set()
            await release.wait()

        monkeypatch.setattr(h, "_serve_fetch", held_serve)
        fetch = cf.Fetch(id=1, file="model.safetensors", offset=0, length=16).to_wire()
        for _ in range(cf.FETCHES_IN_FLIGHT_MAX):
            await m1.link.send(fetch)
        with trio.fail_after(5):
            await serving.wait()
        await trio.sleep(0.3)
        assert member_lost(h, "m1") is None and h.state == HostState.READY  # 8 unanswered: allowed
        await m1.link.send(fetch)  # the 9th: read although the server is still stuck
        await w.wait(lambda: member_lost(h, "m1") is not None, 10, "m1 dropped")
        assert "more than 8 fetches in flight" in member_lost(h, "m1")
        release.set()
        await w.wait(lambda: h.state == HostState.READY and m2.state == MemberState.READY
                     and {m["name"] for m in h.snapshot()["members"] if m["blocks"] and not m["lost"]} == {"h", "m2"},
                     20, "the replan over h and m2")
        assert len((await generate(h, "Once upon a time", 4))["token_ids"]) == 4



@trio_test
async def test_a_fetch_of_a_hostile_range_fails_only_that_fetch(tmp_path, monkeypatch):
    from kafilad.executor.synth import synthesize_model
    model_dir = synthesize_model(tmp_path / "synth", arch="llama", seed=7, num_hidden_layers=3, hidden_size=32)
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, (m1, m2) = await w.form(2)
        for offset, why in ((2 ** 62, "past the end of 'model.safetensors'"), (0, "not a file of this model")):
            name = "model.safetensors" if offset else "../model.safetensors"
            with trio.fail_after(10), pytest.raises(SessionError, match=why):
                await m1.fetcher.fetch(name, offset, 16)  # seek(2**62) raised OSError in the host before
        size = (model_dir / "model.safetensors").stat().st_size
        assert await m1.fetcher.fetch("model.safetensors", size - 16, 16) == (model_dir / "model.safetensors").read_bytes()[-16:]
        assert member_lost(h, "m1") is None and h.state == HostState.READY
        assert len((await generate(h, "Once upon a time", 4))["token_ids"]) == 4


def member_lost(h, name: str):
    return next(m for m in h.snapshot()["members"] if m["name"] == name)["lost"]


@trio_test
async def test_two_tensors_with_the_same_bytes_are_stored_at_once(tmp_path):
    import hashlib
    host = HeldHost()
    host.fetcher = fetcher = Fetcher(host.send, tmp_path)
    sha = hashlib.sha256(BLOB[:256]).hexdigest()
    got = []
    with collapse_groups():
        async with trio.open_nursery() as nursery:
            async def one(offset):  # BLOB repeats every 256 bytes: the same sha256 at 0 and 256
                got.append(await fetcher.fetch_verified(file="model.safetensors", offset=offset, nbytes=256, sha256=sha))
            nursery.start_soon(one, 0)
            nursery.start_soon(one, 256)
            while len(got) < 2:
                await trio.sleep(0.01)
                host.release()
    assert [g[0] for g in got] == [BLOB[:256]] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [sha]  # stored once, no temporary file left
