"""A whole session in one trio run: a real HostSession and real MemberSessions, no processes, no sockets.

Real parts: the drivers (kafilad/node/session/host.py, host_requests.py, member.py) and their machines,
the rendezvous server and client (kafilad/rendezvous/server.py, kafilad/node/session/rdv_client.py)
speaking real WebSockets, Noise ctl and ring links, the session's PathManager with the RFC 5780
classifier, ICE and QUIC (kafilad/node/paths/manager.py, edge.py), the planner, the fetcher, and MLX
stages on the process's one MLX worker thread. Simulated (tests/netsim.py): the wire. The
rendezvous WebSockets run over memory streams (:class:`netsim.WebSocketRendezvous`, reached by
replacing ``trio_websocket.open_websocket_url``); UDP runs on a :class:`netsim.SimNet` (each node's
``udp_endpoint``, taken by ``paths.endpoint_of``). Each node is a :class:`SimNode`: what the drivers
use of kafilad/daemon.py's ``Node``, with a real StateDir.

Time is trio's real clock: MLX steps run on a worker thread, and ``MockClock(autojump_threshold=0)``
would jump the clock whenever every trio task waits for that thread, firing keepalive deadlines
and timeouts in the middle of a generation. The network's delays are a few milliseconds, and the
one timing-driven scenario (liveness) shrinks the keepalive interval and deadline instead.
"""

from __future__ import annotations

import functools
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Callable, Optional

import trio
import trio_websocket

from kafilad.errors import collapse_groups
from kafilad.node.session import host as host_mod
from kafilad.node.session import member as member_mod
from kafilad.node.serving import stagehost
from kafilad.node.session.host import HostSession
from kafilad.node.session.liveness import Liveness
from kafilad.node.session.member import MemberSession
from kafilad.node.session.statedir import StateDir
from kafilad.proto.identity import peer_id as peer_id_of
from netsim import STUN_GRID, SimNet, WebSocketRendezvous

#: Every node's capability (the timing probe is skipped: fast, and the plan is deterministic).
CAPABILITY = {"memory_bytes": 8 * 2 ** 30, "bandwidth_Bps": 5e9, "step_overhead_s": 0.001,
              "dtype": "float32", "bandwidth_source": "stage"}


def shrink_liveness(monkeypatch, *, interval_s: float, deadline_s: float) -> None:
    """Keepalives of every ctl link (host and member side) at ``interval_s``, deadline ``deadline_s``.

    Liveness binds its defaults at definition, so the module constants cannot be patched; the
    drivers' own name ``Liveness`` is replaced by the class with these arguments.
    """
    short = functools.partial(Liveness, interval_s=interval_s, deadline_s=deadline_s)
    monkeypatch.setattr(host_mod, "Liveness", short)
    monkeypatch.setattr(member_mod, "Liveness", short)


class SimNode:
    """What the session drivers use of a daemon (kafilad/daemon.py ``Node``).

    Attributes:
        state: a real StateDir (key, roster, cache, traces, remembered session).
        udp_endpoint: this node's endpoint on the world's SimNet (paths.endpoint_of takes it).
        session: the node's current session, as the daemon keeps it.
        changes: how many times a driver called :meth:`changed`.
    """

    def __init__(self, world: "World", name: str, state_dir: Path, endpoint):
        self.world = world
        self.name = name
        self.state = StateDir(state_dir).ensure()
        self.static_private, self.public_key = self.state.load_or_create_static_key()
        self.peer_id = peer_id_of(self.public_key)
        self.mlx_lock = trio.Lock()
        self.udp_endpoint = endpoint
        self.nursery = world.nursery
        self.session = None
        self.changes = 0

    def changed(self) -> None:
        self.changes += 1
        self.world.poke()

    # ---- as the HTTP API sees a daemon (kafilad/control/node_view.py NodeView) ----------------
    def snapshot(self):
        return None  # no status document: /metrics shows the API's own

    def restoring_sentence(self):
        return None  # a simulated node never restarts

    async def session_back(self, gone=None) -> None:
        return None

    @property
    def rdv_url(self) -> str:
        return WebSocketRendezvous.url(self.name)


class World:
    """Nodes on one SimNet and one rendezvous; sessions run in :attr:`nursery`."""

    def __init__(self, nursery, net: SimNet, rdv: WebSocketRendezvous, root: Path, model_dir: Path):
        self.nursery, self.net, self.rdv, self.root, self.model_dir = nursery, net, rdv, root, model_dir
        self.nodes: dict[str, SimNode] = {}
        self._changed = trio.Event()
        #: the host's capability, when it should differ from the members' (e.g. slower: the head moves)
        self.host_capability: Optional[dict] = None
        self._frozen: set[str] = set()  # IP addresses of frozen nodes (their LAN and public ones)
        net.drop = self._drop

    def capability(self, model_dir_or_config, cache_dir=None) -> dict:
        """stagehost.measure_capability without the timing probe: :data:`CAPABILITY`, or for the host
        (which measures with its model directory; members with the config they were sent)
        :attr:`host_capability` when set."""
        if isinstance(model_dir_or_config, str) and self.host_capability is not None:
            return dict(self.host_capability)
        return dict(CAPABILITY)

    def poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def node(self, name: str) -> SimNode:
        """The node called ``name``, made on first use: full-cone NAT, its own public IP."""
        if name not in self.nodes:
            i = len(self.nodes) + 1
            ep = self.net.host(name, "O", public_ip=f"203.0.113.{i}")
            self.nodes[name] = SimNode(self, name, self.root / name, ep)
        return self.nodes[name]

    def daemon(self, name: str):
        """A real daemon (kafilad/daemon.py ``Node``) called ``name`` on this world's network, its
        sessions in the world's nursery; its ``rendezvous`` is the world's. Its control socket is not
        served (tests call its ``op_*`` handlers and ``snapshot``)."""
        from kafilad.daemon import Node
        ep = self.node(name).udp_endpoint  # the network host and state dir of a SimNode of that name
        d = Node(StateDir(self.root / name), name=name, rendezvous=WebSocketRendezvous.url(name))
        d.udp_endpoint, d.nursery = ep, self.nursery
        self.nodes[name] = d
        return d

    def freeze(self, name: str) -> None:
        """``name`` stops as a frozen process would: its rendezvous connection carries nothing either
        way (its ctl circuit falls silent) and its datagrams are lost (its QUIC ring edges too)."""
        ep = self.nodes[name].udp_endpoint
        self.rdv.latest(name).pause()
        self._frozen |= {ep.local[0], ep.nat.public_ip}

    def thaw(self, name: str) -> None:
        ep = self.nodes[name].udp_endpoint
        self.rdv.latest(name).resume()
        self._frozen -= {ep.local[0], ep.nat.public_ip}

    async def cut(self, name: str) -> None:
        """``name``'s connection to the rendezvous ends abruptly (its TCP connection is gone)."""
        await self.rdv.latest(name).aclose()

    def _drop(self, data, src, dst) -> bool:
        """SimNet's firewall: datagrams from or to a frozen node are lost."""
        return src[0] in self._frozen or dst[0] in self._frozen

    async def wait(self, pred: Callable[[], bool], timeout_s: float, what: str = "the condition") -> float:
        """Wait until ``pred()``; return the seconds it took.

        Raises:
            AssertionError: not within ``timeout_s`` (the message says ``what``).
        """
        t0 = trio.current_time()
        with trio.move_on_after(timeout_s):
            while not pred():
                with trio.move_on_after(0.05):  # state that changes without a node.changed() too
                    await self._changed.wait()
            return trio.current_time() - t0
        raise AssertionError(f"{what} did not happen within {timeout_s} s; {self.describe()}")

    def describe(self) -> str:
        """Every node's session state, and the host's member rows (what a timed-out wait shows)."""
        out = []
        for name, node in self.nodes.items():
            s = node.session
            if s is None:
                continue
            state = getattr(getattr(s, "state", None), "value", getattr(s, "state", None))
            line = f"{name}: {type(s).__name__} {state}"
            if hasattr(s, "members"):
                rows = s.snapshot().get("members", [])
                line += " members " + ", ".join(f"{m['name']}(blocks={m.get('blocks')}, ready={m.get('ready')}, "
                                                f"lost={m.get('lost')!r})" for m in rows)
            out.append(line)
        return "; ".join(out)

    # ---- sessions ----------------------------------------------------------------------------
    async def host(self, name: str = "h", *, members: int = 3, open_: bool = True, admit_timeout_s: float = 30.0,
                   context: Optional[int] = 256, concurrency: int = 1, strategy: str = "kafila",
                   head_any: bool = False) -> HostSession:
        """A HostSession on node ``name``, registered (its ``code`` set). ``strategy``: the paper's
        division by default, so every member holds blocks (equal in-process members would
        otherwise may stand by under the host's default, "load"). ``head_any``: `host --head any`
        (the members' reports are trusted; any may head from the first plan, issue 22 item 5)."""
        node = self.node(name)
        s = HostSession(node, model_dir=str(self.model_dir), members=members, context=context,
                        concurrency=concurrency, rendezvous=node.rdv_url, open_=open_, admit_timeout_s=admit_timeout_s,
                        strategy=strategy, head_any=head_any)
        node.session = s
        await self.nursery.start(functools.partial(_run, s))
        return s

    async def join(self, name: str, code: str, progress: Optional[list] = None) -> MemberSession:
        """A MemberSession on node ``name``, admitted (run returned from ``task_status.started``).

        Raises:
            SessionError: the join was refused (denied, unknown session, wrong key).
        """
        node = self.node(name)
        s = MemberSession(node, code=code, rendezvous=node.rdv_url)
        node.session = s
        msgs = progress if progress is not None else []

        async def note(ev: dict) -> None:
            msgs.append(ev["msg"])
        await self.nursery.start(functools.partial(_run, s, progress=note))
        node.state.remember_session({"role": "member", "code": s.code, "rendezvous": s.rdv_url})  # as op_join
        return s

    def join_soon(self, name: str, code: str) -> dict:
        """Start a join in the background; the dict gets "session" once admitted, or "error"."""
        out: dict = {"progress": [], "done": trio.Event()}

        async def attempt() -> None:
            try:
                out["session"] = await self.join(name, code, out["progress"])
            except Exception as e:  # noqa: BLE001 - handed to the test
                out["error"] = e
            finally:
                out["done"].set()
        self.nursery.start_soon(attempt)
        return out

    async def form(self, n_members: int = 2, **host_kw) -> tuple[HostSession, list[MemberSession]]:
        """A host and ``n_members`` members (m1, m2, ...) of an open session, all ready."""
        h = await self.host(members=n_members + 1, **host_kw)
        ms = [await self.join(f"m{i}", h.code) for i in range(1, n_members + 1)]
        await self.wait(lambda: h.state == "ready" and all(m.state == "ready" for m in ms), 20, "formation")
        return h, ms


async def _run(session, *, task_status=trio.TASK_STATUS_IGNORED, **kw) -> None:
    """A session task, as kafilad/daemon.py runs one (an error is the session's own, not a group)."""
    with collapse_groups():
        await session.run(task_status=task_status, **kw)


@asynccontextmanager
async def session_world(root: Path, model_dir: Path, monkeypatch, *, one_way_s: float = 0.002):
    """A SimNet with the STUN grid, the rendezvous advertising it, and a nursery for sessions.

    ``monkeypatch`` routes the rendezvous client's WebSockets (``trio_websocket.open_websocket_url``)
    to this world's :class:`WebSocketRendezvous` and skips the capability probe
    (``stagehost.measure_capability``), until the test ends. Leaving the block cancels every
    session (the drivers' own shutdown paths run).
    """
    async with trio.open_nursery() as nursery:
        net = SimNet(one_way_s=one_way_s)
        await nursery.start(net.run)
        net.stun_servers()
        rdv = WebSocketRendezvous(stun_addresses=STUN_GRID)
        await nursery.start(rdv.run)
        monkeypatch.setattr(trio_websocket, "open_websocket_url", rdv.open_websocket_url)
        world = World(nursery, net, rdv, root, model_dir)
        monkeypatch.setattr(stagehost, "measure_capability", world.capability)
        try:
            yield world
        finally:
            nursery.cancel_scope.cancel()


async def generate(host: HostSession, prompt: str, max_tokens: int, *, on_token=None,
                   gone: Optional[trio.Event] = None, temperature: float = 0.0) -> dict:
    """Generation through the host, greedy unless `temperature` > 0; ``on_token(n)`` is awaited after
    each of the n tokens streamed; ``gone`` is the client's going away (HostSession.generate)."""
    tokens: list = []

    async def emit(ev: dict) -> None:
        tokens.append(ev)
        if on_token is not None:
            await on_token(len(tokens))
    result = await host.generate(prompt, max_tokens=max_tokens, temperature=temperature, emit=emit, gone=gone)
    result["events"] = tokens
    return result
