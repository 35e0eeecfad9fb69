"""Issue 8 §3 at the rendezvous: re-registering a session id with proof of the host key
(proto_spec 03 §2.5), and WebSocket pings that keep an idle-timeout proxy from cutting a daemon."""

from __future__ import annotations

from contextlib import AsyncExitStack
from functools import partial

import pytest
import trio

from kafilad.errors import SessionError
from kafilad.node.session.rdv_client import open_rendezvous
from kafilad.rendezvous.server import serve_rendezvous
from rendezvous.test_server import HFP, A, H, key, rdv, run_with_server


def test_a_host_re_registers_its_session_id_and_members_join_it_again():
    async def body(url):
        async with AsyncExitStack() as stack:
            host = await stack.enter_async_context(rdv(url, "H", "host"))
            sid = await host.register("m", 2, {})
            # the same host key on a new connection takes the id over; the old connection is superseded
            host2 = await stack.enter_async_context(rdv(url, "H", "host"))
            assert await host2.register("m", 2, {}, session_id=sid) == sid
            member = await stack.enter_async_context(rdv(url, "A", "a"))
            assert await member.join(sid, HFP) == H
            # another key that registers the id gets a session of its own: it takes nothing from H's
            other = await stack.enter_async_context(rdv(url, "B", "b"))
            assert await other.register("m", 2, {}, session_id=sid) == sid
            member2 = await stack.enter_async_context(rdv(url, "R", "r"))
            with pytest.raises(SessionError, match="already has all 2 members"):  # H's session: A holds its slot
                await member2.join(sid, HFP)
            # the id alone, or with a guessed fingerprint, finds nothing
            outsider = await stack.enter_async_context(rdv(url, "C", "c"))
            with pytest.raises(SessionError, match="No session"):
                await outsider.join(sid, "a" * 16)
            bad = await stack.enter_async_context(rdv(url, "C", "c2"))
            with pytest.raises(SessionError, match="8 characters"):
                await bad.register("m", 2, {}, session_id="NOT-AN-ID")
    run_with_server(body)


def test_a_session_id_survives_a_rendezvous_restart():
    """A new rendezvous (its state gone) accepts the host's re-registration under the old id."""
    async def main():
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_rendezvous, "127.0.0.1", 0))
            url = f"ws://127.0.0.1:{port}"
            async with rdv(url, "H", "host") as host:
                sid = await host.register("m", 2, {})
            nursery.cancel_scope.cancel()
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_rendezvous, "127.0.0.1", 0))
            url = f"ws://127.0.0.1:{port}"
            # an outsider who saw the id registers it first on the restarted rendezvous: no takeover
            async with rdv(url, "B", "squatter") as squatter, rdv(url, "H", "host") as host:
                assert await squatter.register("m", 2, {}, session_id=sid) == sid
                assert await host.register("m", 2, {}, session_id=sid) == sid
                async with rdv(url, "A", "a") as member:
                    assert await member.join(sid, HFP) == H
            nursery.cancel_scope.cancel()

    trio.run(main)


async def idle_proxy(listen_port_box: list, target_port: int, idle_s: float, *, task_status=trio.TASK_STATUS_IGNORED):
    """A TCP proxy that cuts a connection after `idle_s` without a byte either way (as many do)."""
    async def handle(client):
        async with client:
            server = await trio.open_tcp_stream("127.0.0.1", target_port)
            async with server:
                last = [trio.current_time()]

                async def pump(src, dst):
                    while True:
                        data = await src.receive_some(65536)
                        if not data:
                            return
                        last[0] = trio.current_time()
                        await dst.send_all(data)

                async with trio.open_nursery() as n:
                    n.start_soon(pump, client, server)
                    n.start_soon(pump, server, client)
                    while trio.current_time() - last[0] < idle_s:
                        await trio.sleep(0.1)
                    n.cancel_scope.cancel()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    listen_port_box.append(listeners[0].socket.getsockname()[1])
    task_status.started()
    await trio.serve_listeners(handle, listeners)


@pytest.mark.parametrize("ping_s, survives", [(0.5, True), (60.0, False)])
def test_websocket_pings_keep_an_idle_timeout_proxy_open(ping_s, survives):
    async def main():
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_rendezvous, "127.0.0.1", 0))
            box: list = []
            await nursery.start(idle_proxy, box, port, 1.5)
            url = f"ws://127.0.0.1:{box[0]}"
            async with open_rendezvous(url, static_private=key("H"), name="host", ping_interval_s=ping_s) as host:
                sid = await host.register("m", 2, {})
                await trio.sleep(4.0)  # idle, past the proxy's 1.5 s
                assert (host.lost is None) == survives, host.lost
                if survives:  # the host's connection still carries messages: it hears a member join
                    async with open_rendezvous(url, static_private=key("A"), name="a") as member:
                        assert await member.join(sid, HFP) == H
                        with trio.fail_after(5):
                            assert (await host.events.receive()).peer_id == A
            nursery.cancel_scope.cancel()

    trio.run(main)
