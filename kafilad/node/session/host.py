"""The host's side of a session: a thin driver of :class:`kafilad.proto.session.HostMachine`.

DESIGN §3 steps 1-2, §5, §6; the control frames are those of proto_spec 05 §2, typed and
validated in kafilad/proto/control.py. The machine decides (admission, planning, readiness,
failure); this driver does the I/O: the rendezvous, one Noise ctl link per member, the planner
call, file serving, the host's own stage, the trace. Every event goes through :meth:`_handle`,
which performs the machine's actions and tells status watchers once.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import attrs
import trio

from kafilad.errors import (ALREADY_IN_SESSION, HandshakeError, KafilaError, LinkClosed, RemoteProtocolError, RingEdgeError, SessionError,
                            StageBuildError, collapse_groups)
from kafilad.modelinfo import read_model_info
from kafilad.node.paths import manager as paths
from kafilad.node.serving import stagehost
from kafilad.node.serving.admission import Limiter, check_session_arguments
from kafilad.node.shards.fetch_serving import MemberFetches, serve_fetch
from kafilad.node.session.host_pending import wait_while_pending
from kafilad.node.serving.host_requests import HostRequests, RequestFailed
from kafilad.node.paths.link import Link, secure_link
from kafilad.node.session.liveness import Liveness
from kafilad.node.shards.modelfiles import DRAFT_PREFIX, DraftFiles, ModelFiles
from kafilad.node.session.rdv_client import CurrentRendezvous
from kafilad.node.session.driver import SessionDriver, reconnect_delay_s
from kafilad.node.session import status as session_status
from kafilad.node.serving.outbox import Outbox
from kafilad.node.serving.ring_state import run_on_mlx_thread
from kafilad.planner import DEFAULT_STRATEGY, plan as make_plan
from kafilad.planner.plan import hop_change_s, rtt_replan_due
from kafilad.planner.moe import moe_spec
from kafilad.planner.records import Device
from kafilad.planner.trust import RATIO_HIGH, RATIO_LOW, REHEAD_GAIN, MemberChecks
from kafilad.proto import control as cf
from kafilad.proto import session as sm
from kafilad.proto.status import HostStatus
from kafilad.proto.identity import compose_session_code, peer_id as peer_id_of

log = logging.getLogger("kafilad.host")


class HostSession(SessionDriver):
    """One session hosted by this daemon. Runs inside the node's root nursery.

    Attributes:
        machine: the session's state (HostMachine); ``state``, ``error`` and ``members`` read it.
        requests: its requests (kafilad/node/serving/host_requests.py HostRequests), a part that
            generate, wait_serving, prompt_tokens, chat_prompt and the like below hand over to.
    """

    role = "host"

    def __init__(self, node, *, model_dir: str, members: int, context: Optional[int], concurrency: int,
                 rendezvous: str, open_: bool, admit_timeout_s: float, queue_limit: Optional[int] = None,
                 strategy: str = DEFAULT_STRATEGY, head_self: bool = False, head_any: bool = False,
                 draft_model: Optional[str] = None):
        super().__init__(node)
        #: `host --draft-model`: a small model of the same tokenizer that proposes the drafts
        #: (kafilad/executor/draft.py); it runs on the head, wherever the plan puts it (a member head
        #: fetches its files from this host: `draft_files`), and the planner counts its weights in the
        #: head's share (`_plan_profiles`)
        self.draft_model_dir = str(Path(draft_model).resolve()) if draft_model else None
        self.draft_model_bytes = stagehost.executor().draft.draft_model_bytes(draft_model) if draft_model else 0
        self.draft_files = DraftFiles(self.draft_model_dir, state_dir=node.state.path) if draft_model else None
        self.requests = HostRequests(self)
        self.strategy = strategy  # the planner's division (DESIGN §5.3, §5.5; `host --strategy`)
        #: `host --head self`: this host is the head of every plan (it alone sees prompts and samples)
        self.head_self = head_self
        #: `host --head any`: members' reports are trusted (a group whose machines are all its own): any
        #: may head on its report alone, and a report measurement finds off is shown, not replanned around;
        #: by default only the host and members whose reports measurement confirmed may head (issue 22 item 5)
        self.head_any = head_any
        self.model_dir = str(Path(model_dir).resolve())
        self.expected = members
        self.context = context
        self.concurrency = concurrency
        self.rdv_url = rendezvous
        self.admit_timeout_s = admit_timeout_s
        self.info = read_model_info(self.model_dir)
        self.files = ModelFiles(self.model_dir, self.info, state_dir=node.state.path)
        self._validate()
        #: run-time admission: `concurrency` requests on the ring, `queue_limit` (default 4x) waiting
        self.admission = Limiter(self.concurrency, queue_limit)
        self.machine = sm.HostMachine(
            host_peer_id=node.peer_id, host_name=node.name, host_key=node.public_key, expected=members,
            open_=open_, admitted={"model_id": self.info.model_id, "config": self.info.config,
                                   "dtype": self.info.float_dtype,  # the checkpoint's (kafilad/planner/precision.py)
                                   "context": self.context, "concurrency": self.concurrency})
        self.session_id = ""
        self.code = ""
        self.links: dict[str, Link] = {}
        self.outboxes: dict[str, Outbox] = {}  # peer id -> its ctl link's outbox (kafilad/node/serving/outbox.py)
        self._decided: dict[str, trio.Event] = {}
        #: the planner's answers by MakePlan sequence number, until the machine accepted that one or a later one
        self._plans: dict = {}
        self.fleet_devices: list[Device] = []
        #: the names the last plan allowed to head (None: any), reported in the live `fleet`
        self.fleet_heads = None
        #: the measured round trips the last plan was made with, reported in the live `fleet`'s `edges`
        self.fleet_rtt_ms: dict[tuple, float] = {}
        self.generations: dict[str, trio.MemorySendChannel] = {}
        self.formed_s: Optional[float] = None
        self.measured_stage_s: dict[str, float] = {}
        #: every member's report against its measured stage (kafilad/planner/trust.py, issue 22 item 5)
        self.checks = MemberChecks()
        #: measured round trips of member pairs, {(from name, to name): ms}: every ring edge's settled
        #: round trip this session (stagehost.measured_rtt_ms, proto_spec 07 §6 `path_rtt_ms`), kept
        #: across rings
        self.edge_rtt_ms: dict[tuple, float] = {}
        #: the measured round trips plans are made with (they win over the rendezvous estimates,
        #: kafilad/planner/ring.py): `edge_rtt_ms` as it was when it last moved the serving plan's hops
        #: past noise (`_edges_measured`); empty until then, so LAN and loopback rings plan on the
        #: rendezvous estimates as they always did
        self.planning_rtt_ms: dict[tuple, float] = {}
        #: each reporter's edge paths as last reported (`_edges_cause`)
        self._edge_paths: dict[str, tuple] = {}
        #: {sender name: ring frame bytes sent for the finished requests} (stagehost.generation_edges)
        self.edge_bytes_sent: dict[str, int] = {}
        self.last_generation: dict = {}
        self._chat_tokenizer = None
        self.trace = None
        self._serving = trio.Event()
        self.on_ring: set[str] = set()  # requests running on the ring (host_requests.drain_for)
        self._t0 = self._replan_t0 = time.perf_counter()


    # ---- requests: the session's API to its clients, served by its `requests` part ------------
    async def generate(self, prompt: str, **kw) -> dict:
        """Run one request (HostRequests.generate: arguments, result and errors as stated there)."""
        return await self.requests.generate(prompt, **kw)

    async def wait_serving(self, gone=None) -> None:
        """Wait until the session serves (HostRequests.wait_serving)."""
        await self.requests.wait_serving(gone)

    def returning(self) -> bool:
        """Whether the session heals and will serve again (HostRequests.returning)."""
        return self.requests.returning()

    async def prompt_tokens(self, prompt: str, limit=None) -> tuple[int, bool]:
        """The prompt's token count (HostRequests.prompt_tokens)."""
        return await self.requests.prompt_tokens(prompt, limit)

    def chat_prompt(self, messages, tools=None) -> str:
        """The chat template applied (HostRequests.chat_prompt)."""
        return self.requests.chat_prompt(messages, tools)

    def chat_tokenizer(self):
        """The model's tokenizer for chat templates (HostRequests.chat_tokenizer)."""
        return self.requests.chat_tokenizer()

    async def off_loop(self, fn, *args):
        """Run `fn(*args)` on a bounded worker thread (HostRequests.off_loop)."""
        return await self.requests.off_loop(fn, *args)

    @property
    def rehosted(self) -> bool:
        return self.requests.rehosted

    @rehosted.setter
    def rehosted(self, value: bool) -> None:
        self.requests.rehosted = value

    @property
    def has_served(self) -> bool:
        return self.requests.has_served

    @property
    def plan_waits(self):
        return self.requests.plan_waits

    def _handled(self) -> None:
        """After each event (SessionDriver._handle): the requests part's bookkeeping and waking."""
        self.requests._handled()
    # ---- the machine's view (state, error, rendezvous_lost: SessionDriver) ----------------
    @property
    def members(self) -> dict:
        return self.machine.members

    @property
    def ring_order(self) -> list[str]:
        return self.machine.ring_order

    @property
    def plan(self):
        """The planner's Plan (kafilad/planner/records.py) the machine accepted last (its ``planned``),
        None before the first: never an answer the machine dropped as stale (issue 25 item 6)."""
        p = self.machine.planned
        return self._plans.get(p.seq) if p is not None else None

    def _validate(self) -> None:
        """Refuse arguments no plan could honour (`check_session_arguments`); fills in the default context."""
        self.context = check_session_arguments(self.info, members=self.expected, context=self.context,
                                               concurrency=self.concurrency, admit_timeout_s=self.admit_timeout_s)

    # ---- the machine's actions (events enter through SessionDriver._handle) -------------------
    async def _perform(self, a) -> None:
        if isinstance(a, sm.Send):  # never waits on the member (kafilad/node/serving/outbox.py)
            box = self.outboxes.get(a.peer_id)
            if box is not None:
                box.put(a.frame.to_wire())
        elif isinstance(a, sm.CloseLink):
            link = self.links.pop(a.peer_id, None)
            box = self.outboxes.pop(a.peer_id, None)
            if box is not None:  # what the machine sent it goes first (a `denied`, a `close`)
                await box.close_after(a.reason or "closed")
            elif link is not None:
                await link.close(a.reason or "closed")
            if link is not None:
                entry = self.members.get(a.peer_id)
                if entry is not None and entry.lost is None and a.reason and \
                        self.state not in (sm.HostState.FAILED, sm.HostState.CLOSED):  # a protocol error: a loss
                    self.nursery.start_soon(self._handle, sm.MemberLost(a.peer_id, a.reason))
            self._decided_on(a.peer_id)
        elif isinstance(a, sm.Remember):
            roster = self.node.state.load_roster()
            roster[a.peer_id] = {"public_key": a.public_key.hex(), "name": a.name}
            try:
                self.node.state.save_roster(roster)
            except KafilaError as e:  # admitted in this session all the same; only its memory is lost
                log.warning("%s %s stays admitted in this session, but must be admitted again in the next one.",
                            e, a.name)
            self._decided_on(a.peer_id)
        elif isinstance(a, sm.MakePlan):
            self.nursery.start_soon(self._make_plan, a.order, a.seq)
        elif isinstance(a, sm.DistributePlan):
            await self._drop_stage()
            self.nursery.start_soon(self._distribute, a.planned, a.epoch)
        elif isinstance(a, sm.FailRequests):
            self._fail_requests(a.reason, a.member)
        elif isinstance(a, sm.Trace):
            if a.kind == "session_closed":
                self._write_trace(a.kind, edges=stagehost.session_edges(self))
            elif a.kind == "plan":
                self._write_trace(a.kind, **a.fields, fleet=self.fleet_json())
            else:
                self._write_trace(a.kind, **a.fields)
            if a.kind == "plan_kept":  # round trips that settled while it was made count now
                await self._edges_measured()
        elif isinstance(a, sm.Formed):  # form_s: the first formation from the session's start, a later one from its plan
            took_s = time.perf_counter() - (self._t0 if self.formed_s is None else self._replan_t0)
            self.formed_s = self.formed_s if self.formed_s is not None else took_s
            self._write_trace("edges", edges=stagehost.session_edges(self))
            self._write_trace("session_formed", form_s=took_s,
                              load={e.name: e.load for e in self.members.values()})
            for e in self.members.values():  # the paths a later report is compared with (`_edges_cause`)
                self._edges_cause(e.name, stagehost.own_edges(self) if e.is_host else (e.load or {}).get("edges"))
            await self._edges_measured()
        elif isinstance(a, sm.EdgesChanged):
            reported = next((e.load.get("edges") for e in self.members.values() if e.name == a.reporter), None)
            self._write_trace("edges", edges=stagehost.session_edges(self), reporter=a.reporter,
                              cause=self._edges_cause(a.reporter, reported))
            await self._edges_measured()
        else:  # pragma: no cover - a new action without a driver is a bug
            raise KafilaError(f"no driver for the host action {a!r}")

    def _decided_on(self, peer_id: str) -> None:
        """The pending peer `peer_id` was admitted or turned away: its ctl task waits no longer."""
        ev = self._decided.pop(peer_id, None)
        if ev is not None:
            ev.set()

    def _write_trace(self, event: str, **fields) -> None:
        if self.trace is not None:
            self.trace.write(event, **{k: v for k, v in fields.items() if k != "event"})

    def _fail_requests(self, reason: str, member: Optional[str]) -> None:
        for req, ch in list(self.generations.items()):
            try:
                ch.send_nowait(RequestFailed(req=req, message=reason))
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        if self.ring is not None and self.on_ring:  # (a ring with no request on it is left to the replan)
            self.ring.fail_all(reason, member=None)  # the machine's reason names whom it concerns

    # ---- lifecycle -------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Register at the rendezvous, then form and serve; `task_status.started(code)` once registered.

        The rendezvous connection is re-made whenever it ends (capped, jittered backoff;
        issue 8 §3), re-registering the same session id with proof of the host key
        (proto_spec 03 §2.5), so the session keeps its code. With ``session_id`` set before run
        (a restarted host daemon), the first registration re-creates that session too.

        Raises:
            SessionError: the first registration failed (unreachable rendezvous, refused); later
                failures are states of the session instead.
        """
        self._chat_tokenizer = await trio.to_thread.run_sync(
            stagehost.executor().synth.load_tokenizer, self.model_dir)
        self.rdv = CurrentRendezvous()
        try:
            with collapse_groups():
                async with trio.open_nursery() as outer:
                    self.nursery = outer
                    await outer.start(self._rendezvous_loop)
                    async with paths.open_session_paths(self.node, self.rdv, session_id=self.session_id) as self.paths:
                        # classification, fallbacks, failed re-probes and datagram sizes go into the trace
                        self.paths.on_event = lambda kind, fields: self._write_trace("path", **{**fields, "path_event": kind})
                        self._serving.set()
                        task_status.started(self.code)
                        await self._measure_self()
                        await trio.sleep_forever()
        except trio.Cancelled:  # the daemon stops (or leave): members are told, unless it was a leave
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await self._handle(sm.Close("the host's daemon stopped", final=False))
            raise

    async def _rendezvous_loop(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Keep this session registered at the rendezvous for as long as it runs (issue 8 §3)."""
        from kafilad.node.session.rdv_client import open_rendezvous
        from kafilad.node.session.trace import Trace
        attempt, started = 0, False
        while True:
            reason = "the connection closed"
            try:
                async with open_rendezvous(self.rdv_url, static_private=self.node.static_private,
                                           name=self.node.name) as client:
                    sid = await client.register(self.info.model_id, self.expected, {"name": self.node.name},
                                                session_id=self.session_id or None)
                    self.rdv.client = client
                    self.reconnecting = None
                    if not started:
                        self.session_id = sid
                        self.code = compose_session_code(sid, self.node.public_key)
                        self.trace = Trace(self.node.state.trace_path(sid))
                        await self._handle(sm.Registered(sid))
                        self.node.state.remember_session(self.remembered())
                        started = True
                        task_status.started()
                    else:
                        log.info("session %s re-registered at the rendezvous after %d attempt(s)", sid, attempt)
                        await self._handle(sm.RendezvousBack(attempt))
                    attempt = 0
                    await self._serving.wait()
                    async with trio.open_nursery() as conn_nursery:
                        conn_nursery.start_soon(self._accept_loop, client)
                        reason = await self._events_loop(client)
                        conn_nursery.cancel_scope.cancel()
            except (KafilaError, trio.BrokenResourceError, OSError) as e:
                if not started:
                    if isinstance(e, KafilaError):
                        raise
                    raise SessionError(f"cannot reach the rendezvous at {self.rdv_url}: {e}") from None
                reason = str(e)
            self.rdv.client = None
            if self.state in (sm.HostState.FAILED, sm.HostState.CLOSED):
                return
            await self._rendezvous_gone(reason)
            attempt += 1
            delay_s = reconnect_delay_s(attempt)
            self._note_reconnect(attempt, delay_s, next_in_s=round(delay_s, 1), reason=reason)
            log.warning("session %s: rendezvous lost (%s); reconnecting in %.1f s (attempt %d)",
                        self.session_id, reason, delay_s, attempt)
            await trio.sleep(delay_s)

    def remembered(self) -> dict:
        """What a restarted host daemon needs to host this session again (kafilad/node/session/statedir.py)."""
        return {"role": "host", "code": self.code, "session_id": self.session_id, "rendezvous": self.rdv_url,
                "model_dir": self.model_dir, "members": self.expected, "context": self.context,
                "concurrency": self.concurrency, "open": self.machine.open, "admit_timeout_s": self.admit_timeout_s,
                "strategy": self.strategy, "queue": self.admission.queue.queue_limit, "head_self": self.head_self,
                "head_any": self.head_any, "draft_model": self.draft_model_dir}

    async def _measure_self(self) -> None:
        cap = await run_on_mlx_thread(stagehost.measure_capability, self.model_dir, self.node.state.path)
        cap.update(await self.paths.capability())
        await self._handle(sm.OwnCapability(cap))

    # ---- membership -------------------------------------------------------------------------
    async def _accept_loop(self, rdv) -> None:
        async def serve(circuit) -> None:
            self.nursery.start_soon(self._serve_member, circuit)
        await stagehost.accept_circuits(rdv, {"ctl": serve, "ring": self._take_ring_circuit})

    async def _events_loop(self, rdv) -> str:
        """Handle rendezvous events until the connection ends; return why it ended."""
        from kafilad.node.session.rdv_client import Disconnected, MemberLeft, Signal
        async for ev in rdv.events:
            if isinstance(ev, Signal):  # candidate offers (proto_spec 07 §2)
                self.paths.on_signal(ev.from_peer_id, ev.body)
            elif isinstance(ev, MemberLeft):
                await self._handle(sm.MemberLost(ev.peer_id, ev.reason or "it left the rendezvous"))
            elif isinstance(ev, Disconnected):
                return ev.reason
        return rdv.lost or "the connection closed"

    async def _rendezvous_gone(self, reason: str) -> None:
        relayed = tuple(f"{e['from']} -> {e['to']}" for e in stagehost.session_edges(self)
                        if e.get("path") != "direct")
        await self._handle(sm.RendezvousLost(reason, relayed_edges=relayed))

    def _check_member(self, remote_static: bytes, hello: dict) -> str:
        claimed = hello.get("peer_id")
        if claimed != peer_id_of(remote_static):
            raise HandshakeError("the member's claimed peer id does not match its static key")
        return str(hello.get("name") or claimed)[:64]

    async def _serve_member(self, circuit) -> None:
        """One member's ctl link: handshake, admission, then its frames until the link ends."""
        try:
            link, remote_static, hello = await secure_link(
                circuit, initiator=False, static_private=self.node.static_private, session_id=self.session_id,
                hello={"peer_id": self.node.peer_id, "name": self.node.name, "role": "host"},
                check_remote=self._check_member, label="ctl")
        except HandshakeError as e:
            log.warning("refused a member handshake: %s", e)
            return
        pid = link.peer_id
        if pid in self.links:
            await link.send(cf.Denied("this device is already in the session", code=ALREADY_IN_SESSION).to_wire())
            await link.close()
            return
        self.links[pid] = link
        box = self.outboxes[pid] = Outbox(link)  # the machine's frames to it (kafilad/node/serving/outbox.py)
        try:
            with collapse_groups():
                async with trio.open_nursery() as sending:
                    sending.start_soon(box.run)
                    await self._admitted_member(pid, link, remote_static)
                    sending.cancel_scope.cancel()
        except LinkClosed as e:
            lost = getattr(self._rdv_client(), "lost", None)
            if lost is not None and self.rendezvous_lost is None:
                await self._rendezvous_gone(lost)  # its ctl circuit died with the rendezvous (DESIGN §2)
            if self.links.get(pid) is link:
                await self._handle(sm.MemberLost(pid, e.reason))
        finally:
            if self.links.get(pid) is link:
                del self.links[pid]
            if self.outboxes.get(pid) is box:
                del self.outboxes[pid]
            self._decided.pop(pid, None)
            await link.close()

    async def _admitted_member(self, pid: str, link: Link, remote_static: bytes) -> None:
        """Admission (a known key, `kafila-ctl admit`, or the timeout; a device that goes while it
        waits frees its place at once: host_pending.py), then the member's frames.

        Raises:
            LinkClosed: as `_member_loop`.
        """
        known = self.node.state.load_roster().get(pid, {}).get("public_key") == remote_static.hex()
        decided = self._decided[pid] = trio.Event()
        await self._handle(sm.MemberJoined(pid, link.peer_name, remote_static, known))
        first = None
        if pid in self.machine.pending:
            first, gone = await wait_while_pending(link, decided, self.admit_timeout_s)
            if gone is not None and pid in self.machine.pending:
                log.info("%s went before it was admitted: %s", link.peer_name, gone)
                await self._handle(sm.MemberLost(pid, gone))  # its pending entry goes (proto.session)
            elif pid in self.machine.pending:
                await self._handle(sm.PendingTimedOut(pid, self.admit_timeout_s))
        self._decided.pop(pid, None)
        if pid not in self.machine.members or self.links.get(pid) is not link:
            return
        link.peer_name = self.machine.members[pid].name
        live = Liveness(link)
        fetches = MemberFetches(link, lambda f: self._serve_fetch(link, f))
        with collapse_groups():
            async with trio.open_nursery() as watch:
                watch.start_soon(live.run)
                watch.start_soon(fetches.run)
                await self._member_loop(pid, link, live, fetches, first)

    def decide(self, who: str, decision: str, reason: str = "") -> dict:
        """Admit or deny a pending peer named by peer id or name (`kafila-ctl admit|deny`).

        Raises:
            KafilaError: no pending peer matches `who`.
        """
        for p in self.machine.pending.values():
            if who in (p.peer_id, p.name):
                self.nursery.start_soon(self._handle, sm.Decision(p.peer_id, decision == "admit", reason))
                return {"peer_id": p.peer_id, "name": p.name, "decision": decision}
        raise KafilaError(f"No pending peer named '{who}'; `kafila-ctl pending` lists them.")

    @property
    def pending(self) -> dict:
        return self.machine.pending

    async def _member_loop(self, pid: str, link: Link, live: Liveness, fetches: MemberFetches,
                           first: Optional[dict] = None) -> None:
        """Frames from one admitted member: state frames to the machine, `fetch` frames to their
        own task (kafilad/node/shards/fetch_serving.py: this loop never waits on a `data` send), the rest
        served here. `first`: a frame read while it waited for admission (host_pending.py), handled first.

        Raises:
            LinkClosed: the link ended, a frame was malformed, or the member had more than
                `cf.FETCHES_IN_FLIGHT_MAX` fetches unanswered (proto_spec 05 §2.1).
        """
        while True:
            raw, first = (first, None) if first is not None else (await link.receive(), None)
            live.saw_frame()
            try:
                f = cf.decode_control(raw)
            except RemoteProtocolError as e:  # a malformed frame closes this member's link (DESIGN §7)
                await link.close(f"{link.peer_name} sent a {e}")
                raise LinkClosed(f"it sent a {e}") from None
            if isinstance(f, cf.UnknownFrame):
                log.info("ignoring control frame %r from %s", f.t, link.peer_name)
            elif isinstance(f, cf.Ping):
                pass
            elif isinstance(f, cf.Fetch):
                await fetches.take(f)
            elif isinstance(f, (cf.GenEvent, cf.GenDone, cf.GenError, cf.ScheduleState)):
                ch = self.generations.get(f.req)
                if ch is not None:
                    try:
                        ch.send_nowait(f)
                    except trio.WouldBlock:
                        log.warning("request %s: the head streams faster than its caller reads; dropping", f.req)
            else:
                await self._handle(sm.FrameFrom(pid, f))

    async def _serve_fetch(self, link: Link, f: cf.Fetch) -> None:
        """Serve one byte range of a model file, or of the draft model's (`draft/NAME`, proto_spec 05
        §2.1; fetch_serving.serve_fetch)."""
        if self.draft_files is not None and f.file.startswith(DRAFT_PREFIX):
            await serve_fetch(self.draft_files, link, attrs.evolve(f, file=f.file[len(DRAFT_PREFIX):]))
            return
        await serve_fetch(self.files, link, f)

    # ---- formation --------------------------------------------------------------------------
    def _fallback_dtype(self, capability: dict) -> Optional[str]:
        """The narrower dtype a member may hold its stage in when float32 does not fit, or None.

        A CPU member never holds a mixture-of-experts model in bfloat16 or float16: MLX's CPU backend
        runs the routed experts' gather_mm in float32 only ("[GatherMM::eval] Currently only supports
        float32"; docs/architectures.md), so such a stage could load and then fail its first step.
        Without the fallback the planner refuses a member too small for float32 up front, naming it.
        """
        fallback = capability.get("fallback_dtype")
        if fallback and fallback != "float32" and capability.get("backend") == "cpu" and moe_spec(self.info.config):
            return None
        return fallback

    async def _make_plan(self, order: tuple, seq: int) -> None:
        self._replan_t0 = time.perf_counter()
        self.checks.exempt = frozenset(e.name for e in order if e.is_host)  # its own probe ran here
        # each member counted by its report scaled by what its stage measured (kafilad/planner/trust.py)
        scaled = (lambda d: d) if self.head_any else self.checks.device  # `--head any`: reports trusted
        self.fleet_devices = [scaled(Device(
            name=e.name, memory_bytes=int(e.capability["memory_bytes"]),
            bandwidth_Bps=e.capability.get("bandwidth_Bps"),
            step_overhead_s=float(e.capability.get("step_overhead_s") or 0.0), nat_class=e.capability.get("nat_class"),
            rendezvous_rtt_ms=e.capability.get("rendezvous_rtt_ms"), batch_row_cost=e.capability.get("batch_row_cost"),
            dtype=e.capability.get("dtype"), fallback_dtype=self._fallback_dtype(e.capability))) for e in order]
        devices = list(self.fleet_devices)
        # no member is the head on its word alone: only the host and members whose reports measurement
        # confirmed may head (docs/planner.md "Who may be the head")
        heads = None if self.head_any else self.checks.head_allowed(d.name for d in devices)
        # who may head, as the live `fleet` reports it (proto_spec/06-fleet.md §1: `kafila-ctl plan` on it
        # reproduces this plan)
        self.fleet_heads = (frozenset({devices[0].name}) if self.head_self and devices else heads)

        measured = dict(self.planning_rtt_ms)  # the ring edges' measured round trips, once they mattered
        self.fleet_rtt_ms = measured  # ... as the live `fleet` reports them (its `edges`)

        def planned():  # each device counted in the dtype it holds its stage in (kafilad/planner/precision.py)
            return make_plan(devices, self._plan_profiles(devices), context=self.context,
                             concurrency=self.concurrency, strategy=self.strategy, head_self=self.head_self,
                             heads=heads, measured_rtt_ms=measured)

        try:  # on a worker thread: a large search once held the event loop 36 s (issue 25 item 6); the
            # planner is pure, so a plan abandoned when the session ends costs nothing
            plan = await trio.to_thread.run_sync(planned, abandon_on_cancel=True)
        except KafilaError as e:
            await self._handle(sm.PlanFailed(str(e), seq))
            return
        ev = sm.Planned(plan=plan.to_json(), blocks=dict(plan.blocks), head=plan.head, order=tuple(plan.order),
                        seq=seq, standby=tuple(plan.standby))
        await self.requests.drain_for(ev)  # a plan replacing the serving ring lets its requests finish first
        self._plans[seq] = plan  # shown (`plan`) once the machine takes it; a stale answer it drops never is
        await self._handle(ev)
        kept = self.machine.planned.seq if self.machine.planned is not None else seq
        self._plans = {s: p for s, p in self._plans.items() if s >= min(kept, seq)}

    def _plan_profiles(self, devices) -> dict:
        """The model's byte profiles for the planner (stagehost.plan_profiles), with the draft model's
        weights (`host --draft-model`) in the head's resident bytes: whichever device heads holds it,
        and a plan whose head cannot names that device and its shortfall (DESIGN §5.4)."""
        profiles = stagehost.plan_profiles(self.info, devices)
        if not self.draft_model_bytes:
            return profiles
        return {dt: attrs.evolve(p, head_resident_bytes=p.head_resident_bytes + self.draft_model_bytes)
                for dt, p in profiles.items()}

    async def _distribute(self, planned: sm.Planned, epoch: int) -> None:
        """Send each remote member its share (proto_spec 05 §2 `plan`), then load our own stage."""
        order = list(self.ring_order)  # this plan's ring; a later loss replans with a new list
        if any(p not in self.members for p in order):
            # a member of this ring was lost after the plan was made: the machine is replanning
            # (proto.session `_lose`); a ring naming a peer the roster lacks would fail its loaders
            return
        roster = {p: {"name": self.members[p].name, "public_key": self.members[p].public_key}
                  for p in order}
        for pid in order:
            e = self.members.get(pid)
            if epoch != self.machine.epoch:
                return  # replanned meanwhile: that plan's distribution has started
            if e is None or e.is_host:
                continue
            start, end = planned.blocks[e.name]
            head = planned.head == e.name
            tensors = await trio.to_thread.run_sync(self.files.tensor_table, start, end, head)
            files = await trio.to_thread.run_sync(self.files.file_table) if head else []
            draft = None  # a member head fetches the draft model whole (proto_spec 05 §2 `plan` `draft_files`)
            if head and self.draft_files is not None:
                draft = await trio.to_thread.run_sync(self.draft_files.file_table)
            if epoch != self.machine.epoch:
                return  # replanned while the tables were made: the newer plan's frame may have gone first
            await self._perform(sm.Send(pid, cf.PlanFrame(plan=planned.plan, ring=order, roster=roster, start=start,
                                                          end=end, head=head, tensors=tensors, files=files,
                                                          epoch=epoch, dtype=stagehost.stage_dtype(planned.plan, e.name),
                                                          checkpoint=self.files.info.checkpoint_shapes(),
                                                          schedule=self._head_schedule() if head else None,
                                                          draft_files=draft)))
        if epoch == self.machine.epoch:
            self.nursery.start_soon(self._run_stage, roster, epoch)

    def _head_schedule(self) -> Optional[str]:
        """The decode schedule `kafila-ctl schedule` set in this session, as the plan frame carries it
        to a member head (proto_spec 05 §2 `plan`), or None when none was set."""
        mode = getattr(self, "schedule_mode", None)
        return None if mode is None else str(mode)

    async def _run_stage(self, roster: dict, epoch: int) -> None:
        """The host's stage of plan `epoch`, in its own cancel scope (a replan ends it)."""
        async def failed(e: KafilaError) -> None:
            if isinstance(e, StageBuildError):
                log.warning("the host's own stage could not be built: %s", e, exc_info=e)
                await self._handle(sm.OwnStageFailed(str(e), epoch))
                return
            log.warning("the host's own stage did not join the ring: %s", e)
            await self._rendezvous_first()
            await self._handle(sm.RingFailed(e.peer_id if isinstance(e, RingEdgeError) else None, str(e), epoch))

        await self._in_stage_scope(lambda stage_nursery: self._load_own(roster, epoch, stage_nursery), failed)

    async def _load_own(self, roster: dict, epoch: int, stage_nursery) -> None:
        t0 = time.perf_counter()
        me = self.members[self.node.peer_id]
        start, end = self.machine.planned.blocks[me.name]
        head = self.machine.planned.head == me.name

        dtype = stagehost.stage_dtype(self.machine.planned.plan, me.name)

        def build():
            ex = stagehost.executor()
            try:
                stage = ex.stage.load_stage_from_dir(self.model_dir, start, end, head, dtype=dtype)
            except Exception as e:  # no plan builds it: the session fails (issue 21 item 3)
                raise stagehost.build_failure(me.name, self.info.config, start, end, head, e) from e
            tok = ex.synth.load_tokenizer(self.model_dir) if head else None
            draft = None
            if head and self.draft_model_dir is not None:  # `host --draft-model`: refused by name if unusable
                draft = ex.draft.DraftModel.load(self.draft_model_dir, tok)
            return stage, tok, draft

        async with self.node.mlx_lock:
            stage, tok, draft = await run_on_mlx_thread(build)
        if epoch != self.machine.epoch:
            return  # replanned while building
        await self._join_ring(stage, tok, head=head, epoch=epoch, roster=roster, on_edges=self._own_edges_changed,
                              stage_nursery=stage_nursery, plan=self.machine.planned.plan, draft_model=draft)
        await self._handle(sm.OwnStageLoaded({"fetched_bytes": 0, "cached_bytes": 0,
                                              "load_s": time.perf_counter() - t0}, epoch))

    async def _edges_measured(self) -> None:
        """Keep the ring edges' measured round trips; when they move the serving plan's hops by
        enough (kafilad/planner/plan.py `rtt_replan_due`), plan with them from now on and plan again
        (Reassess: the ring serves on, and a plan with the same division is kept without reloading).
        Called when a ring formed or a plan was kept, when a member's `edges` frame came (an upgrade,
        or its edge's round trip settled: path_rtt_ms, proto_spec 07 §6) and when the host's own edge
        reported."""
        self.edge_rtt_ms.update(stagehost.measured_rtt_ms(self))
        plan = self.plan
        if plan is None or self.state != sm.HostState.READY:
            return
        # decided on the whole ring only: a replan on some edges' round trips would take the others'
        # for free, and the next ring would move again once they settled (a relayed edge has none)
        unsettled = [e for e in stagehost.session_edges(self) if e.get("path") != "relayed"
                     and (e.get("from"), e.get("to")) not in self.edge_rtt_ms]
        if unsettled or not rtt_replan_due(plan, self.edge_rtt_ms):
            return
        self.planning_rtt_ms = dict(self.edge_rtt_ms)
        change_s, (a, b) = hop_change_s(plan, self.edge_rtt_ms)
        rtt = self.edge_rtt_ms.get((a, b), self.edge_rtt_ms.get((b, a)))
        reason = (f"the ring's measured round trips change its hops by {change_s * 1000:+.1f} ms a token "
                  f"(edge {a} -> {b}: {rtt:.1f} ms measured); planning again with them")
        log.info("%s.", reason)
        await self._handle(sm.Reassess(a, reason))

    def _ring_names(self) -> dict:
        return {pid: e.name for pid, e in self.members.items()}

    def _edges_cause(self, reporter: str, edges) -> str:
        """Why `reporter` reported its edges again (the trace's `edges` record): "upgrade" when a path
        changed (an upgrade or a fallback, proto_spec 07 §7), else "measured" (its round trip
        settled, or its datagram size search moved on)."""
        paths = tuple((e.get("from"), e.get("to"), e.get("path"), e.get("fallbacks"), e.get("upgraded_at"))
                      for e in edges or [] if isinstance(e, dict))
        before = self._edge_paths.get(reporter)
        self._edge_paths[reporter] = paths
        return "measured" if before == paths else "upgrade"

    async def _own_edges_changed(self) -> None:
        self._write_trace("edges", edges=stagehost.session_edges(self), reporter=self.node.name,
                          cause=self._edges_cause(self.node.name, stagehost.own_edges(self)))
        self.node.changed()
        await self._edges_measured()  # its settled round trip, perhaps (kafilad/node/paths/edge.py)

    async def _watch_ring(self, ring) -> None:
        await ring.broken_event.wait()
        await self._rendezvous_first()
        await self._handle(sm.RingFailed(ring.broken_member, ring.broken, getattr(ring, "epoch", None)))

    async def _rendezvous_first(self) -> None:
        """A ring that broke because the rendezvous went (relayed edges, members' links) is the
        rendezvous's loss, handled as such first: re-forming a ring through a rendezvous that is away
        would only fail again (issue 8 §3)."""
        client = self._rdv_client()
        lost = "the connection closed" if client is None else getattr(client, "lost", None)
        if lost is not None and self.rendezvous_lost is None:
            await self._rendezvous_gone(lost)

    # ---- members checked against what they do (issue 22 item 5) -------------------------------
    def _check_stages(self, result: dict, epoch: Optional[int]) -> None:
        """Judge each member's report by one finished request's stage times (kafilad/planner/trust.py):
        a report off by more than the bound is replaced by figures derived from measurement and the
        session plans again; a member confirmed that the plan held back from heading gets a plan in
        which it may head. Requests of an earlier plan count for nothing."""
        plan = self.plan
        if plan is None or self.machine.planned is None or (epoch is not None and epoch != self.machine.epoch):
            return
        # a plan kept without reloading (the same division, other figures: a report scaled) keeps its epoch
        # but predicts anew, so the plan's key is its epoch and its MakePlan sequence number
        key = (self.machine.epoch, self.machine.planned.seq)
        self.checks.new_plan(key, plan.stage_s)
        names = {e.peer_id: e.name for e in self.members.values()}
        rows = [(names[r[0]], r[1], r[3]) for r in result.get("stats", []) if len(r) >= 4 and r[0] in names]
        for v in self.checks.observe(key, rows, result.get("batch_rows_median")):
            self._write_trace("report_checked", member=v.name, outcome=v.outcome, ratio=v.ratio,
                              measured_s=v.measured_s, predicted_s=v.predicted_s, steps=v.steps, scale=v.scale)
            if v.outcome == "off":
                reason = (f"member {v.name}'s stage measured {v.measured_s * 1000:.2f} ms per token over {v.steps} "
                          f"steps against {v.predicted_s * 1000:.2f} ms predicted from its report (x{v.ratio:.2f}, "
                          f"outside [{RATIO_LOW:g}, {RATIO_HIGH:g}]); planning again with its figures scaled by "
                          f"{v.scale:.2f}")
                log.warning("%s.", reason)
            elif v.name == plan.held_back and plan.held_back_gain >= REHEAD_GAIN:
                reason = (f"member {v.name}'s report is confirmed by its stage (x{v.ratio:.2f} over {v.steps} "
                          f"steps); planning again with it allowed to head ({plan.held_back_gain:.0%} faster)")
                log.info("%s.", reason)
            else:
                log.info("member %s's report is confirmed by its stage (x%.2f over %d steps)", v.name, v.ratio,
                         v.steps)
                continue
            if self.head_any:  # `host --head any`: the group trusts its members' reports; shown, not acted on
                log.info("members' reports are trusted (`host --head any`): no replan for %s", v.name)
            elif self.state == sm.HostState.READY:
                self.nursery.start_soon(self._handle, sm.Reassess(v.name, reason))

    # ---- reporting ----------------------------------------------------------------------------
    def fleet_json(self) -> dict:
        from kafilad.planner import fleet_to_json
        return fleet_to_json(self.fleet_devices, self.context, self.concurrency, heads=self.fleet_heads,
                             rtt_ms=self.fleet_rtt_ms)

    def _rdv_client(self):
        """The rendezvous client of the moment (None while it is away)."""
        return self.rdv.client if isinstance(self.rdv, CurrentRendezvous) else self.rdv

    def _rendezvous_connected(self) -> bool:
        return isinstance(self.rdv, CurrentRendezvous) and self.rdv.client is not None

    def status(self) -> HostStatus:
        """This session's status (kafilad/node/session/status.py builds it)."""
        return session_status.host_status(self)

    def snapshot(self) -> dict:
        """The status as its JSON document (`kafila-ctl status --json`)."""
        return self.status().to_json()

    async def close(self, reason: str = "the host closed the session") -> None:
        """End the session for everyone, for good: members are told (they forget it), requests fail with `reason`."""
        await self._handle(sm.Close(reason, final=True))
