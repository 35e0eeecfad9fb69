"""A member's side of a session: a thin driver of :class:`kafilad.proto.session.MemberMachine`.

Join by code, get admitted, report, fetch, load, serve (DESIGN §3 steps 1-2, §5.1, §6; the
frames are those of proto_spec 05 §2, typed in kafilad/proto/control.py). The machine decides;
this driver does the I/O. Every event goes through :meth:`_handle`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import trio

from kafilad.errors import (HOST_KEY_MISMATCH, HandshakeError, JoinRefused, KafilaError, LinkBroken, LinkClosed,
                            RemoteProtocolError, RingEdgeError, SessionError, StageBuildError, collapse_groups, only_cancelled)
from kafilad.node.paths import manager as paths
from kafilad.node.serving import stagehost
from kafilad.node.shards.fetcher import FETCH_WINDOW, FROM_HOST, FROM_HF_CACHE, Fetcher, checked_file_name, store_error
from kafilad.node.shards.modelfiles import DRAFT_PREFIX
from kafilad.node.serving.host_requests import result_of
from kafilad.node.paths.link import Link, secure_link
from kafilad.node.session.liveness import Liveness
from kafilad.node.serving.ring_state import run_on_mlx_thread
from kafilad.node.session.driver import SessionDriver, reconnect_delay_s
from kafilad.node.session import status as session_status
from kafilad.proto import control as cf
from kafilad.proto import session as sm
from kafilad.proto.status import MemberStatus
from kafilad.proto.identity import fingerprint, fingerprint_matches, parse_session_code, peer_id as peer_id_of

log = logging.getLogger("kafilad.member")

#: seconds one frame to the host may take to send before the ctl link counts as broken (send_ctl)
CTL_SEND_BOUND_S = 5.0
#: seconds a stage that served on through a rendezvous outage waits, once the rendezvous is back, for
#: the requests on it to end before it rejoins (the rejoin replaces its stage; docs/healing.md)
REJOIN_IDLE_WAIT_S = 30.0
#: the loading step (``load["progress"]``) while the stage's tensors are read: some come from the host,
#: or every one is in this device's caches (a rejoin: nothing is fetched, so nothing says "fetching")
LOAD_FETCHING, LOAD_FROM_CACHE = "fetching", "reading the weights from the cache"


class MemberSession(SessionDriver):
    """This daemon as a member of someone else's session. Runs inside the node's root nursery."""

    role = "member"

    def __init__(self, node, *, code: str, rendezvous: str):
        super().__init__(node)
        self.code = code
        self.session_id, self.host_fingerprint = parse_session_code(code)
        self.rdv_url = rendezvous
        self.machine = sm.MemberMachine(node.name)
        self.host_name = "?"
        self.link: Optional[Link] = None
        self.ring_order: list[str] = []
        self.roster: dict = {}
        self.load: dict = {}
        self.fetcher: Optional[Fetcher] = None
        self._admitted = trio.Event()
        self._over = trio.Event()  # set once the session failed or closed: the control loop ends
        self.liveness: Optional[Liveness] = None  # keepalives on the ctl link once admitted
        #: whether the session reached ready or standby (its daemon then rejoins at once, Node._run_session)
        self.served = False

    # ---- the machine's view (state, error, rendezvous_lost: SessionDriver) ----------------
    @property
    def capability(self) -> Optional[dict]:
        return self.machine.capability

    @property
    def was_admitted(self) -> bool:
        """Whether the host admitted this device (the join was established; its daemon rejoins it)."""
        return self._admitted.is_set()

    # ---- the machine's actions (events enter through SessionDriver._handle) -------------------
    def _handled(self) -> None:
        if self.state in (sm.MemberState.READY, sm.MemberState.STANDBY):
            self.served = True
        if self.state in (sm.MemberState.FAILED, sm.MemberState.CLOSED):
            self._over.set()

    async def send_ctl(self, body: dict) -> int:
        """Send one frame on the ctl link to the host, whole: shielded from the caller's cancellation
        (a stage dropped by a replan, a request ended), since a frame cut in the middle would break
        the link for every later frame; bounded by CTL_SEND_BOUND_S, past which the link is closed
        as broken. Returns its size in bytes.

        Raises:
            LinkClosed: the link ended, or the host took no frame within CTL_SEND_BOUND_S.
        """
        link = self.link
        with trio.CancelScope(shield=True):
            with trio.move_on_after(CTL_SEND_BOUND_S):
                return await link.send(body)
            reason = f"the host took no control frame for {CTL_SEND_BOUND_S:g} s"
            await link.close(reason, broken=True)
        raise LinkBroken(reason)

    async def _perform(self, a) -> None:
        if isinstance(a, sm.Send):
            if self.link is not None and self.link.closed_reason is None:
                try:
                    await self.send_ctl(a.frame.to_wire())
                except LinkClosed:
                    pass
        elif isinstance(a, sm.CloseLink):
            if self.link is not None:
                await self.link.close(a.reason or "closed")
        elif isinstance(a, sm.StartLoad):
            await self._drop_stage()
            self.nursery.start_soon(self._run_stage, a.plan)
        elif isinstance(a, sm.StandBy):  # no blocks in this plan (strategy "load"): hold no stage
            await self._drop_stage()
            self.ring, self.ring_order = None, []
            log.info("plan %s leaves this device on standby (no blocks; ready for a replan)", a.epoch)
        elif isinstance(a, sm.FailRequests):
            if self.ring is not None:
                # no member named: the reason is the whole sentence (never "member ? is unreachable")
                self.ring.fail_all(a.reason, member=self.host_name if a.member == "host" else a.member)
        elif isinstance(a, sm.Trace):
            log.info("session %s: %s %s", self.session_id, a.kind, a.fields)
        elif isinstance(a, sm.ForgetSession):
            self.node.state.forget_session()
        elif isinstance(a, sm.JoinAccepted):
            self._admitted.set()
        elif isinstance(a, sm.Refused):
            raise JoinRefused(a.message, a.code) if a.code else SessionError(a.message)
        else:  # pragma: no cover - a new action without a driver is a bug
            raise KafilaError(f"no driver for the member action {a!r}")

    # ---- lifecycle -------------------------------------------------------------------------
    async def run(self, *, progress, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Join; `task_status.started()` once admitted. Before that, errors propagate to the caller.

        Raises:
            SessionError: unknown session, wrong host key, denied, or not admitted in time.
        """
        from kafilad.node.session.rdv_client import open_rendezvous
        started = False
        try:
            async with open_rendezvous(self.rdv_url, static_private=self.node.static_private,
                                       name=self.node.name) as rdv:
                self.rdv = rdv
                host_pid = await rdv.join(self.session_id, self.host_fingerprint)
                await progress({"msg": f"joined session {self.session_id} at the rendezvous; verifying the host"})
                await self._open_ctl(rdv, host_pid)
                self.fetcher = Fetcher(self.send_ctl, self.node.state.cache_dir)
                await self._await_admission(progress)
                task_status.started()
                started = True
                try:
                    async with paths.open_session_paths(self.node, rdv, session_id=self.session_id) as self.paths:
                        with collapse_groups():
                            async with trio.open_nursery() as nursery:
                                self.nursery = nursery
                                nursery.start_soon(self._accept_loop, rdv)
                                nursery.start_soon(self._events_loop, rdv)
                                self.liveness = Liveness(self.link)
                                nursery.start_soon(self.liveness.run)
                                await self._control_loop()
                                nursery.cancel_scope.cancel()
                except trio.Cancelled:
                    with trio.CancelScope(shield=True), trio.move_on_after(2):
                        await self._handle(sm.Close("its daemon is shutting down"))
                    raise
        except (KafilaError, trio.BrokenResourceError, OSError) as e:
            reason = e.reason if isinstance(e, LinkClosed) else str(e)
            if not started:
                err = e if isinstance(e, KafilaError) and not isinstance(e, LinkClosed) else \
                    SessionError(f"Cannot join: {reason}.")
                if self.state in (sm.MemberState.JOINING, sm.MemberState.PENDING):
                    await self._handle(sm.JoinFailed(str(err)))
                if err is e:
                    raise
                raise err from None
            if self.state not in (sm.MemberState.FAILED, sm.MemberState.CLOSED):
                await self._handle(sm.RendezvousLost(reason))
        except BaseException as e:  # cancelled: the daemon stops, or this device left (`kafila-ctl leave`)
            if started or self.state != sm.MemberState.CLOSED or not only_cancelled(e):
                raise
            raise SessionError(self.error or "This device left as it joined the session.") from None  # it left while it waited: the join ends saying so

    async def _open_ctl(self, rdv, host_pid: str) -> None:
        circuit = await rdv.open_circuit(host_pid, "ctl")

        def check_host(remote_static: bytes, hello: dict) -> str:
            if not fingerprint_matches(self.host_fingerprint, remote_static):
                # the key presented is not named: a user must not "fix" the code by copying it in
                raise HandshakeError(
                    "the host's key does not match the fingerprint in the session code (the code may be "
                    "mistyped or out of date, or something that is not the host answered); ask the host for "
                    "the code again (`kafila-ctl status` on the host shows it)")
            if peer_id_of(remote_static) != host_pid:
                raise HandshakeError("the host's key does not match its peer id at the rendezvous")
            return str(hello.get("name") or host_pid)

        try:
            self.link, _, _ = await secure_link(
                circuit, initiator=True, static_private=self.node.static_private, session_id=self.session_id,
                hello={"peer_id": self.node.peer_id, "name": self.node.name, "role": "member"},
                check_remote=check_host, label="ctl")
        except HandshakeError as e:
            raise JoinRefused(f"Refusing to join session {self.session_id}: {e}.", HOST_KEY_MISMATCH) from None
        self.host_name = self.link.peer_name

    async def _await_admission(self, progress) -> None:
        """Read host frames until `admitted` (JoinAccepted) or a refusal (SessionError)."""
        while not self._admitted.is_set():
            if self.state in (sm.MemberState.FAILED, sm.MemberState.CLOSED):
                raise SessionError(self.error or "The host ended the session before admitting this device.")
            f = await self._receive()
            if f is None:
                continue
            await self._handle(f)
            if isinstance(f, cf.Pending):
                await progress({"msg": f"waiting for the host to admit this device (peer id {self.node.peer_id}, "
                                       f"fingerprint {fingerprint(self.node.public_key)})"})

    async def _receive(self):
        """The next typed frame from the host; None for an unknown type (logged).

        Raises:
            SessionError: before admission, the link closed (the machine's sentence).
        """
        try:
            raw = await self.link.receive()
            if self.liveness is not None:
                self.liveness.saw_frame()
            f = cf.decode_control(raw)
        except RemoteProtocolError as e:
            await self.link.close(f"the host sent a {e}")
            await self._handle(sm.HostLinkLost(f"the host sent a {e}"))
            return None
        except LinkClosed as e:
            lost = getattr(self.rdv, "lost", None)
            if lost is not None and self.rendezvous_lost is None and self._admitted.is_set():
                await self._rendezvous_gone(lost)  # the ctl circuit died with the rendezvous (DESIGN §2)
            await self._handle(sm.HostLinkLost(e.reason))
            return None
        if isinstance(f, cf.UnknownFrame):
            log.info("ignoring control frame %r from the host", f.t)
            return None
        if isinstance(f, cf.Ping):
            return None
        return f

    async def _accept_loop(self, rdv) -> None:
        await stagehost.accept_circuits(rdv, {"ring": self._take_ring_circuit})

    async def _events_loop(self, rdv) -> None:
        from kafilad.node.session.rdv_client import Disconnected, MemberLeft, SessionClosed, Signal
        async for ev in rdv.events:
            if isinstance(ev, Signal):  # candidate offers (proto_spec 07 §2)
                self.paths.on_signal(ev.from_peer_id, ev.body)
            elif isinstance(ev, MemberLeft):
                name = self.roster.get(ev.peer_id, {}).get("name", ev.peer_id)
                if self.ring is not None and ev.peer_id in self.ring_order:  # the host replans without it
                    self.ring.fail_all(f"it left the session ({ev.reason})", member=name)
            elif isinstance(ev, Disconnected):
                await self._rendezvous_gone(ev.reason)
            elif isinstance(ev, SessionClosed):
                await self._handle(sm.SessionEnded(f"the session ended: {ev.reason}"))

    async def _rendezvous_gone(self, reason: str) -> None:
        kinds = [e.get("path") for e in self.paths.edge_list()] if self.paths is not None else []
        direct = len(kinds) >= 2 and all(p == "direct" for p in kinds)
        already = self.machine.keeps_serving  # the loss was seen before (its events loop and its ctl link)
        await self._handle(sm.RendezvousLost(reason, edges_direct=direct))
        if self.machine.keeps_serving and not already:
            log.warning("session %s: the rendezvous is gone (%s); both ring edges are direct, so this stage "
                        "keeps serving", self.session_id, reason)
            self.nursery.start_soon(self._await_rendezvous_back, reason)

    async def _await_rendezvous_back(self, why: str) -> None:
        """While the stage serves on without the rendezvous, probe it (capped, jittered backoff); once
        it answers, end this session so the daemon rejoins it with a fresh ctl link (issue 8 §3).
        `why`: how it was lost; each failed probe's reason replaces it in `status` (`reconnecting`)."""
        from kafilad.node.session.rdv_client import open_rendezvous
        attempt = 0
        while not self._over.is_set():
            attempt += 1
            delay_s = reconnect_delay_s(attempt)
            self._note_reconnect(attempt, delay_s, next_in_s=round(delay_s, 1), reason=why)
            await trio.sleep(delay_s)
            try:
                async with open_rendezvous(self.rdv_url, static_private=self.node.static_private,
                                           name=self.node.name, connect_timeout_s=5.0):
                    pass
            except (KafilaError, OSError, trio.BrokenResourceError) as e:
                why = str(e)
                continue
            await self._until_idle(REJOIN_IDLE_WAIT_S)  # the rejoin drops this stage: not under a request
            await self._handle(sm.SessionEnded("the rendezvous is back; rejoining to restore the control link"))
            return

    async def _until_idle(self, bound_s: float) -> None:
        """Return once this stage holds no request (no KV cache here: every request that went through
        it has ended), at most `bound_s` seconds (kafilad/node/serving/ring.py `wait_idle`)."""
        if self.ring is not None:
            with trio.move_on_after(bound_s):
                await self.ring.wait_idle()

    # ---- control loop ----------------------------------------------------------------------
    async def _control_loop(self) -> None:
        cap = await run_on_mlx_thread(stagehost.measure_capability, self.machine.admitted, self.node.state.path)
        cap.update(await self.paths.capability())
        await self.send_ctl(cf.Capability.from_measurement(cap).to_wire())
        await self._handle(sm.CapabilitySent(cap))
        while self.state not in (sm.MemberState.FAILED, sm.MemberState.CLOSED):
            if self.link.closed_reason is not None and self.machine.keeps_serving:
                await self._over.wait()  # the ring stage serves on without the ctl link (DESIGN §2)
                break
            f = await self._receive()
            if f is None:
                continue
            if isinstance(f, (cf.Data, cf.FetchError)):
                self.fetcher.deliver(f)
            elif isinstance(f, cf.Gen):
                self.nursery.start_soon(self._serve_generation, f)
            elif isinstance(f, cf.Schedule):  # `kafila-ctl schedule` on the host, this member the head
                await self.send_ctl(self._answer_schedule(f).to_wire())
            elif isinstance(f, cf.Cancel):  # the request's client went away (proto_spec 05 §2.4)
                if self.ring is not None and self.ring.head:
                    self.ring.cancel(f.req, f.reason or "The host cancelled the request.", before_start=True)
            else:
                await self._handle(f)

    async def _run_stage(self, f: cf.PlanFrame) -> None:
        async def failed(e: KafilaError) -> None:  # a ring task of this stage failed (its loading: _load)
            log.warning("the stage of plan %s ended: %s", f.epoch, e)
            if self.state in (sm.MemberState.LOADING, sm.MemberState.READY):
                await self._handle(sm.RingFailed(None, str(e), f.epoch))

        await self._in_stage_scope(lambda stage_nursery: self._load(f, stage_nursery), failed)

    async def _fetch_tensors(self, tensors: list) -> tuple[list, int, int, int]:
        """The plan's tensors, `FETCH_WINDOW` at a time (their ranges share the fetcher's window,
        so a small tensor's round trip overlaps a large one's bytes; proto_spec 05 §2.1).

        Returns:
            ([(tensor entry, bytes)] in the plan's order, bytes fetched from the host, bytes from
            either cache, bytes from the HF cache).
        Raises:
            SessionError, RemoteProtocolError: as `Fetcher.fetch_verified`.
        """
        out: list = [None] * len(tensors)
        sources: list = [None] * len(tensors)
        limit = trio.CapacityLimiter(FETCH_WINDOW)

        async def one(i: int, t: dict) -> None:
            async with limit:
                data, sources[i] = await self.fetcher.fetch_verified(
                    file=t["file"], offset=t["offset"], nbytes=t["nbytes"], sha256=t["sha256"],
                    file_sha256=t.get("file_sha256"))
            out[i] = (t, data)
            self.load["done_bytes"] += len(data)
            if sources[i] == FROM_HOST:
                self.load["fetched_bytes"] += len(data)
                self.load["progress"] = LOAD_FETCHING  # a cache entry turned out missing or damaged
            else:
                self.load["cached_bytes"] += len(data)
            self.node.changed()

        with collapse_groups():
            async with trio.open_nursery() as nursery:
                for i, t in enumerate(tensors):
                    nursery.start_soon(one, i, t)
        size = [len(d) for _, d in out]
        fetched = sum(n for n, src in zip(size, sources) if src == FROM_HOST)
        hf_cached = sum(n for n, src in zip(size, sources) if src == FROM_HF_CACHE)
        return out, fetched, sum(size) - fetched, hf_cached

    async def _load(self, f: cf.PlanFrame, stage_nursery) -> None:
        t0 = time.perf_counter()
        epoch = f.epoch or 0
        try:
            self.ring_order = [str(p) for p in f.ring]
            if f.head:
                self._take_schedule(f.schedule)
            self.roster = {pid: {"name": str(r["name"]), "public_key": bytes(r["public_key"])}
                           for pid, r in f.roster.items()}
            all_cached = await trio.to_thread.run_sync(lambda: all(  # file lookups, off the trio thread
                self.fetcher.looks_cached(sha256=t["sha256"], file_sha256=t.get("file_sha256")) for t in f.tensors))
            self.load = {"progress": LOAD_FROM_CACHE if all_cached else LOAD_FETCHING, "done_bytes": 0,
                         "total_bytes": sum(t["nbytes"] for t in f.tensors), "fetched_bytes": 0, "cached_bytes": 0,
                         "tensors": len(f.tensors)}
            weights, fetched, cached, hf_cached = await self._fetch_tensors(f.tensors)
            tok_dir = None
            if f.head:
                model_id = checked_file_name(self.machine.admitted.model_id.replace("/", "--"))
                tok_dir = self.node.state.path / "models" / f"{model_id}-{self.session_id}"
                await self._fetch_files(f.files, tok_dir)
            draft_dir = None
            if f.head and f.draft_files:  # the host's draft model (`host --draft-model`), whole, as draft/NAME
                draft_dir = self.node.state.path / "models" / f"draft-{self.session_id}"
                self.load["progress"] = "fetching the draft model"
                self.node.changed()
                await self._fetch_files(f.draft_files, draft_dir, prefix=DRAFT_PREFIX)
            config = self.machine.admitted.config

            def build():
                ex = stagehost.executor()
                from kafilad.modelinfo import TensorInfo
                try:
                    arrays = {}
                    for t, data in weights:
                        info = TensorInfo(t["name"], t["file"], t["dtype"], tuple(t["shape"]), t["offset"], t["nbytes"],
                                          None)
                        arrays[t["name"]] = ex.stage.tensor_from_bytes(info, data, dtype=f.dtype or "float32")
                    stage = ex.stage.build_stage(config, f.start, f.end, f.head, arrays, checkpoint=f.checkpoint)
                except Exception as e:  # no plan builds it: the host fails the session (issue 21 item 3)
                    raise stagehost.build_failure(self.machine.admitted.name or self.node.name, config, f.start,
                                                  f.end, f.head, e) from e
                tok = ex.synth.load_tokenizer(tok_dir) if tok_dir else None
                # the host's draft model (`host --draft-model`): refused by name if unusable
                draft = ex.draft.DraftModel.load(draft_dir, tok) if draft_dir is not None else None
                return stage, tok, draft

            self.load["progress"] = "building the stage"
            self.node.changed()
            async with self.node.mlx_lock:
                stage, tok, draft = await run_on_mlx_thread(build)
            self.load["progress"] = "joining the ring"
            self.node.changed()
            await self._join_ring(stage, tok, head=f.head, epoch=epoch, roster=self.roster,
                                  on_edges=lambda: self.send_ctl(cf.Edges(self.paths.edge_list()).to_wire()),
                                  stage_nursery=stage_nursery, plan=f.plan, draft_model=draft)
            self.load = {"fetched_bytes": fetched, "cached_bytes": cached, "hf_cache_bytes": hf_cached,
                         "tensors": len(f.tensors), "load_s": time.perf_counter() - t0,
                         "edges": self.paths.edge_list()}
            await self._handle(sm.StageLoaded(self.load, epoch))
        except Exception as e:  # any failure to load is reported to the host with its reason
            reason = e.reason if isinstance(e, LinkClosed) else str(e) if isinstance(e, KafilaError) else \
                f"{self.node.name} could not load its stage: {e!r}"
            if not isinstance(e, KafilaError) or isinstance(e, StageBuildError):
                log.warning("loading the stage failed: %s", reason, exc_info=e)
            if self.state == sm.MemberState.LOADING and epoch == ((self.machine.plan.epoch or 0)
                                                                  if self.machine.plan else 0):
                if isinstance(e, RingEdgeError):  # the peer at the edge's other end is unreachable, not us:
                    await self._handle(sm.RingFailed(e.peer_id, reason, epoch))  # `ring_broken` naming it
                else:
                    await self._handle(sm.LoadFailed(reason, cf.FAILED_STAGE_BUILD if isinstance(e, StageBuildError)
                                                     else None))

    async def _fetch_files(self, entries: list, into: Path, prefix: str = "") -> None:
        """Fetch whole files the plan lists ([{name, nbytes, sha256}]: the head's tokenizer files, or
        the draft model's as `draft/NAME`) into directory `into` (proto_spec 05 §2.1: each checked
        against its sha256 and cached like tensors).

        Raises:
            RemoteProtocolError: an entry is malformed (a name that is not a plain file name, a size
                that is not a count, a digest that is not one).
            SessionError: as `Fetcher.fetch_verified`; or a file cannot be written (`store_error`).
        """
        for fi in entries:
            if not isinstance(fi, dict) or isinstance(fi.get("nbytes"), bool) or not isinstance(fi.get("nbytes"), int) \
                    or fi["nbytes"] < 0 or not isinstance(fi.get("sha256"), str):
                raise RemoteProtocolError(f"The plan's file entry {fi!r} is malformed.")
            name = checked_file_name(fi.get("name"))
            data, _ = await self.fetcher.fetch_verified(file=prefix + name, offset=0, nbytes=fi["nbytes"],
                                                        sha256=fi["sha256"])
            try:
                await trio.to_thread.run_sync(_write_file, into / name, data)
            except OSError as e:
                raise store_error(e, into, len(data)) from None

    def _ring_names(self) -> dict:
        return {pid: r["name"] for pid, r in self.roster.items()}

    async def _watch_ring(self, ring) -> None:
        await ring.broken_event.wait()
        if self.state in (sm.MemberState.LOADING, sm.MemberState.READY):
            await self._handle(sm.RingFailed(ring.broken_member, ring.broken, getattr(ring, "epoch", None)))

    def _take_schedule(self, mode: Optional[str]) -> None:
        """Hold the decode schedule a plan frame carries to this head (proto_spec 05 §2 `plan`; None:
        the host set none), which the driver applies to the ring it makes; a setting this daemon
        cannot read is logged and left."""
        from kafilad.node.serving.schedule_settings import parse_schedule
        try:
            if mode is not None:
                parse_schedule(mode)
        except ValueError as e:
            log.warning("the host's plan carries a schedule this daemon cannot apply (%s); the default stays", e)
            return
        self.schedule_mode = mode

    def _answer_schedule(self, f: cf.Schedule) -> cf.ScheduleState:
        """Show or set this head's decode schedule (proto_spec 05 §2 `schedule`); the setting outlives
        a replan that keeps this member the head (SessionDriver applies `schedule_mode`)."""
        from kafilad.node.serving.schedule_settings import apply_schedule, parse_schedule, schedule_result
        sched = self.ring.scheduler if self.ring is not None else None
        if sched is None:
            return cf.ScheduleState(req=f.req, error=f"{self.node.name} is not the ring's head now; send the "
                                                   "schedule again once the session is ready.")
        if f.mode is not None:
            try:
                apply_schedule(sched, parse_schedule(f.mode))
            except ValueError as e:
                return cf.ScheduleState(req=f.req, error=str(e))
            self.schedule_mode = f.mode
        return cf.ScheduleState(req=f.req, result=schedule_result(sched))

    async def _serve_generation(self, f: cf.Gen) -> None:
        from kafilad.errors import INVALID_LOGIT_BIAS, GenerationError
        from kafilad.proto.sampling import Sampling
        req = f.req

        async def on_event(ev: dict) -> None:
            await self.send_ctl(cf.GenEvent(req=req, event=ev).to_wire())

        try:
            try:  # checked on receipt (proto_spec 05 §2 `gen`): a map this head cannot apply fails the request
                sampling = Sampling.from_wire(f.sampling) if f.sampling is not None else None
            except RemoteProtocolError as e:
                raise GenerationError(f"The head {self.node.name} cannot sample this request: {e}.",
                                      INVALID_LOGIT_BIAS) from None
            st = await self.ring.generate(req, f.prompt, max_tokens=f.max_tokens, temperature=float(f.temperature),
                                          on_event=on_event, sampling=sampling, continue_ids=f.cont or ())
            if st.cancel_requested and st.error != self.ring.broken:  # the host's `cancel`: what was produced,
                # with every member's `end` row (its KV rows were freed on every stage)
                await self.send_ctl(cf.GenDone(req=req, result=cf.GenResult.from_wire(result_of(st))).to_wire())
            elif st.error:
                await self.send_ctl(cf.GenError(req=req, message=st.error).to_wire())
            else:
                await self.send_ctl(cf.GenDone(req=req, result=cf.GenResult.from_wire(result_of(st))).to_wire())
        except LinkClosed:
            pass
        except KafilaError as e:
            try:
                await self.send_ctl(cf.GenError(req=req, message=str(e), code=e.code).to_wire())
            except LinkClosed:
                pass

    def status(self) -> MemberStatus:
        """This session's status (kafilad/node/session/status.py builds it)."""
        return session_status.member_status(self)

    def snapshot(self) -> dict:
        """The status as its JSON document (`kafila-ctl status --json`)."""
        return self.status().to_json()

    def _still_reconnecting(self) -> bool:
        return not self._over.is_set()

    def _rendezvous_connected(self) -> bool:
        return bool(self.rdv)

    async def close(self, reason: str = "its user ran `kafila-ctl leave`") -> None:
        """Leave the session: the host is told why (`leaving`, proto_spec 05 §2)."""
        await self._handle(sm.Close(reason))


def _write_file(path, data: bytes) -> None:
    """Write `data` to `path`, creating its directory (off the trio thread)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
