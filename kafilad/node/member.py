"""A member's side of a session: join by code, get admitted, report, fetch, load, serve.

DESIGN §3 steps 1-2, §5.1, §6; the frames are those of proto_spec 05 §1-§3 (see
kafilad/node/host.py for the table).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Optional

import trio

from kafilad.errors import HandshakeError, KafilaError, SessionError, collapse_groups
from kafilad.node import stagehost
from kafilad.node.host import result_of
from kafilad.node.ring import run_on_mlx_thread
from kafilad.node.link import Link, LinkClosed, secure_link
from kafilad.proto.identity import fingerprint, fingerprint_matches, parse_session_code, peer_id as peer_id_of

log = logging.getLogger("kafilad.member")

FETCH_CHUNK_BYTES = 4 * 1024 * 1024


class MemberSession:
    """This daemon as a member of someone else's session. Runs inside the node's root nursery."""

    role = "member"

    def __init__(self, node, *, code: str, rendezvous: str):
        self.node = node
        self.code = code
        self.session_id, self.host_fingerprint = parse_session_code(code)
        self.rdv_url = rendezvous
        self.state = "joining"
        self.error: Optional[str] = None
        self.host_name = "?"
        self.link: Optional[Link] = None
        self.admitted: Optional[dict] = None
        self.plan: Optional[dict] = None
        self.ring = None
        self.ring_order: list[str] = []
        self.roster: dict = {}
        self.capability: Optional[dict] = None
        self.load: dict = {}
        self._ring_incoming_send, self._ring_incoming = trio.open_memory_channel(8)
        self._fetch_waiters: dict[int, trio.MemorySendChannel] = {}
        self._next_fetch = 0
        self.rdv = None
        self.rendezvous_lost: Optional[str] = None  # why the rendezvous connection ended (DESIGN §2)

    async def run(self, *, progress, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Join; `task_status.started()` once admitted. Before that, errors propagate to the caller.

        Raises:
            SessionError: unknown session, wrong host key, denied, or not admitted in time.
        """
        from kafilad.node.rdv_client import open_rendezvous
        started = False
        try:
            async with open_rendezvous(self.rdv_url, static_private=self.node.static_private,  # [rdv-proof]
                                       name=self.node.name) as rdv:  # [rdv-proof]
                self.rdv = rdv
                host_pid = await rdv.join(self.session_id)
                await progress({"msg": f"joined session {self.session_id} at the rendezvous; verifying the host"})
                circuit = await rdv.open_circuit(host_pid, "ctl")

                def check_host(remote_static: bytes, hello: dict) -> str:
                    if not fingerprint_matches(self.host_fingerprint, remote_static):
                        raise HandshakeError(
                            "the host's key does not match the session code's fingerprint "
                            f"(expected {self.host_fingerprint}, got {fingerprint(remote_static)}); refusing to join")
                    if peer_id_of(remote_static) != host_pid:
                        raise HandshakeError("the host's key does not match its peer id at the rendezvous; refusing to join")
                    return str(hello.get("name") or host_pid)

                try:
                    self.link, _, _ = await secure_link(
                        circuit, initiator=True, static_private=self.node.static_private, session_id=self.session_id,
                        hello={"peer_id": self.node.peer_id, "name": self.node.name, "role": "member"},
                        check_remote=check_host, label="ctl")
                except HandshakeError as e:
                    raise SessionError(f"Refusing to join session {self.session_id}: {e}.") from None
                self.host_name = self.link.peer_name
                while True:
                    try:
                        f = await self.link.receive()
                    except LinkClosed as e:
                        raise SessionError(f"The host closed the link before admitting this device: {e.reason}.") from None
                    if f.get("t") == "pending":
                        self.state = "pending"
                        self.node.changed()
                        await progress({"msg": f"waiting for the host to admit this device (peer id {self.node.peer_id}, "
                                               f"fingerprint {fingerprint(self.node.public_key)})"})
                    elif f.get("t") == "denied":
                        raise SessionError(f"The host refused this device: {f.get('reason')}.")
                    elif f.get("t") == "admitted":
                        self.admitted = f
                        break
                self.state = "admitted"
                self.node.changed()
                task_status.started()
                started = True
                try:
                    with collapse_groups():
                        async with trio.open_nursery() as nursery:
                            self.nursery = nursery
                            nursery.start_soon(self._accept_loop, rdv)
                            nursery.start_soon(self._events_loop, rdv)
                            await self._control_loop()
                            nursery.cancel_scope.cancel()
                except trio.Cancelled:
                    await self._say_leaving("its daemon is shutting down")
                    raise
        except (KafilaError, LinkClosed, trio.BrokenResourceError, OSError) as e:
            reason = e.reason if isinstance(e, LinkClosed) else str(e)
            if not started:
                if isinstance(e, KafilaError):
                    raise
                raise SessionError(f"Cannot join: {reason}.") from None
            self._fail(reason)

    async def _say_leaving(self, reason: str) -> None:
        """Tell the host why we go (best effort, shielded: we are being cancelled)."""
        if self.link is None or self.link.closed_reason is not None:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            try:
                await self.link.send({"t": "leaving", "reason": reason})
            except (LinkClosed, Exception):
                pass

    def _fail(self, reason: str) -> None:
        if self.state in ("failed", "closed"):
            return
        log.warning("session %s failed: %s", self.session_id, reason)
        self.state = "failed"
        self.error = reason
        self.node.changed()

    async def _accept_loop(self, rdv) -> None:
        await stagehost.accept_circuits(rdv, {"ring": self._ring_incoming_send.send})

    async def _events_loop(self, rdv) -> None:
        from kafilad.node.rdv_client import Disconnected, MemberLeft, SessionClosed, Signal
        async for ev in rdv.events:
            if isinstance(ev, Signal):  # [paths] candidate offers (proto_spec 07 §2)
                stagehost.on_signal(self.node, ev)
            elif isinstance(ev, MemberLeft):
                name = self.roster.get(ev.peer_id, {}).get("name", ev.peer_id)
                if self.ring is not None:
                    self.ring.fail_all(f"it left the session ({ev.reason})", member=name)
                if self.state in ("loading", "ready"):
                    self._fail(f"member {name} left the session: {ev.reason}")
            elif isinstance(ev, Disconnected):
                self._rendezvous_gone(ev.reason)
            elif isinstance(ev, SessionClosed):
                self._fail(f"the session ended: {ev.reason}")

    def _rendezvous_gone(self, reason: str) -> bool:
        """The rendezvous connection ended, and with it the ctl link to the host (a relayed circuit).

        A ready member whose two ring edges are direct keeps running its stage (DESIGN §2: the
        rendezvous is signalling and a last-resort relay); otherwise it fails. Returns True if it
        keeps running.
        """
        first = self.rendezvous_lost is None
        self.rendezvous_lost = self.rendezvous_lost or reason
        lost = f"the connection to the rendezvous was lost ({str(self.rendezvous_lost).rstrip('.')})"
        paths = [e.get("path") for e in stagehost.edges_of(self.node)]
        keep = self.state == "ready" and len(paths) >= 2 and all(p == "direct" for p in paths) \
            and (self.ring is None or not self.ring.broken)
        if not keep:
            self._fail(f"{lost} while this device was {self.state}" if self.state != "ready" else
                       f"{lost}, and this device's ring edges were relayed through it")
        elif first:
            log.warning("session %s: %s; both ring edges are direct, so this stage keeps serving",
                        self.session_id, lost)
            self.node.changed()
        return keep

    def _rdv_lost_reason(self) -> Optional[str]:
        return self.rendezvous_lost or getattr(self.rdv, "lost", None)

    # ---- control loop ----------------------------------------------------------------------
    async def _control_loop(self) -> None:
        cap = await run_on_mlx_thread(stagehost.measure_capability, self.admitted["config"])
        cap.update(await stagehost.nat_capability(self.node, self.rdv))  # [paths] nat_class, rendezvous_rtt_ms
        self.capability = cap
        await self.link.send({"t": "capability", **cap})
        self.state = "measured"
        self.node.changed()
        while True:
            try:
                f = await self.link.receive()
            except LinkClosed as e:
                lost = self._rdv_lost_reason()
                if lost is not None and self._rendezvous_gone(lost):
                    await trio.sleep_forever()  # the ring stage keeps serving without the ctl link
                self._fail(f"the link to the host {self.host_name} closed: {e.reason}")
                return
            t = f.get("t")
            if t == "plan":
                self.nursery.start_soon(self._load, f)
            elif t in ("data", "fetch_error"):
                ch = self._fetch_waiters.pop(f.get("id"), None)
                if ch is not None:
                    await ch.send(f)
            elif t == "gen":
                self.nursery.start_soon(self._serve_generation, f)
            elif t == "session_failed":
                self._fail(f.get("reason", "the host reported a failure"))
                if self.ring is not None:
                    self.ring.fail_all(f.get("reason", ""), member=self.host_name)
            else:
                log.info("ignoring control frame %r from the host", t)

    async def _fetch(self, file: str, offset: int, length: int) -> bytes:
        out = bytearray()
        while len(out) < length:
            n = min(FETCH_CHUNK_BYTES, length - len(out))
            self._next_fetch += 1
            fid = self._next_fetch
            send, recv = trio.open_memory_channel(1)
            self._fetch_waiters[fid] = send
            await self.link.send({"t": "fetch", "id": fid, "file": file, "offset": offset + len(out), "length": n})
            f = await recv.receive()
            if f["t"] == "fetch_error":
                raise SessionError(f"The host could not serve {file}: {f.get('reason')}.")
            data = f["data"]
            if len(data) != n:
                raise SessionError(f"The host sent {len(data)} bytes of {file} where {n} were asked.")
            out += data
        return bytes(out)

    async def _fetch_verified(self, *, file: str, offset: int, nbytes: int, sha256: str) -> tuple[bytes, bool]:
        """Bytes of one tensor or file, from the cache when present and intact (DESIGN §6)."""
        cache = self.node.state.cache_dir / sha256
        if cache.is_file():
            data = cache.read_bytes()
            if hashlib.sha256(data).hexdigest() == sha256:
                return data, True
        data = await self._fetch(file, offset, nbytes)
        if hashlib.sha256(data).hexdigest() != sha256:
            raise SessionError(f"{file} [{offset}, +{nbytes}) from the host failed verification (sha256 mismatch).")
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".part")
        tmp.write_bytes(data)
        os.replace(tmp, cache)
        return data, False

    async def _load(self, f: dict) -> None:
        t0 = time.perf_counter()
        self.plan = f
        self.ring_order = list(f["ring"])
        self.roster = {pid: {"name": r["name"], "public_key": bytes(r["public_key"])} for pid, r in f["roster"].items()}
        self.state = "loading"
        self.node.changed()
        try:
            fetched = cached = 0
            weights = []
            total = sum(t["nbytes"] for t in f["tensors"])
            self.load = {"progress": "fetching", "done_bytes": 0, "total_bytes": total}
            for t in f["tensors"]:
                data, hit = await self._fetch_verified(file=t["file"], offset=t["offset"], nbytes=t["nbytes"],
                                                       sha256=t["sha256"])
                cached += len(data) if hit else 0
                fetched += 0 if hit else len(data)
                weights.append((t, data))
                self.load["done_bytes"] += len(data)
                self.node.changed()
            tok_dir = None
            if f["head"]:
                tok_dir = self.node.state.path / "models" / f"{self.admitted['model_id']}-{self.session_id}"
                tok_dir.mkdir(parents=True, exist_ok=True)
                for fi in f["files"]:
                    data, _ = await self._fetch_verified(file=fi["name"], offset=0, nbytes=fi["nbytes"], sha256=fi["sha256"])
                    (tok_dir / fi["name"]).write_bytes(data)
            config = self.admitted["config"]

            def build():
                ex = stagehost.executor()
                from kafilad.modelinfo import TensorInfo
                arrays = {}
                for t, data in weights:
                    info = TensorInfo(t["name"], t["file"], t["dtype"], tuple(t["shape"]), t["offset"], t["nbytes"], None)
                    arrays[t["name"]] = ex.stage.tensor_from_bytes(info, data)
                stage = ex.stage.build_stage(config, f["start"], f["end"], f["head"], arrays)
                tok = ex.synth.load_tokenizer(tok_dir) if tok_dir else None
                return stage, tok

            self.load["progress"] = "building the stage"
            self.node.changed()
            async with self.node.mlx_lock:
                stage, tok = await run_on_mlx_thread(build)
            self.load["progress"] = "joining the ring"
            self.node.changed()
            self.ring = stagehost.make_ring_member(self.node, stage=stage, head=f["head"], tokenizer=tok)
            nxt, prv = await stagehost.connect_ring(node=self.node, rdv=self.rdv, session_id=self.session_id,
                                                    ring=self.ring_order, roster=self.roster,
                                                    incoming=self._ring_incoming, member=self.ring,  # [paths]
                                                    on_edges=lambda: self.link.send(  # [paths] upgrades
                                                        {"t": "edges", "edges": stagehost.edges_of(self.node)}))
            stagehost.attach_ring(self.ring, nursery=self.nursery, me=self.node.peer_id, ring_order=self.ring_order,
                                  names={pid: r["name"] for pid, r in self.roster.items()}, next_link=nxt,
                                  prev_link=prv, watch=self._watch_ring)
            self.load = {"fetched_bytes": fetched, "cached_bytes": cached, "load_s": time.perf_counter() - t0,
                         "edges": stagehost.edges_of(self.node)}  # [paths] this member's ring edges
            await self.link.send({"t": "ready", **self.load})
            self.state = "ready"
            self.node.changed()
        except Exception as e:  # any failure to load is reported to the host with its reason
            reason = e.reason if isinstance(e, LinkClosed) else str(e) if isinstance(e, KafilaError) else \
                f"{self.node.name} could not load its stage: {e!r}"
            if not isinstance(e, (KafilaError, LinkClosed)):
                log.exception("loading the stage failed")
            self._fail(reason)
            try:
                await self.link.send({"t": "failed", "reason": reason})
            except LinkClosed:
                pass

    async def _watch_ring(self, ring) -> None:
        await ring.broken_event.wait()
        try:
            await self.link.send({"t": "ring_broken", "reason": ring.broken, "member": ring.broken_member})
        except LinkClosed:  # no host to tell (the rendezvous took the ctl link): fail here
            lost = self._rdv_lost_reason()
            self._fail(ring.broken if lost is None else
                       f"{ring.broken} (the connection to the rendezvous was lost: {str(lost).rstrip('.')})")

    async def _serve_generation(self, f: dict) -> None:
        req = f["req"]

        async def on_event(ev: dict) -> None:
            await self.link.send({"t": "gen_event", "req": req, "event": ev})

        try:
            st = await self.ring.generate(req, f["prompt"], max_tokens=int(f["max_tokens"]),
                                          temperature=float(f.get("temperature", 0.0)), on_event=on_event)
            if st.error:
                await self.link.send({"t": "gen_error", "req": req, "message": st.error})
            else:
                await self.link.send({"t": "gen_done", "req": req, "result": result_of(st)})
        except KafilaError as e:
            await self.link.send({"t": "gen_error", "req": req, "message": str(e)})
        except LinkClosed:
            pass

    def snapshot(self) -> dict:
        p = self.plan or {}
        plan = p.get("plan") or {}
        members = []
        for pid in self.ring_order:
            name = self.roster[pid]["name"]
            members.append({"name": name, "peer_id": pid, "blocks": plan.get("blocks", {}).get(name),
                            "head": plan.get("head") == name,
                            "predicted_stage_s": plan.get("stage_s", {}).get(name), "measured_stage_s": None})
        return {"role": "member", "session_id": self.session_id, "code": self.code, "state": self.state,
                "error": self.error, "host": self.host_name, "members": members,
                "rendezvous": "lost" if self.rendezvous_lost else ("connected" if self.rdv else None),
                "control": "down" if self.rendezvous_lost else ("up" if self.link else None),
                "blocks": [p["start"], p["end"]] if p else None, "head": bool(p.get("head")),
                "capability": self.capability, "load": self.load, "plan": plan or None}

    async def close(self) -> None:
        await self._say_leaving("its user ran `kafila-ctl leave`")
        if self.link is not None:
            await self.link.close("member left the session")
        self.state = "closed"
