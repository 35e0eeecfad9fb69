"""The daemon: one root nursery holding the control server and at most one session (DESIGN §7).

The control handler table (STYLE.md "Daemon and CLI") maps each op of kafilad/control/api.py
to a method here. Sessions run as tasks of the root nursery, started with `nursery.start` so that
errors before they are established reach the `kafila-ctl` command that asked for them.
"""

from __future__ import annotations

import logging
import math
import random
import signal
import time
import uuid
from functools import partial
from typing import Optional

import trio

from kafilad.control.api import OPS
from kafilad.control.server import serve_control
from kafilad.errors import HEAD_UNREACHABLE, KafilaError, RendezvousRefused, collapse_groups
from kafilad.modelref import resolve_model_dir
from kafilad.planner.plan import DEFAULT_STRATEGY
from kafilad.node.session.comeback import session_back as wait_session_back
from kafilad.proto import comeback
# the rejoin backoff lives with the rest of a comeback (REJOIN_* are imported from here by tests)
from kafilad.proto.comeback import (REJOIN_FIRST_S, REJOIN_MAX_S, REJOIN_UNKNOWN_SESSION_TRIES,  # noqa: F401
                                    rejoin_delay_s)
from kafilad.node.session.statedir import StateDir
from kafilad.proto import lifecycle as lc
from kafilad.proto import session as sm
from kafilad.proto.identity import fingerprint, peer_id as peer_id_of
from kafilad.proto.status import MemberStatus, NodeStatus

log = logging.getLogger("kafilad")

DEFAULT_ADMIT_TIMEOUT_S = 120.0
#: how long `kafila-ctl schedule` waits for a member head's answer (one ctl round trip and a decision)
SCHEDULE_ANSWER_S = 10.0


def _strategy(args: dict) -> str:
    """The `host` control argument `strategy`: the planner's division (DESIGN §5.3, §5.5; issue 12).

    Raises:
        KafilaError: not a string, or not one of kafilad.planner.STRATEGIES.
    """
    from kafilad.planner import STRATEGIES
    value = _arg(args, "strategy", str, DEFAULT_STRATEGY)
    if value not in STRATEGIES:
        raise KafilaError(f"Unknown strategy {value!r}; choose one of {', '.join(STRATEGIES)}.")
    return value


def _arg(args: dict, key: str, kind: type, default):
    """A control argument of the given type (bool is not an int here), or its default.

    Raises:
        KafilaError: the argument has another type.
    """
    value = args.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise KafilaError(f"Control argument '{key}' must be {kind.__name__}, not {type(value).__name__}.")
    return value


def _required(args: dict, key: str, kind: type):
    """A control argument that must be present, of the given type.

    Raises:
        KafilaError: it is missing or of another type.
    """
    value = _arg(args, key, kind, None)
    if value is None:
        raise KafilaError(f"Control argument '{key}' is required.")
    return value


#: every state `wait` can wait for (host and member machines, kafilad/proto/session.py), plus idle
#: and the daemon's own while it brings its session back (kafilad/node/session/comeback.py)
WAIT_STATES = sorted({s.value for s in sm.HostState} | {s.value for s in sm.MemberState}
                     | {"idle", comeback.RECONNECTING, comeback.RESTORING})


class Node:
    """One kafilad process.

    Args:
        state: the state directory (key, roster, cache, socket, traces).
        name: this member's display name.
        rendezvous: default rendezvous URL for host/join (overridable per command).
        http: the HTTP API's (host, port), or None for none.
        api_keys: the HTTP API's keys (kafilad/control/auth.py ApiKeys); None: the API is open.
    """

    def __init__(self, state: StateDir, *, name: str, rendezvous: Optional[str],
                 http: Optional[tuple[str, int]] = None, http_listeners: Optional[list] = None, api_keys=None):
        self.state = state.ensure()
        self.name = name
        self.rendezvous = rendezvous
        self.http = http
        #: listeners already open on `http` (kafilad/main.py opened the default address to check it)
        self._http_listeners = http_listeners
        #: the HTTP API's keys (kafilad/control/auth.py ApiKeys; None: none, the API is open)
        self.api_keys = api_keys
        self.http_port: Optional[int] = None
        self.static_private, self.public_key = self.state.load_or_create_static_key()
        self.peer_id = peer_id_of(self.public_key)
        self.session = None
        #: while the rejoin loop runs (`_rejoin`): {"code", "attempt", "at" (time.time() of the next
        #: try), "reason" (why the last try or the session failed)}
        self.rejoining: Optional[dict] = None
        #: member sessions in a row that failed before serving (`_run_session`; comeback.rejoin_first_wait_s)
        self._failed_unready = 0
        #: while a restarted daemon hosts its remembered session again (`_rehost`): {"code", "attempt",
        #: "at" (time.time() of the next try), "reason"}
        self.restoring: Optional[dict] = None
        #: which kind of session this daemon runs, if any (kafilad/proto/lifecycle.py)
        self.lifecycle = lc.Lifecycle()
        self.mlx_lock = trio.Lock()
        self._changed = trio.Event()
        self._session_scope: Optional[trio.CancelScope] = None
        self.handlers = {op: getattr(self, f"op_{op}") for op in OPS}

    def changed(self) -> None:
        """Wake every `watch` stream (state changes are pushed, not polled)."""
        self._changed.set()
        self._changed = trio.Event()

    def _lifecycle(self, event: lc.Event) -> None:
        """Feed the daemon's lifecycle machine; watchers learn of a new phase."""
        self.lifecycle.handle(event)
        if self.lifecycle.changed:
            self.lifecycle.changed = False
            self.changed()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        remembered = self.state.remembered_session()
        if remembered is not None:  # said from the first status on: a request never finds "no session" meanwhile
            comeback_info = comeback.record(str(remembered.get("code") or ""), 1, "this daemon restarted",
                                            now_s=time.time())
            if remembered.get("role") == "host":
                self.restoring = comeback_info
                self._lifecycle(lc.Restore())
            else:
                self.rejoining = comeback_info
                self._lifecycle(lc.Rejoin())
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            await nursery.start(serve_control, self.state.socket_path, self.handlers)
            nursery.start_soon(self._signals, nursery.cancel_scope)
            if self.http is not None:
                from kafilad.control.openai_api import serve_openai_api
                # a port in use or out of range refuses the start with a sentence (KafilaError)
                from kafilad.control.auth import ApiKeys
                self.http_port = await nursery.start(partial(serve_openai_api, self, *self.http,
                                                             keys=self.api_keys or ApiKeys(),
                                                             listeners=self._http_listeners))
            log.info("kafilad %s (peer %s) listening on %s", self.name, self.peer_id, self.state.socket_path)
            if remembered is not None and remembered.get("role") == "host":
                nursery.start_soon(self._rehost, remembered)
            elif remembered is not None:
                nursery.start_soon(self._rejoin)
            task_status.started()

    async def _signals(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
            async for sig in sigs:
                log.info("received signal %s; shutting down", sig)
                self._lifecycle(lc.Stop())
                scope.cancel()
                return

    # ---- sessions ------------------------------------------------------------------------------
    def _rdv(self, args: dict) -> str:
        url = _arg(args, "rendezvous", str, None) or self.rendezvous
        if not url:
            raise KafilaError("No rendezvous given: pass --rendezvous ws://HOST:PORT to this command or to kafilad.")
        return url

    def _ensure_no_session(self, what: str) -> None:
        """Refuse to start a session (``what``: "host", "join") while one runs or the daemon stops.

        Raises:
            KafilaError: a session runs; LocalProtocolError (code shutting_down): the daemon stops.
        """
        self.lifecycle.check_may_start(what)
        if self.session is not None and self.session.state not in ("failed", "closed"):
            raise KafilaError(f"This daemon is already in session {self.session.session_id} "
                              f"(state {self.session.state}); run `kafila-ctl leave` first.")

    async def _run_session(self, session, *, task_status, **kw) -> None:
        """Run a session task; after it is established, no error of it may stop the daemon."""
        started = False

        class _Status:
            def started(self, value=None):
                nonlocal started
                started = True
                task_status.started(value)

        # The handler sits outside the session's cancel scope: once the scope has stripped trio's
        # Cancelled from a group, whatever error is left is caught here and costs only the session.
        try:
            with trio.CancelScope() as scope:
                self._session_scope = scope
                with collapse_groups():
                    await session.run(task_status=_Status(), **kw)
        except Exception as e:
            if not started:
                raise
            log.exception("session %s stopped by an internal error", session.session_id)
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await session._handle(sm.Abort(repr(e)))
        finally:
            if session.state not in ("failed", "closed"):
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    await session._handle(sm.Close("the session ended", final=False))
            self.changed()
        rejoin = started and self._will_rejoin(session)
        if started and self.session is session:
            self._lifecycle(lc.Ended(rejoin=rejoin))
        if rejoin:
            # the host or rendezvous went away: come back by itself, at once after a session that served,
            # with a growing wait after sessions that failed before serving (comeback.rejoin_first_wait_s)
            self._failed_unready = 0 if session.served else self._failed_unready + 1
            wait_s = comeback.rejoin_first_wait_s(self._failed_unready) * random.uniform(0.8, 1.2)
            self.rejoining = comeback.record(session.code, 1, session.error, now_s=time.time(), wait_s=wait_s)
            self.nursery.start_soon(self._rejoin, session.error, wait_s)

    def _will_rejoin(self, session) -> bool:
        """Whether `session` is a member session that failed after its admission, of the session this
        daemon remembers: the daemon rejoins it (`_rejoin`), so its status says `reconnecting`."""
        if getattr(session, "role", None) != "member" or session.state != sm.MemberState.FAILED \
                or self.session is not session or not session.was_admitted:
            return False
        record = self.state.remembered_session()
        return record is not None and record.get("code") == session.code

    async def op_host(self, args: dict, emit) -> dict:
        from kafilad.node.session.host import HostSession
        self._ensure_no_session("host")
        strategy = _strategy(args)
        session = HostSession(self, model_dir=await resolve_model_dir(_required(args, "model_dir", str), self.state.path / "models"), members=_arg(args, "members", int, 1),
                              context=_arg(args, "context", int, None), concurrency=_arg(args, "concurrency", int, 1),
                              rendezvous=self._rdv(args), open_=_arg(args, "open", bool, False),
                              admit_timeout_s=_arg(args, "admit_timeout_s", float, DEFAULT_ADMIT_TIMEOUT_S),
                              queue_limit=_queue_limit(args), strategy=strategy, head_self=_head_self(args),
                              head_any=args.get("head") == "any", draft_model=await self._draft_model(args))
        code = await self.nursery.start(self._run_session, session)
        self.session = session
        self._lifecycle(lc.Hosted())
        self.changed()
        return {"code": code, "session_id": session.session_id}

    async def _draft_model(self, args: dict) -> Optional[str]:
        """`host --draft-model`: the draft model's local directory (resolved like the model), or None.

        Raises:
            KafilaError: not a string, or a reference that resolves to no local model.
        """
        ref = _arg(args, "draft_model", str, None)
        if ref is None:
            return None
        return await resolve_model_dir(ref, self.state.path / "models")

    async def _rehost(self, record: dict) -> None:
        """Host the remembered session again after a restart (issue 8 §4): same session id and code,
        the members' daemons rejoin by themselves. Retries while the rendezvous is unreachable;
        meanwhile ``restoring`` says which attempt comes when, and why (`snapshot`, `_host_session`)."""
        from kafilad.node.session.host import HostSession
        delay_s, attempt, reason = REJOIN_FIRST_S, 0, "this daemon restarted"
        code = str(record.get("code") or "")
        try:
            while self.session is None or self.session.state in ("failed", "closed"):
                attempt += 1
                self.restoring = comeback.record(code, attempt, reason, now_s=time.time())
                self.changed()
                try:
                    session = HostSession(self, model_dir=record["model_dir"], members=int(record["members"]),
                                          context=record.get("context"),
                                          concurrency=int(record.get("concurrency") or 1),
                                          rendezvous=record["rendezvous"], open_=bool(record.get("open")),
                                          admit_timeout_s=float(record.get("admit_timeout_s")
                                                                or DEFAULT_ADMIT_TIMEOUT_S),
                                          strategy=str(record.get("strategy") or DEFAULT_STRATEGY),
                                          head_self=bool(record.get("head_self")),
                                          head_any=bool(record.get("head_any")),
                                          draft_model=record.get("draft_model") or None,
                                          queue_limit=_queue_limit(record))  # none in records before issue 25
                    session.session_id = str(record["session_id"])
                    session.rehosted = True  # requests wait while its members rejoin (host_requests.returning)
                    await self.nursery.start(self._run_session, session)
                    self.session = session
                    self._lifecycle(lc.Hosted())
                    self.changed()
                    log.info("hosting the remembered session %s again", session.code)
                    return
                except (KafilaError, KeyError, TypeError, ValueError) as e:
                    if comeback.rehost_gives_up(e):
                        self.state.forget_session()
                        self._lifecycle(lc.GaveUp())
                        return
                    reason = str(e) if isinstance(e, KafilaError) else f"the remembered session is damaged ({e!r})"
                wait_s = delay_s * random.uniform(0.8, 1.2)
                self.restoring = comeback.record(code, attempt + 1, reason, now_s=time.time(), wait_s=wait_s)
                self.changed()
                log.warning("re-hosting the remembered session failed (%s); retrying in %.1f s", reason, wait_s)
                await trio.sleep(wait_s)
                delay_s = min(delay_s * 2, REJOIN_MAX_S)
        finally:
            self.restoring = None
            self.changed()

    def restoring_sentence(self) -> Optional[str]:
        """While a restarted daemon hosts its remembered session again (`_rehost`) and no other session
        runs: what it is doing, as a sentence (requests and host commands answer with it); else None."""
        info = self.restoring
        if info is None or (self.session is not None and self.session.state not in ("failed", "closed")):
            return None
        return comeback.restoring_sentence(info)

    async def _rejoin(self, reason: Optional[str] = None, first_wait_s: float = 0.0) -> None:
        """Rejoin the remembered session after a restart or after it failed (issue 8 §2): retry with a
        capped, jittered backoff while the host or rendezvous is unreachable; forget it when the host
        refuses. Meanwhile ``rejoining`` says which attempt comes when, and why (`snapshot`).

        Args:
            reason: why the session is being rejoined (the failed session's error), until an attempt fails.
            first_wait_s: seconds to wait before the first attempt (`comeback.rejoin_first_wait_s`).
        """
        delay_s, unknown_tries, attempt = REJOIN_FIRST_S, 0, 0
        try:
            await trio.sleep(first_wait_s)
            while True:
                record = self.state.remembered_session()
                if record is None or (self.session is not None and self.session.state not in ("failed", "closed")):
                    self._lifecycle(lc.GaveUp())  # forgotten (`leave`), or a user's host/join runs: no-op then
                    return
                attempt += 1
                self.rejoining = comeback.record(record["code"], attempt, reason or "this daemon restarted",
                                                 now_s=time.time())
                self.changed()
                log.info("rejoining the remembered session %s (attempt %d)", record["code"], attempt)
                try:
                    await self.op_join({"code": record["code"], "rendezvous": record["rendezvous"]}, _ignore)
                    return
                except KafilaError as e:
                    if comeback.rejoin_gives_up(e):
                        log.warning("not rejoining %s: %s", record["code"], e)
                        self.state.forget_session()
                        self._lifecycle(lc.GaveUp())
                        return
                    wait_s, delay_s, unknown_tries = rejoin_delay_s(e, delay_s, unknown_tries)
                    wait_s *= random.uniform(0.8, 1.2)
                    reason = str(e)
                    if isinstance(e, RendezvousRefused) and e.code == "unknown_session":
                        # the usual race after a rendezvous restart: the host reconnects on its own backoff
                        reason = ("the host has not registered the session at the rendezvous again yet (it "
                                  "reconnects too)")
                    self.rejoining = comeback.record(record["code"], attempt + 1, reason, now_s=time.time(),
                                                     wait_s=wait_s)
                    self.changed()
                    log.warning("rejoining %s failed (%s); retrying in %.1f s", record["code"], reason, wait_s)
                    await trio.sleep(wait_s)
        finally:
            self.rejoining = None
            self.changed()

    async def op_join(self, args: dict, emit) -> dict:
        from kafilad.node.session.member import MemberSession
        self._ensure_no_session("join")
        session = MemberSession(self, code=_required(args, "code", str).strip(), rendezvous=self._rdv(args))
        self.session = session

        async def progress(ev: dict) -> None:
            try:
                await emit(ev)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        try:
            await self.nursery.start(lambda task_status: self._run_session(session, task_status=task_status,
                                                                           progress=progress))
        except BaseException:
            self.changed()  # the machine says `failed` and why (the join's error is the caller's reply)
            raise
        self.state.remember_session({"role": "member", "code": session.code, "rendezvous": session.rdv_url})
        self._lifecycle(lc.Joined())
        self.changed()
        return {"session_id": session.session_id, "host": session.host_name, "state": str(session.state)}

    async def session_back(self, gone: Optional[trio.Event] = None) -> None:
        """Return once this daemon is no longer restoring its remembered session (kafilad/node/session/comeback.py session_back:
        at most host_requests.RECOVERY_WAIT_S, or until `gone` is set); the HTTP API waits on it."""
        await wait_session_back(self, gone)

    async def host_session_back(self, gone: Optional[trio.Event] = None):
        """The hosted session, once a restarted daemon restoring it has it back (kafilad/node/session/comeback.py session_back).

        Raises:
            KafilaError: as `_host_session` (still restoring after the wait: the sentence says so).
        """
        await wait_session_back(self, gone)
        return self._host_session()

    def _host_session(self):
        """The hosted session.

        Raises:
            KafilaError: this daemon is a member, is restoring its session after a restart (the
                sentence says so and what to do), or hosts none.
        """
        from kafilad.node.session.host import HostSession
        if not isinstance(self.session, HostSession):
            s = self.session
            if s is not None and s.state not in ("failed", "closed"):
                raise KafilaError(f"This daemon is a member of session {s.session_id}, hosted by {s.host_name}; "
                                  f"run this command on the host.")
            restoring = self.restoring_sentence()
            if restoring is not None:
                last = self.restoring.get("reason") if self.restoring.get("attempt", 1) > 1 else None
                raise KafilaError(f"{restoring} Try again once it is ready (`kafila-ctl wait` waits for it)."
                                  + (f" The last try failed: {last}" if last else ""))
            raise KafilaError("This daemon is not hosting a session.")
        return self.session

    async def op_pending(self, args: dict, emit) -> list:
        s = self._host_session()
        return [{"peer_id": p.peer_id, "name": p.name, "fingerprint": fingerprint(p.public_key)}
                for p in getattr(s, "pending", {}).values()]

    async def op_admit(self, args: dict, emit) -> dict:
        return self._host_session().decide(_required(args, "peer", str), "admit")

    async def op_deny(self, args: dict, emit) -> dict:
        out = self._host_session().decide(_required(args, "peer", str), "deny", _arg(args, "reason", str, ""))
        self._untrust(out["peer_id"])  # a denied key is never trusted
        return out

    def _untrust(self, peer_id: str) -> bool:
        """Drop `peer_id` from the roster and from the hosted session's own admissions; True if it was there."""
        roster = self.state.load_roster()
        found = roster.pop(peer_id, None) is not None
        if found:
            self.state.save_roster(roster)
        keys = getattr(getattr(self.session, "machine", None), "session_keys", None)
        if isinstance(keys, dict):
            found = keys.pop(peer_id, None) is not None or found
        return found

    async def op_trust_list(self, args: dict, emit) -> list:
        """The trusted keys: the roster (admitted with `kafila-ctl admit`, held across sessions), then
        keys the hosted session admitted for itself only (`host --open`)."""
        roster = self.state.load_roster()
        out = [{"peer_id": pid, "name": r.get("name"), "fingerprint": _fingerprint_hex(r.get("public_key")),
                "scope": "roster"} for pid, r in sorted(roster.items(), key=lambda kv: str(kv[1].get("name")))]
        machine = getattr(self.session, "machine", None)
        for pid, key in sorted(getattr(machine, "session_keys", {}).items()):
            if pid not in roster:
                out.append({"peer_id": pid, "name": machine.name_of(pid), "fingerprint": fingerprint(key),
                            "scope": "this session"})
        return out

    async def op_trust_revoke(self, args: dict, emit) -> dict:
        """Forget a trusted key (by peer id or name): it waits for `kafila-ctl admit` when it joins again.

        Raises:
            KafilaError: no trusted key, or several, match.
        """
        who = _required(args, "peer", str)
        listed = await self.op_trust_list({}, emit)
        matches = {e["peer_id"]: e for e in listed if who in (e["peer_id"], e["name"])}
        if not matches:
            raise KafilaError(f"No trusted key named '{who[:80]}'; `kafila-ctl trust list` lists them.")
        if len(matches) > 1:
            raise KafilaError(f"Several trusted keys are named '{who[:80]}' ({', '.join(sorted(matches))}); "
                              "revoke one by its peer id.")
        (pid, entry), = matches.items()
        self._untrust(pid)
        return {"peer_id": pid, "name": entry["name"], "revoked": True}

    async def op_keys(self, args: dict, emit) -> dict:
        return {"name": self.name, "peer_id": self.peer_id, "fingerprint": fingerprint(self.public_key),
                "public_key": self.public_key.hex()}

    def status(self) -> NodeStatus:
        """This daemon's status and its session's (kafilad/proto/status.py; the session's is built by
        kafilad/node/session/status.py, a comeback's by kafilad/proto/comeback.py)."""
        session = self._reconnecting_status()
        if session is None and self.restoring_sentence() is not None:
            session = comeback.restoring_status(self.restoring, time.time())
        if session is None and self.session is not None:
            session = self.session.status()
        return NodeStatus(name=self.name, peer_id=self.peer_id, fingerprint=fingerprint(self.public_key),
                          lifecycle=self.lifecycle.phase.value, rendezvous=self.rendezvous,
                          http=f"http://{self.http[0]}:{self.http_port}/v1" if self.http_port else None,
                          session=session)

    def snapshot(self) -> dict:
        """The status as its JSON document: `kafila-ctl status --json`, the control socket's
        `status` and `watch` (proto_spec 05 §4)."""
        return self.status().to_json()

    def _reconnecting_status(self) -> Optional[MemberStatus]:
        """The member's status while its daemon rejoins the remembered session (kafilad/node/session/comeback.py);
        None when not rejoining, or while an attempt's join is under way (its own state says where)."""
        s = self.session
        if s is not None and s.state not in ("failed", "closed"):
            return None
        info = self.rejoining
        if info is None:  # the session just failed; the rejoin loop starts at once (`_run_session`)
            if s is None or not self._will_rejoin(s):
                return None
            info = comeback.record(s.code, 1, s.error, now_s=time.time())
        ended = s.status() if s is not None and getattr(s, "code", None) == info["code"] else None
        return comeback.reconnecting_status(info, ended if isinstance(ended, MemberStatus) else None, time.time())

    async def op_status(self, args: dict, emit) -> dict:
        return self.snapshot()

    async def op_wait(self, args: dict, emit) -> dict:
        """Wait until the session state is in args["states"]; error if it fails or times out.

        A member on standby counts as ready (it is in the session and serves its part, none, until
        a replan gives it blocks): `wait` on it returns, saying "standby" (issue 25 item 6)."""
        states = _arg(args, "states", list, ["ready"])
        unknown = [s for s in states if not isinstance(s, str) or s not in WAIT_STATES]
        if unknown:
            raise KafilaError(f"Unknown state {unknown[0]!r} to wait for; the states are {', '.join(WAIT_STATES)}.")
        states = set(states)
        timeout_s = _arg(args, "timeout_s", float, 300.0)
        if timeout_s < 0:
            raise KafilaError(f"--timeout must be 0 or more seconds (got {timeout_s:g}).")
        with trio.move_on_after(timeout_s):
            while True:
                st = self.status()
                if st.state in states or (st.state == sm.MemberState.STANDBY.value and "ready" in states
                                          and st.role == "member"):
                    return st.to_json()
                if st.state == "failed" and "failed" not in states:
                    raise KafilaError(f"The session failed: {str(st.session.error).rstrip('.')}.")
                ev = self._changed
                await ev.wait()
        raise KafilaError(f"Timed out waiting for the session to become {'/'.join(sorted(states))} "
                          f"(state: {self.status().state}).")

    async def op_watch(self, args: dict, emit) -> None:
        while True:
            await emit({"snapshot": self.snapshot()})
            ev = self._changed
            await ev.wait()

    async def op_generate(self, args: dict, emit) -> dict:
        """Generate through the hosted session; the client closing its connection (Ctrl-C) ends the
        request (`emit.client_gone`, kafilad/control/server.py). A restarted daemon restoring its
        session makes the request wait for it (`host_session_back`)."""
        s = await self.host_session_back(getattr(emit, "client_gone", None))
        max_tokens, temperature = _arg(args, "max_tokens", int, 64), _arg(args, "temperature", float, 0.0)
        if max_tokens < 1:
            raise KafilaError(f"--max-tokens must be at least 1 (got {max_tokens}).")
        if not (temperature >= 0.0 and math.isfinite(temperature)):
            raise KafilaError(f"--temperature must be 0 (greedy) or a finite positive number (got {temperature:g}).")
        prompt = _arg(args, "prompt", str, None)
        if args.get("messages") is not None:
            prompt = await s.off_loop(s.chat_prompt, _arg(args, "messages", list, None))  # a worker thread
        if not isinstance(prompt, str) or not prompt:
            raise KafilaError('The prompt is empty; give the text for the model to continue, e.g. '
                              'kafila-ctl generate "Once upon a time".')
        return await s.generate(prompt, max_tokens=max_tokens, temperature=temperature, emit=emit,
                                gone=getattr(emit, "client_gone", None))

    async def op_schedule(self, args: dict, emit) -> dict:
        """Show or set the head's decode schedule (kafilad/node/serving/schedule_settings.py `apply_schedule`),
        on the host or, when a member is the ring's head, on that member through its ctl link. A
        setting lasts for the session, replans included: the plan frame carries it to a head that a
        replan moves to a member (proto_spec 05 §2 `plan`)."""
        from kafilad.node.serving.schedule_settings import apply_schedule, parse_schedule, schedule_result
        s = self._host_session()
        mode, m = args.get("mode"), None
        if mode is not None:  # a bad setting is refused for what it is, wherever the head runs
            try:
                m = parse_schedule(mode)
            except ValueError as e:
                raise KafilaError(str(e)) from None
            if isinstance(m, int) and m > s.concurrency:
                runs = "1 request runs" if s.concurrency == 1 else f"{s.concurrency} requests run"
                give = "1" if s.concurrency == 1 else f"1 to {s.concurrency}"
                raise KafilaError(f"A schedule of {m} micro-batches cannot be filled: at most {runs} at once in "
                                  f"this session (--concurrency); give {give}, auto, lockstep or per-request.")
        if s.ring is None:
            raise KafilaError(f"The session has no ring yet (it is {getattr(s.state, 'value', s.state)}); "
                              "set the schedule once it is ready.")
        sched = s.ring.scheduler
        if sched is None:  # a member is the head: it applies the schedule (proto_spec 05 §2 `schedule`)
            result = await self._schedule_on_member_head(s, None if mode is None else str(mode))
            if mode is not None:
                s.schedule_mode = mode
                self.changed()
            return result
        if mode is not None:
            try:
                apply_schedule(sched, m)
            except ValueError as e:
                raise KafilaError(str(e)) from None
            s.schedule_mode = mode
            self.changed()
        return schedule_result(sched)

    async def _schedule_on_member_head(self, s, mode: Optional[str]) -> dict:
        """Ask the member that heads the ring to show or set its decode schedule (`schedule` /
        `schedule_state` on its ctl link, proto_spec 05 §2); its answer within SCHEDULE_ANSWER_S.

        Raises:
            KafilaError: no head member reachable, no answer in time, or the head's refusal (a sentence).
        """
        from kafilad.proto import control as cf
        order = list(s.ring_order)
        link = s.links.get(order[0]) if order else None
        head = s.members[order[0]].name if order and order[0] in s.members else "not chosen yet"
        if link is None or link.closed_reason is not None:
            raise KafilaError(f"The ring's head ({head}) cannot be reached now; set the schedule once the "
                              "session is ready.", code=HEAD_UNREACHABLE)
        req = f"schedule-{uuid.uuid4().hex[:12]}"
        send, recv = trio.open_memory_channel(1)
        s.generations[req] = send  # the host's ctl reader routes the answer by `req`
        try:
            await link.send(cf.Schedule(req=req, mode=mode).to_wire())
            with trio.move_on_after(SCHEDULE_ANSWER_S):
                answer = await recv.receive()
                if answer.error is not None:
                    raise KafilaError(answer.error)
                return dict(answer.result or {})
            raise KafilaError(f"The ring's head ({head}) did not answer the schedule within "
                              f"{SCHEDULE_ANSWER_S:.0f} s; try again.")
        finally:
            s.generations.pop(req, None)

    async def op_speculate(self, args: dict, emit) -> dict:
        """Show or set the head's speculative decoding (kafilad/node/serving/drafts.py): "auto", "off" or
        "k=N"; it applies to requests that start afterwards and lasts for the session, replans
        included. The host must be the ring's head."""
        from kafilad.node.serving.drafts import SPECULATE_ENV, speculation_setting
        s = self._host_session()
        mode, setting = args.get("mode"), None
        if mode is not None:
            try:
                setting = speculation_setting({SPECULATE_ENV: str(mode)})
            except ValueError as e:
                raise KafilaError(str(e).replace(f"{SPECULATE_ENV} must", "The speculation mode must")) from None
        drafter = getattr(s.ring, "drafter", None) if s.ring is not None else None
        if drafter is None:
            raise KafilaError("This host is not running the ring's head now; set KAFILA_SPECULATE in the head "
                              "daemon's environment instead.")
        if mode is not None:
            drafter.setting = setting
            s.speculate_setting = ("set", setting)
            self.changed()
        return drafter.status()

    async def op_trace(self, args: dict, emit) -> list:
        """The session trace (DESIGN §8), which only the host writes.

        Raises:
            KafilaError: no session, or this daemon is a member (the sentence says where the trace is).
        """
        from kafilad.node.session.trace import Trace
        if self.session is None or not self.session.session_id:
            raise KafilaError("This daemon has no session, so there is no trace.")
        if getattr(self.session, "role", None) == "member":
            host = getattr(self.session, "host_name", None)
            if not host or host == "?":
                host = f"the host with key fingerprint {getattr(self.session, 'host_fingerprint', '?')}"
            raise KafilaError(f"This daemon is a member of session {self.session.session_id} hosted by {host}; "
                              "the session trace is on the host: run `kafila-ctl trace` there.")
        return Trace(self.state.trace_path(self.session.session_id)).read()

    async def op_leave(self, args: dict, emit) -> dict:
        if self.session is None:
            raise KafilaError("This daemon is not in a session.")
        sid = self.session.session_id
        self.state.forget_session()
        await self.session.close()
        if self._session_scope is not None:
            self._session_scope.cancel()
        self.session = None
        self._lifecycle(lc.Left())
        self.changed()
        return {"left": sid}

    async def op_stop(self, args: dict, emit) -> dict:
        async def stop_after_reply() -> None:
            await trio.sleep(0.2)
            self.nursery.cancel_scope.cancel()
        self._lifecycle(lc.Stop())
        self.nursery.start_soon(stop_after_reply)
        return {"stopping": True}


def _head_self(args: dict) -> bool:
    """`host --head`: "self" pins the head on the host; "auto" (or absent) lets the planner choose among
    the host and the members whose reports measurement confirmed; "any" trusts the members' reports
    (issue 22 item 5; docs/planner.md "Who may be the head").

    Raises:
        KafilaError: another value.
    """
    head = args.get("head", "auto")
    if head not in ("auto", "self", "any"):
        raise KafilaError(f"'head' must be \"auto\", \"self\" or \"any\" (got {str(head)[:20]!r}).")
    return head == "self"


def _queue_limit(args: dict) -> Optional[int]:
    """The `queue` argument of `host` (requests that may wait for a turn), or None for the default.

    Raises:
        KafilaError: a negative number.
    """
    queue = _arg(args, "queue", int, None)
    if queue is not None and queue < 0:
        raise KafilaError(f"--queue must be 0 or more requests (got {queue}).")
    return queue


def _fingerprint_hex(public_key_hex) -> Optional[str]:
    try:
        return fingerprint(bytes.fromhex(str(public_key_hex)))
    except ValueError:
        return None


async def _ignore(_event: dict) -> None:
    """An `emit` for joins nobody watches (the rejoin after a restart)."""
