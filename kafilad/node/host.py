"""The host's side of a session (DESIGN §3 steps 1-2, §5, §6; proto_spec 05 §1-§2).

Control frames on a host<->member "ctl" link (inside Noise; proto_spec 05 §1):

```
host -> member  {"t": "pending"}                      unknown key: wait for `kafila-ctl admit`
host -> member  {"t": "denied", "reason": str}        then the link closes
host -> member  {"t": "admitted", "model_id", "config", "dtype", "context", "concurrency"}
member -> host  {"t": "capability", "memory_bytes", "bandwidth_Bps", "step_overhead_s"}
host -> member  {"t": "plan", "plan": {...}, "ring": [peer_id...], "roster": {peer_id: {name, public_key}},
                 "start", "end", "head", "tensors": [{name, file, dtype, shape, offset, nbytes, sha256}],
                 "files": [{name, nbytes, sha256}]}
member -> host  {"t": "fetch", "id": int, "file": str, "offset": int, "length": int}
host -> member  {"t": "data", "id": int, "data": bytes}   | {"t": "fetch_error", "id", "reason"}
member -> host  {"t": "ready", "fetched_bytes", "cached_bytes", "load_s"} | {"t": "failed", "reason"}
host -> member  {"t": "gen", "req", "prompt", "max_tokens", "temperature"}   (to the head)
member -> host  {"t": "gen_event", "req", "event": {...}} / {"t": "gen_done", "req", "result": {...}}
host -> member  {"t": "session_failed", "reason"}
```
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Optional

import attrs
import trio

from kafilad.errors import GenerationError, HandshakeError, KafilaError, SessionError, collapse_groups
from kafilad.modelinfo import read_model_info
from kafilad.node.modelfiles import ModelFiles
from kafilad.node import stagehost
from kafilad.node.ring import run_on_mlx_thread
from kafilad.node.link import Link, LinkClosed, secure_link
from kafilad.planner import plan as make_plan
from kafilad.planner.records import Device
from kafilad.proto.identity import compose_session_code, peer_id as peer_id_of

log = logging.getLogger("kafilad.host")

DEFAULT_CONTEXT = 4096  # tokens, when --context is not given (capped at max_position_embeddings)
HOLD_DTYPE_BYTES = 4  # CPU members hold f32 weights (DESIGN §6)


@attrs.define
class MemberRecord:
    peer_id: str
    name: str
    public_key: bytes
    link: Optional[Link] = None  # None for the host itself
    capability: Optional[dict] = None
    ready: bool = False
    lost: Optional[str] = None
    control_down: bool = False  # its ctl circuit died with the rendezvous; its ring stage may still run
    load: dict = attrs.field(factory=dict)


@attrs.define
class PendingPeer:
    peer_id: str
    name: str
    public_key: bytes
    since_s: float
    decision: Optional[str] = None
    reason: str = ""
    event: trio.Event = attrs.field(factory=trio.Event)


class HostSession:
    """One session hosted by this daemon. Runs inside the node's root nursery."""

    role = "host"

    def __init__(self, node, *, model_dir: str, members: int, context: int, concurrency: int,
                 rendezvous: str, open_: bool, admit_timeout_s: float):
        self.node = node
        self.model_dir = str(Path(model_dir).resolve())
        self.expected = members
        self.context = context
        self.concurrency = concurrency
        self.rdv_url = rendezvous
        self.open = open_
        self.admit_timeout_s = admit_timeout_s
        self.info = read_model_info(self.model_dir)
        self.files = ModelFiles(self.model_dir, self.info)
        self._validate()
        self.session_id = ""
        self.code = ""
        self.state = "starting"
        self.error: Optional[str] = None
        self.members: dict[str, MemberRecord] = {}
        self.pending: dict[str, PendingPeer] = {}
        self.plan = None
        self.fleet_devices: list[Device] = []
        self.ring_order: list[str] = []
        self.ring = None
        self.generations: dict[str, trio.MemorySendChannel] = {}
        self.started_s = time.time()
        self.formed_s: Optional[float] = None
        self.measured_stage_s: dict[str, float] = {}
        self.last_generation: dict = {}
        self._members_changed = trio.Event()
        self._ring_incoming_send, self._ring_incoming = trio.open_memory_channel(8)
        self.trace = None
        self.rdv = None
        self.rendezvous_lost: Optional[str] = None  # why the rendezvous connection ended (DESIGN §2)
        self._culprit: Optional[str] = None

    def _validate(self) -> None:
        """Refuse arguments no plan could honour, before anyone joins (DESIGN §5.4).

        Raises:
            KafilaError: members outside [1, blocks], context or concurrency below 1, or a
                context beyond the model's max_position_embeddings.
        """
        n_blocks = self.info.num_hidden_layers
        if not 1 <= self.expected <= n_blocks:
            raise KafilaError(f"--members counts every machine, the host included, and each holds at least one "
                              f"block: it must be between 1 and {n_blocks} for {self.info.model_id} (got {self.expected}).")
        limit = self.info.config.get("max_position_embeddings")
        if self.context is None:
            self.context = min(DEFAULT_CONTEXT, int(limit)) if limit else DEFAULT_CONTEXT
        if not self.admit_timeout_s > 0:
            raise KafilaError(f"--admit-timeout must be a positive number of seconds (got {self.admit_timeout_s:g}).")
        if self.context < 1 or self.concurrency < 1:
            raise KafilaError(f"--context and --concurrency must be at least 1 (got {self.context} and {self.concurrency}).")
        if limit and self.context > int(limit):
            raise KafilaError(f"--context {self.context} exceeds {self.info.model_id}'s max_position_embeddings "
                              f"({int(limit)}); pass --context {int(limit)} or less.")

    # ---- lifecycle -------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from kafilad.node.rdv_client import open_rendezvous
        from kafilad.node.trace import Trace

        me = MemberRecord(peer_id=self.node.peer_id, name=self.node.name, public_key=self.node.public_key)
        self.members[me.peer_id] = me
        try:
            async with open_rendezvous(self.rdv_url, static_private=self.node.static_private,  # [rdv-proof]
                                       name=self.node.name) as rdv:  # [rdv-proof]
                self.rdv = rdv
                self.session_id = await rdv.register(self.info.model_id, self.expected,
                                                     {"name": self.node.name})
                self.code = compose_session_code(self.session_id, self.node.public_key)
                self.trace = Trace(self.node.state.trace_path(self.session_id))
                self.trace.write("session_opened", session_id=self.session_id, role="host",
                                 model_id=self.info.model_id, members=self.expected,
                                 context=self.context, concurrency=self.concurrency)
                self.state = "forming"
                self.node.changed()
                task_status.started(self.code)
                with collapse_groups():
                    async with trio.open_nursery() as nursery:
                        self.nursery = nursery
                        nursery.start_soon(self._accept_loop, rdv)
                        nursery.start_soon(self._events_loop, rdv)
                        nursery.start_soon(self._form)
        except KafilaError as e:
            if self.code:
                self._fail(str(e))
            else:
                raise
        except (trio.BrokenResourceError, OSError) as e:
            if self.code:
                self._fail(f"the rendezvous connection was lost ({e!r})")
            else:
                raise SessionError(f"cannot reach the rendezvous at {self.rdv_url}: {e}") from None

    def _fail(self, reason: str) -> None:
        if self.state in ("failed", "closed"):
            return
        log.warning("session %s failed: %s", self.session_id, reason)
        self.state = "failed"
        self.error = reason
        for ch in list(self.generations.values()):
            try:
                ch.send_nowait({"t": "gen_error", "message": reason})
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        if self.ring is not None:
            self.ring.fail_all(reason, member=self._culprit or "?")
        if self.trace:
            self.trace.write("session_failed", reason=reason)
        self.node.changed()

    # ---- membership -------------------------------------------------------------------------
    async def _accept_loop(self, rdv) -> None:
        async def serve(circuit) -> None:
            self.nursery.start_soon(self._serve_member, circuit)
        await stagehost.accept_circuits(rdv, {"ctl": serve, "ring": self._ring_incoming_send.send})

    async def _events_loop(self, rdv) -> None:
        from kafilad.node.rdv_client import Disconnected, MemberLeft, Signal
        async for ev in rdv.events:
            if isinstance(ev, Signal):  # [paths] candidate offers (proto_spec 07 §2)
                stagehost.on_signal(self.node, ev)
            elif isinstance(ev, MemberLeft):
                rec = self.members.get(ev.peer_id)
                if rec is not None and rec.lost is None:
                    rec.lost = ev.reason or "it left the rendezvous"
                    if self.state in ("planning", "loading", "ready"):
                        await self._member_lost(rec, rec.lost)
                    else:
                        self.members.pop(ev.peer_id, None)
                        self._members_changed.set()
                        self.node.changed()
            elif isinstance(ev, Disconnected):
                await self._rendezvous_gone(ev.reason)

    def _rdv_lost_reason(self) -> Optional[str]:
        """Why the rendezvous connection ended, or None while it is up."""
        return self.rendezvous_lost or getattr(self.rdv, "lost", None)

    async def _rendezvous_gone(self, reason: str) -> None:
        """The rendezvous connection ended (DESIGN §2: it is signalling and a last-resort relay).

        Every ctl link (a relayed circuit) died with it. A ready session whose ring edges are all
        direct keeps serving while the head is the host; with another head the host cannot start
        requests, and with any relayed edge the ring itself is broken: both fail the session.
        """
        if self.rendezvous_lost is not None:
            return
        self.rendezvous_lost = reason
        for r in self.members.values():
            if r.link is not None:
                r.control_down = True
        lost = f"the connection to the rendezvous was lost ({str(reason).rstrip('.')})"
        if self.trace:
            self.trace.write("rendezvous_lost", reason=reason)
        self.node.changed()
        if self.state != "ready":
            await self._fail_and_notify(f"{lost} while the session was {self.state}")
            return
        relayed = [f"{e['from']} -> {e['to']}" for e in stagehost.session_edges(self) if e.get("path") != "direct"]
        if relayed:
            await self._fail_and_notify(f"{lost}, and the ring edge(s) {', '.join(relayed)} were relayed "
                                        "through it, so the ring is broken")
            return
        head = self.members.get(self.ring_order[0]) if self.ring_order else None
        if head is not None and head.link is not None:
            self._culprit = head.name
            self._fail(f"the control link to the head {head.name} went down with the rendezvous; {lost}. "
                       f"The ring is direct and still runs, but this host can only start requests through "
                       f"the head: leave and form the session again once the rendezvous is back")
            return
        log.warning("session %s: %s; every ring edge is direct and the head is this host, so it keeps serving",
                    self.session_id, lost)

    async def _member_lost(self, rec: MemberRecord, reason: str) -> None:
        msg = f"member {rec.name} ({rec.peer_id}) left the session: {reason}"
        self._culprit = rec.name
        await self._fail_and_notify(msg)

    def _check_member(self, remote_static: bytes, hello: dict) -> str:
        claimed = hello.get("peer_id")
        if claimed != peer_id_of(remote_static):
            raise HandshakeError("the member's claimed peer id does not match its static key")
        return str(hello.get("name") or claimed)[:64]

    async def _serve_member(self, circuit) -> None:
        try:
            link, remote_static, hello = await secure_link(
                circuit, initiator=False, static_private=self.node.static_private, session_id=self.session_id,
                hello={"peer_id": self.node.peer_id, "name": self.node.name, "role": "host"},
                check_remote=self._check_member, label="ctl")
        except HandshakeError as e:
            log.warning("refused a member handshake: %s", e)
            return
        pid = link.peer_id
        try:
            if not await self._admission(link, pid, remote_static):
                return
            rec = MemberRecord(peer_id=pid, name=link.peer_name, public_key=remote_static, link=link)
            self.members[pid] = rec
            self.node.changed()
            await link.send({"t": "admitted", "model_id": self.info.model_id, "config": self.info.config,
                             "dtype": "float32", "context": self.context, "concurrency": self.concurrency,
                             "session_id": self.session_id})
            await self._member_loop(rec)
        except LinkClosed as e:
            rec = self.members.get(pid)
            if rec is not None and rec.link is link and self._rdv_lost_reason() is not None:
                await self._rendezvous_gone(self._rdv_lost_reason())  # its ctl circuit died with the rendezvous
            elif rec is not None and rec.link is link and rec.lost is None:
                rec.lost = e.reason
                if self.state in ("planning", "loading", "ready"):
                    await self._member_lost(rec, e.reason)
                else:
                    self.members.pop(pid, None)
                    self._members_changed.set()
                    self.node.changed()
        finally:
            await link.close()

    async def _admission(self, link: Link, pid: str, remote_static: bytes) -> bool:
        """Admit, hold pending, or deny a member that completed the handshake (DESIGN §4)."""
        if self.state != "forming" or len(self.members) >= self.expected:
            await link.send({"t": "denied", "reason": "the session is already complete"})
            return False
        if pid in self.members or pid in self.pending:
            await link.send({"t": "denied", "reason": "this device is already in the session"})
            return False
        roster = self.node.state.load_roster()
        known = roster.get(pid, {}).get("public_key") == remote_static.hex()
        if self.open or known:
            self._remember(pid, link.peer_name, remote_static)
            return True
        pend = PendingPeer(pid, link.peer_name, remote_static, time.time())
        self.pending[pid] = pend
        self.node.changed()
        await link.send({"t": "pending"})
        with trio.move_on_after(self.admit_timeout_s):
            await pend.event.wait()
        self.pending.pop(pid, None)
        self.node.changed()
        if pend.decision == "admit":
            if self.state != "forming" or len(self.members) >= self.expected:
                await link.send({"t": "denied", "reason": "the session became complete while this device waited"})
                return False
            self._remember(pid, link.peer_name, remote_static)
            return True
        reason = (pend.reason or "the host denied this device") if pend.decision == "deny" else \
            f"the host did not admit this device within {self.admit_timeout_s:g} s"
        await link.send({"t": "denied", "reason": reason})
        return False

    def _remember(self, pid: str, name: str, public_key: bytes) -> None:
        roster = self.node.state.load_roster()
        roster[pid] = {"public_key": public_key.hex(), "name": name}
        self.node.state.save_roster(roster)

    def decide(self, who: str, decision: str) -> dict:
        """Admit or deny a pending peer named by peer id or name.

        Raises:
            KafilaError: no pending peer matches `who`.
        """
        for p in self.pending.values():
            if who in (p.peer_id, p.name):
                p.decision = decision
                p.event.set()
                return {"peer_id": p.peer_id, "name": p.name, "decision": decision}
        raise KafilaError(f"No pending peer named '{who}'; `kafila-ctl pending` lists them.")

    # ---- per-member control loop ------------------------------------------------------------
    async def _member_loop(self, rec: MemberRecord) -> None:
        link = rec.link
        while True:
            f = await link.receive()
            t = f.get("t")
            if t == "capability":
                rec.capability = _checked_capability(f, rec.name)
                self._members_changed.set()
                self.node.changed()
            elif t == "fetch":
                await self._serve_fetch(link, f)
            elif t == "ready":
                rec.ready = True
                rec.load = {k: f.get(k) for k in ("fetched_bytes", "cached_bytes", "load_s", "edges")}
                self._members_changed.set()
                self.node.changed()
            elif t == "edges":  # [paths] a member's edges after an upgrade (proto_spec 07 §7)
                stagehost.note_edges(self, rec, f.get("edges"))
            elif t == "failed":
                raise LinkClosed(f"{rec.name} failed to load its stage: {f.get('reason')}")
            elif t == "leaving":
                raise LinkClosed(f"{rec.name} is leaving: {f.get('reason')}")
            elif t == "ring_broken":
                if self.state not in ("failed", "closed"):
                    self._culprit = f.get("member")
                    await self._fail_and_notify(f"{f.get('reason')} (reported by {rec.name})")
            elif t in ("gen_event", "gen_done", "gen_error"):
                ch = self.generations.get(f.get("req"))
                if ch is not None:
                    await ch.send(f)
            else:
                log.info("ignoring control frame %r from %s", t, rec.name)

    async def _serve_fetch(self, link: Link, f: dict) -> None:
        """Serve one byte range of a model file (proto_spec 05 §2) — only files of the model."""
        req_id, fname, offset, length = f.get("id"), f.get("file"), f.get("offset"), f.get("length")
        problem = self.files.check_range(fname, offset, length)
        if problem is not None:
            await link.send({"t": "fetch_error", "id": req_id, "reason": f"cannot serve it: {problem}"})
            return
        data = await trio.to_thread.run_sync(self.files.read, fname, offset, length)
        await link.send({"t": "data", "id": req_id, "data": data})

    # ---- formation --------------------------------------------------------------------------
    async def _form(self) -> None:
        t0 = time.perf_counter()
        me = self.members[self.node.peer_id]
        me.capability = await run_on_mlx_thread(stagehost.measure_capability, self.model_dir)
        me.capability.update(await stagehost.nat_capability(self.node, self.rdv))  # [paths]
        self.node.changed()
        while True:
            live = [r for r in self.members.values() if r.lost is None]
            if len(live) == self.expected and all(r.capability for r in live):
                break
            self._members_changed = trio.Event()
            await self._members_changed.wait()
        self.state = "planning"
        self.node.changed()
        order = list(self.members.values())  # the host (anchor) first, then members in join order
        self.fleet_devices = [Device(name=r.name, memory_bytes=int(r.capability["memory_bytes"]),
                                     bandwidth_Bps=r.capability.get("bandwidth_Bps"),
                                     step_overhead_s=float(r.capability.get("step_overhead_s") or 0.0),
                                     nat_class=r.capability.get("nat_class"),  # [paths]
                                     rendezvous_rtt_ms=r.capability.get("rendezvous_rtt_ms"))
                              for r in order]
        try:
            self.plan = make_plan(self.fleet_devices, self.info.profile(float_dtype_bytes=HOLD_DTYPE_BYTES),
                                  context=self.context, concurrency=self.concurrency)
        except KafilaError as e:
            await self._fail_and_notify(f"no plan fits this fleet: {str(e).rstrip('.')}")
            return
        by_name = {r.name: r for r in order}
        self.ring_order = [by_name[n].peer_id for n in self.plan.order]
        self.trace.write("plan", plan=self.plan.to_json(), fleet=self.fleet_json())
        roster = {r.peer_id: {"name": r.name, "public_key": r.public_key} for r in order}
        self.state = "loading"
        self.node.changed()
        for r in order:
            if r.link is None:
                continue
            start, end = self.plan.blocks[r.name]
            head = self.plan.head == r.name
            tensors = await trio.to_thread.run_sync(self.files.tensor_table, start, end, head)
            files = await trio.to_thread.run_sync(self.files.file_table) if head else []
            await r.link.send({"t": "plan", "plan": self.plan.to_json(), "ring": self.ring_order, "roster": roster,
                               "start": start, "end": end, "head": head, "tensors": tensors, "files": files})
        await self._load_own(roster)
        while not all(r.ready for r in self.members.values()):
            if self.state == "failed":
                return
            self._members_changed = trio.Event()
            await self._members_changed.wait()
        self.formed_s = time.perf_counter() - t0
        self.state = "ready"
        self.trace.write("edges", edges=stagehost.session_edges(self))  # [paths] predicted/actual/verify time
        self.trace.write("session_formed", form_s=self.formed_s,
                         load={r.name: r.load for r in self.members.values()})
        self.node.changed()

    async def _load_own(self, roster: dict) -> None:
        t0 = time.perf_counter()
        me = self.members[self.node.peer_id]
        start, end = self.plan.blocks[me.name]
        head = self.plan.head == me.name

        def build():
            ex = stagehost.executor()
            stage = ex.stage.load_stage_from_dir(self.model_dir, start, end, head)
            tok = ex.synth.load_tokenizer(self.model_dir) if head else None
            return stage, tok

        async with self.node.mlx_lock:
            stage, tok = await run_on_mlx_thread(build)
        self.ring = stagehost.make_ring_member(self.node, stage=stage, head=head, tokenizer=tok)
        nxt, prv = await stagehost.connect_ring(node=self.node, rdv=self.rdv, session_id=self.session_id,
                                                ring=self.ring_order, roster=roster, incoming=self._ring_incoming,
                                                member=self.ring, on_edges=lambda: stagehost.note_edges(self, me, None))  # [paths]
        self._attach_ring(nxt, prv)
        me.ready = True
        me.load = {"fetched_bytes": 0, "cached_bytes": 0, "load_s": time.perf_counter() - t0}

    def _attach_ring(self, nxt, prv) -> None:
        stagehost.attach_ring(self.ring, nursery=self.nursery, me=self.node.peer_id, ring_order=self.ring_order,
                              names={pid: r.name for pid, r in self.members.items()}, next_link=nxt, prev_link=prv,
                              watch=self._watch_ring)

    async def _watch_ring(self, ring) -> None:
        await ring.broken_event.wait()
        if self.state not in ("failed", "closing", "closed"):
            self._culprit = ring.broken_member
            lost = self._rdv_lost_reason()
            await self._fail_and_notify(ring.broken if lost is None else
                                        f"{ring.broken} (the connection to the rendezvous was lost as well: "
                                        f"{str(lost).rstrip('.')})")

    async def _fail_and_notify(self, msg: str) -> None:
        """Fail the session and tell every member (whose head then fails its requests)."""
        self._fail(msg)
        for other in list(self.members.values()):  # [paths] members may leave while we await
            if other.link is not None and other.lost is None:
                with trio.move_on_after(2):
                    try:
                        await other.link.send({"t": "session_failed", "reason": msg})
                    except LinkClosed:
                        pass

    # ---- generation ---------------------------------------------------------------------------
    async def generate(self, prompt: str, *, max_tokens: int, temperature: float, emit) -> dict:
        """Serve one request through the head; stream tokens to `emit`; return the result.

        Raises:
            GenerationError: the session is not ready, or a member was lost (named in the message).
        """
        if self.state != "ready":
            raise GenerationError(f"The session is not ready to generate (state: {self.state}"
                                  + (f"; {self.error.rstrip('.')}" if self.error else "") + ").")
        n_prompt = len(self.chat_tokenizer().encode(prompt))
        if n_prompt + max_tokens > self.context:
            raise GenerationError(f"The prompt ({n_prompt} tokens) plus --max-tokens {max_tokens} exceeds the "
                                  f"session's admitted context of {self.context} tokens.")
        req = uuid.uuid4().hex[:12]
        head = self.members[self.ring_order[0]]
        t0 = time.perf_counter()
        if head.link is None:
            st = await self.ring.generate(req, prompt, max_tokens=max_tokens, temperature=temperature,
                                          on_event=lambda ev: emit(ev))
            if st.error:
                raise GenerationError(st.error)
            result = result_of(st)
        else:
            send, recv = trio.open_memory_channel(1024)
            self.generations[req] = send
            try:
                await head.link.send({"t": "gen", "req": req, "prompt": prompt, "max_tokens": max_tokens,
                                      "temperature": temperature})
                result = None
                async for f in recv:
                    if f["t"] == "gen_event":
                        await emit(f["event"])
                    elif f["t"] == "gen_done":
                        result = f["result"]
                        break
                    else:
                        raise GenerationError(f.get("message") or "generation failed")
            except LinkClosed as e:
                raise GenerationError(f"member {head.name} is unreachable: {e.reason}") from None
            finally:
                self.generations.pop(req, None)
        result["wall_s"] = time.perf_counter() - t0
        self._record_generation(result)
        return result

    def _record_generation(self, result: dict) -> None:
        names = {r.peer_id: r.name for r in self.members.values()}
        for pid, steps, total_s, median_s, nbytes in result.get("stats", []):
            if pid in names:
                self.measured_stage_s[names[pid]] = median_s
        self.last_generation = {k: v for k, v in result.items() if k not in ("text", "token_ids")}
        self.trace.write("generation", **{k: v for k, v in result.items() if k != "text"},
                         stages={names.get(s[0], s[0]): {"steps": s[1], "compute_s": s[2], "decode_stage_s": s[3],
                                                         "ring_bytes_sent": s[4]} for s in result.get("stats", [])},
                         predicted_stage_s=self.plan.stage_s if self.plan else {},
                         path=stagehost.edge_paths(self),  # [paths] sender name -> "direct" | "relayed"
                         edges=stagehost.generation_edges(self, result))  # [paths] live bytes_sent per edge
        self.node.changed()

    def chat_prompt(self, messages) -> str:
        """The prompt text for chat `messages` ([{role, content}]) by the model's chat template.

        Raises:
            KafilaError: malformed messages.
        """
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            raise KafilaError("Chat messages must be a non-empty list of {role, content} objects.")
        tok = self.chat_tokenizer()
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # no chat template (base models): a plain transcript
        return "".join(f"{m.get('role', 'user')}: {m['content']}\n" for m in messages) + "assistant:"

    def chat_tokenizer(self):
        """The model's tokenizer on the host (for chat templates of the HTTP API), loaded once."""
        if getattr(self, "_chat_tokenizer", None) is None:
            self._chat_tokenizer = stagehost.executor().synth.load_tokenizer(self.model_dir)
        return self._chat_tokenizer

    # ---- reporting ----------------------------------------------------------------------------
    def fleet_json(self) -> dict:
        from kafilad.planner import fleet_to_json
        return fleet_to_json(self.fleet_devices, self.context, self.concurrency)

    def snapshot(self) -> dict:
        plan = self.plan
        members = []
        ordered = [self.members[p] for p in self.ring_order if p in self.members] or list(self.members.values())
        for r in ordered:
            blocks = list(plan.blocks[r.name]) if plan and r.name in plan.blocks else None
            members.append({"name": r.name, "peer_id": r.peer_id, "blocks": blocks,
                            "head": bool(plan and plan.head == r.name),
                            "predicted_stage_s": plan.stage_s.get(r.name) if plan else None,
                            "measured_stage_s": self.measured_stage_s.get(r.name),
                            "ready": r.ready, "lost": r.lost,
                            "control": None if r.link is None else ("down" if r.control_down else "up"),
                            "progress": "loading" if self.state == "loading" and not r.ready else None,
                            "capability": r.capability,
                            "nat_class": (r.capability or {}).get("nat_class")})  # [paths]
        return {"role": "host", "session_id": self.session_id, "code": self.code, "state": self.state,
                "error": self.error, "model_id": self.info.model_id, "expected_members": self.expected,
                "rendezvous": "lost" if self.rendezvous_lost else ("connected" if self.rdv else None),
                "context": self.context, "concurrency": self.concurrency, "members": members,
                "pending": [{"peer_id": p.peer_id, "name": p.name} for p in self.pending.values()],
                "form_s": self.formed_s, "last_generation": self.last_generation,
                "fleet": self.fleet_json() if self.fleet_devices else None,
                "plan": plan.to_json() if plan else None,
                "edges": stagehost.session_edges(self)}  # [paths]

    async def close(self) -> None:
        if self.trace is not None:  # [paths] the edges (paths, bytes sent) at session end
            self.trace.write("session_closed", edges=stagehost.session_edges(self))  # [paths]
        reason = "the host closed the session"
        self._fail(reason)  # requests in flight end with this reason, not a member's departure
        self.state = "closing"
        for r in list(self.members.values()):  # [paths] members may leave while we await
            if r.link is not None:
                await r.link.close(reason)
        self.state = "closed"


def _checked_capability(f: dict, name: str) -> dict:
    """A member's capability frame (proto_spec 05 §2), type-checked for the planner (DESIGN §5.1).

    Raises:
        LinkClosed: a field is missing or malformed (that member's link then closes with the reason).
    """
    def number(key, *, required=False, positive=False):
        v = f.get(key)
        if v is None and not required:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or (positive and v <= 0):
            raise LinkClosed(f"malformed capability from {name}: '{key}' is {v!r}")
        return v

    cap = {"memory_bytes": int(number("memory_bytes", required=True, positive=True)),
           "bandwidth_Bps": number("bandwidth_Bps", positive=True),
           "step_overhead_s": number("step_overhead_s") or 0.0,
           "rendezvous_rtt_ms": number("rendezvous_rtt_ms"),
           "nat_class": f.get("nat_class")}
    if cap["nat_class"] not in (None, "O", "C", "S"):
        raise LinkClosed(f"malformed capability from {name}: 'nat_class' is {cap['nat_class']!r}")
    return cap


def result_of(st) -> dict:
    """The result record of a finished RequestState (kafilad/node/ring.py)."""
    decode = st.circuit_s[len(st.circuit_s) - len(st.generated) + 1:] if len(st.generated) > 1 else []
    ttft = (st.first_token_s - st.started_s) if st.first_token_s else None
    decode_s = sum(decode)
    return {"text": st.text, "token_ids": list(st.generated), "prompt_tokens": len(st.prompt_ids),
            "ttft_s": ttft, "decode_tokens": len(decode),
            "decode_tokens_per_s": (len(decode) / decode_s) if decode_s > 0 else None,
            "circuit_s_median": _median(decode),
            "stats": getattr(st, "end_stats", [])}


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


