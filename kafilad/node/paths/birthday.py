"""The birthday search of one attempt on one edge: extra sockets, the search, the hand-off (proto_spec 07 §7b).

The pure search (which ports, when to stop, budgets) is :class:`kafilad.proto.birthday.BirthdaySearch`;
this module drives it on real sockets for :meth:`kafilad.node.paths.manager.PathManager.try_direct`::

    pool = SocketPool()                      S side only: up to POOL_SOCKETS extra UDP sockets, each a
    await pm.nursery.start(pool.run, n)      UdpEndpoint served in its own cancel scope, all in one
                                             task of the session's nursery
    found = await search(pm, rec, ...)       feed / flush / re-arm, as the ICE driver does
      Answered (controlling) / Nominated (controlled): the pair (socket i, remote) is handed to an
      IceAgent on that socket (it answers the nomination, selects, keeps the pair alive); every
      other extra socket is closed at once (pool.keep_only(i))
      SearchFailed, or the attempt cancelled: every extra socket is closed (pool.close())

**A path on (socket, remote).** The daemon has one UDP socket (proto_spec 07 §1), but the
mapping a birthday search finds on the S side belongs to one of the extra sockets. The socket is
kept as a :class:`kafilad.net.udp_endpoint.UdpEndpoint` of its own, and the path lives on the
pair (that endpoint, remote): its ICE agent and QUIC connection are made on it, exactly as on the
daemon's socket. :meth:`PathManager.release` closes it with the path (``pool.close()``); the
session's end closes it with the nursery. The C side sweeps from the daemon's own socket, whose
endpoint-independent mapping the S side's pool sends to.

Environment: ``KAFILA_BIRTHDAY=0`` turns the search off (offers then say ``"birthday": false``
and C–S / S–S re-probes run ordinary checks).
"""

from __future__ import annotations

import logging
import os
import resource
import socket as _socket
from typing import Optional

import trio

from kafilad.errors import collapse_groups
from kafilad.net.udp_endpoint import SOCKET_BUFFER_BYTES, UdpEndpoint
from kafilad.proto import birthday as bd
from kafilad.proto import ice

log = logging.getLogger("kafilad.paths")


def birthday_enabled() -> bool:
    """False when ``KAFILA_BIRTHDAY`` is 0 / false / no."""
    return os.environ.get("KAFILA_BIRTHDAY", "1") not in ("0", "false", "no")


def _raise_file_limit(wanted: int) -> None:
    """Raise the soft open-file limit toward ``wanted`` (best effort: each socket of the pool uses
    two descriptors; macOS starts processes at 256)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    except (ValueError, OSError) as e:
        log.debug("birthday: could not raise the open-file limit: %s", e)


class SocketPool:
    """Extra UDP sockets for one birthday search, bounded, closed with the search or with the path.

    Attributes:
        endpoints: the pool's endpoints (index = the search's socket index), serving.
        kept: the index of the socket that carries a path, once :meth:`keep_only` chose it.
    """

    def __init__(self) -> None:
        self.endpoints: list[UdpEndpoint] = []
        self.kept: Optional[int] = None
        self._scopes: list[trio.CancelScope] = []
        self.bind_error: Optional[str] = None

    async def run(self, count: int, host: str = "0.0.0.0", *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Bind up to ``count`` sockets on ``host`` (any port) and serve each until it is closed;
        returns once every one is closed. Fewer are bound if the system refuses more (the reason
        is kept in ``bind_error``)."""
        _raise_file_limit(2 * count + 256)
        family = trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET
        with collapse_groups():
            async with trio.open_nursery() as nursery:
                for _ in range(count):
                    sock = trio.socket.socket(family, trio.socket.SOCK_DGRAM)
                    try:
                        await sock.bind((host, 0))
                    except OSError as e:
                        sock.close()
                        self.bind_error = str(e)
                        break
                    ep = UdpEndpoint(sock)
                    try:
                        await nursery.start(self._serve, ep)
                    except OSError as e:  # too many open files for serve's descriptor
                        sock.close()
                        self.bind_error = str(e)
                        break
                task_status.started(self)

    async def _serve(self, ep: UdpEndpoint, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        scope = trio.CancelScope()
        self._scopes.append(scope)
        self.endpoints.append(ep)
        with scope:
            await ep.serve(task_status=task_status)  # closes the socket on exit

    def keep_only(self, index: int) -> UdpEndpoint:
        """Close every socket but ``index``, which now carries a path (bigger kernel buffers, as
        the daemon's own socket has for QUIC bursts); that endpoint."""
        self.kept = index
        for i, scope in enumerate(self._scopes):
            if i != index:
                scope.cancel()
        ep = self.endpoints[index]
        for opt in (_socket.SO_RCVBUF, _socket.SO_SNDBUF):
            try:
                ep.sock.setsockopt(_socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
            except OSError:
                pass
        return ep

    def close(self) -> None:
        """Close every socket of the pool (idempotent)."""
        for scope in self._scopes:
            scope.cancel()

    @property
    def open_count(self) -> int:
        return sum(1 for s in self._scopes if not s.cancel_called)


class Outcome:
    """What :func:`search` found: the verified pair on its endpoint, or why not, and the counts.

    Attributes:
        endpoint, agent, verified: the pair's endpoint, its ICE agent (running) and PathVerified;
            None when the search failed (``reason`` says why).
        pool: the SocketPool whose kept socket carries the pair (None when it is the daemon's own).
        stats: {"role", "sockets", "probes", "answers", "search_s"} for the record and the trace.
    """

    def __init__(self) -> None:
        self.endpoint: Optional[UdpEndpoint] = None
        self.agent: Optional[ice.IceAgent] = None
        self.verified: Optional[ice.PathVerified] = None
        self.pool: Optional[SocketPool] = None
        self.reason = ""
        self.stats: dict = {}


async def search(pm, rec, *, role: bd.Role, controlling: bool, local: ice.Credentials, remote: ice.Credentials,
                 peer: tuple[str, int], deaf: bool = False, sockets: int = bd.POOL_SOCKETS) -> Outcome:
    """Run one birthday search for ``rec``'s edge, then hand the pair to an ICE agent (module docstring).

    Args:
        pm: the session's PathManager (its endpoint, nursery, ``_run_checks``).
        role: this end's role (:func:`kafilad.proto.birthday.role_for`).
        controlling: True on the edge's sender.
        local, remote: the attempt's credentials (ours, the peer's).
        peer: the peer's server-reflexive address (its IP is what a sweep needs).
        deaf: the ``KAFILA_TEST_DROP_CHECKS`` hook: nothing addressed to this search is delivered.
        sockets: the pool's size (POOL and BOTH roles).
    Returns:
        An :class:`Outcome`; on success its endpoint (and pool) must be released with the path.
    """
    out = Outcome()
    t0 = trio.current_time()
    pool: Optional[SocketPool] = None
    if role in (bd.Role.POOL, bd.Role.BOTH):
        pool = SocketPool()
        await pm.nursery.start(pool.run, sockets, pm.endpoint.local_address[0])
        endpoints = list(pool.endpoints)
        if not endpoints:
            pool.close()
            out.reason = f"no socket could be opened for the birthday search ({pool.bind_error})"
            return out
    else:
        endpoints = [pm.endpoint]
    machine = bd.BirthdaySearch(role=role, controlling=controlling, local=local, remote=remote, peer=peer,
                                sockets=len(endpoints), now=trio.current_time(),
                                tie_breaker=int.from_bytes(os.urandom(8), "big"))
    wake = trio.Event()
    handlers = []

    def handler_for(i: int):
        def on_stun(data: bytes, addr) -> bool:
            claimed = machine.receive_datagram(i, data, addr, trio.current_time())
            if claimed:
                wake.set()
            return claimed
        return on_stun

    if not deaf:
        for i, ep in enumerate(endpoints):
            h = handler_for(i)
            ep.add_stun_handler(h)
            handlers.append((ep, h))
    picked: Optional[tuple[int, tuple[str, int]]] = None
    failed: Optional[bd.SearchFailed] = None
    answers = 0
    try:
        while picked is None and failed is None:
            for i, data, dst in machine.datagrams_to_send(trio.current_time()):
                await endpoints[i].sendto(data, dst)
            while (ev := machine.next_event()) is not None:
                if isinstance(ev, bd.Answered):
                    answers += 1
                    if controlling and picked is None:
                        picked = (ev.socket, ev.remote)
                elif isinstance(ev, bd.Nominated) and picked is None:
                    picked = (ev.socket, ev.remote)
                elif isinstance(ev, bd.SearchFailed):
                    failed = ev
            if picked is not None or failed is not None:
                break
            timer = machine.get_timer()
            if timer is None:
                break
            with trio.move_on_at(timer):
                await wake.wait()
            wake = trio.Event()
            now = trio.current_time()
            if now >= timer:
                machine.handle_timer(now)
        machine.close()
        for ep, h in handlers:
            ep.remove_stun_handler(h)
        handlers.clear()
        out.stats = {"role": role.value, "sockets": len(endpoints), "probes": machine.probes_sent,
                     "answers": answers, "search_s": round(trio.current_time() - t0, 3)}
        if picked is None:
            out.reason = failed.reason if failed is not None else "the birthday search stopped"
            return out
        index, remote_addr = picked
        endpoint = pool.keep_only(index) if pool is not None else endpoints[index]
        agent = ice.IceAgent(controlling=controlling, local=local, remote=remote,
                             remote_candidates=[ice.make_candidate("prflx", remote_addr)], now=trio.current_time(),
                             tie_breaker=machine.tie_breaker)
        result = await pm._run_checks(agent, rec, endpoint=endpoint)
        out.stats["search_s"] = round(trio.current_time() - t0, 3)
        if not isinstance(result, ice.PathVerified):
            agent.close()
            out.reason = (f"the pair the birthday search found ({remote_addr[0]}:{remote_addr[1]}) did not verify: "
                          f"{result.reason if result else 'the checks stopped'}")
            return out
        out.endpoint, out.agent, out.verified, out.pool = endpoint, agent, result, pool
        return out
    finally:
        machine.close()
        for ep, h in handlers:
            ep.remove_stun_handler(h)
        if pool is not None and out.verified is None:
            pool.close()
