"""The rendezvous server's sans-IO state machine (proto_spec/03-rendezvous.md).

The wire format (message kinds, control maps, relay data, relay records) is
kafilad/proto/rendezvous_wire.py; its names are re-exported here.

`RendezvousState` is the whole server logic (sessions, members, circuits, limits) with no I/O:
the driver feeds it `receive_message(conn, data, now)` and executes the actions it drains from
`actions()` (h11 / aioquic style, STYLE.md). Nothing here imports trio or sockets.

Sessions are held under the whole session code, `<session id>-<host key fingerprint>` (§2.2): a
`join` must carry the fingerprint, so the 8-character id alone finds nothing, learns nothing and
holds no slot, and a session of another host key under the same id is another session.

Identity (proto_spec §2.4): every connection is sent a `challenge` on connect, and `register` /
`join` are admitted only with proof of the static key behind the claimed peer id
(`kafilad.proto.rendezvous_proof`). A proven peer that joins again while an older connection of
the same key is still a member replaces it (the older one gets a fatal `superseded`).
"""

from __future__ import annotations

import base64
import os
from typing import Any, Callable, Sequence

import attrs
import msgpack

from kafilad.errors import RemoteProtocolError
from kafilad.proto.identity import fingerprint
from kafilad.proto.noise import MAX_MESSAGE_BYTES as NOISE_MAX_MESSAGE_BYTES
from kafilad.proto.rendezvous_proof import NONCE_BYTES, Challenge, check_proof, public_key
from kafilad.proto.rendezvous_wire import (  # noqa: F401 - re-exported: the wire format
    CLOSE_MESSAGE_TOO_BIG, CLOSE_POLICY_VIOLATION, CLOSE_SUPERSEDED, KIND_CONTROL, KIND_RELAY, RECORD_HEADER,
    RELAY_HEADER, SIGNAL_RECORD_CIRCUIT, ControlMessage, RelayData, check_fields, decode_message, encode_control,
    encode_relay, encode_relay_record, parse_relay_record, close_clause,
)

# Requests a client may send and their required fields (proto_spec §2.1), as data (h11 style).
_REQUESTS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "register": {"model_id": str, "members": int, "capability": dict, "peer_id": str, "name": str},
    "join": {"session_id": str, "peer_id": str, "name": str},
    "leave": {},
    "signal": {"to": str},
    "circuit_open": {"to": str, "label": str, "req": int},
    "circuit_close": {"circuit": int, "reason": str},
}


@attrs.frozen
class RendezvousLimits:
    """Server limits (proto_spec §1, §5); defaults are generous, tests shrink them."""

    max_control_bytes: int = 65_536
    max_relay_payload_bytes: int = NOISE_MAX_MESSAGE_BYTES + 1_024
    ws_max_message_bytes: int = 131_072
    session_budget_bytes: int = 64 << 30
    session_rate_Bps: float = float(128 << 20)
    session_burst_bytes: float = float(16 << 20)
    control_rate_per_s: float = 500.0
    control_burst: float = 500.0
    max_members: int = 64
    max_circuits: int = 1_024
    max_sessions: int = 10_000
    # per source address and per key (issue 22 item 2: one client must not fill the rendezvous for
    # everyone else); sized for a 2-core VM serving many groups, each from its own addresses
    max_connections_per_source: int = 64
    max_sessions_per_source: int = 16
    max_sessions_per_key: int = 4
    max_circuits_per_source: int = 256
    joins_per_source_per_s: float = 5.0
    joins_burst_per_source: float = 30.0
    relay_rate_per_source_Bps: float = float(64 << 20)
    relay_burst_per_source_bytes: float = float(8 << 20)


class TokenBucket:
    """Token bucket that lends: `consume` always succeeds and returns how long to pause (s).

    Tokens refill at `rate_per_s` up to `burst`; a debt is repaid before more traffic passes,
    so the long-run rate never exceeds `rate_per_s` (proto_spec §5).
    """

    def __init__(self, rate_per_s: float, burst: float, now: float):
        self.rate_per_s, self.burst = rate_per_s, burst
        self._tokens, self._t = burst, now

    def consume(self, amount: float, now: float) -> float:
        """Take `amount` tokens at time `now` (s); return the pause in seconds (0 if none)."""
        self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate_per_s)
        self._t = now
        self._tokens -= amount
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate_per_s


@attrs.frozen
class SendTo:
    """Action: send `data` (one binary WebSocket message) on connection `conn`."""

    conn: int
    data: bytes


@attrs.frozen
class CloseConn:
    """Action: close connection `conn` with WebSocket close `code` and `reason`."""

    conn: int
    code: int
    reason: str


@attrs.frozen
class RecordPayload:
    """Action: append a forwarded payload to the relay record (proto_spec §7)."""

    circuit_id: int
    payload: bytes


Action = SendTo | CloseConn | RecordPayload


@attrs.define
class _Source:
    """What one source address holds and spends (§5): its connections, the sessions its connections
    host, its open circuits, and its join and relay rates."""

    joins: TokenBucket
    relay: TokenBucket
    connections: int = 0
    sessions: int = 0
    circuits: int = 0


@attrs.define
class _Conn:
    bucket: TokenBucket
    server_private: bytes  # per-connection X25519 ephemeral key of the challenge (§2.4)
    challenge: Challenge
    static_public: bytes = b""  # proven by register / join
    session_id: str | None = None  # the key of its session (`_Session.key`)
    peer_id: str = ""
    name: str = ""
    source: str | None = None  # its address (None: not counted per source)


@attrs.define
class _Session:
    session_id: str
    model_id: str
    expected: int
    capability: dict
    host_conn: int
    members: dict[str, int]  # peer id -> conn, host first (insertion order)
    bucket: TokenBucket
    relayed_bytes: int = 0
    circuits: set[int] = attrs.Factory(set)
    #: "<session id>-<host key fingerprint>": the whole session code, under which the server holds it (§2.2)
    key: str = ""


@attrs.define
class _Circuit:
    session_id: str  # the session's key
    ends: tuple[int, int]  # (opener conn, acceptor conn)


class _Refusal(Exception):
    """A non-fatal error reply (proto_spec §2.3)."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


class RendezvousState:
    """All rendezvous server logic, sans-IO (proto_spec §2-§5; DESIGN §2, §3 steps 1-2, §4 "Relay").

    Connections are opaque ints chosen by the driver. After each call, drain `actions()` and
    execute them in order (SendTo, CloseConn, RecordPayload).

    Args:
        limits: the server's limits.
        random_bytes: source of randomness (n -> n bytes) for session and circuit ids.
    """

    def __init__(self, limits: RendezvousLimits | None = None,
                 random_bytes: Callable[[int], bytes] = os.urandom,
                 stun_addresses: Sequence[tuple[str, int]] = ()):
        self.limits = limits or RendezvousLimits()
        # [paths] STUN addresses advertised in `registered` / `joined` (proto_spec 07 §1), "ip:port".
        self.stun = [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in stun_addresses]
        self._random = random_bytes
        self._conns: dict[int, _Conn] = {}
        self._sessions: dict[str, _Session] = {}
        self._circuits: dict[int, _Circuit] = {}
        self._sources: dict[str, _Source] = {}
        self._actions: list[Action] = []
        self._now = 0.0

    # --- driver interface -------------------------------------------------------------------

    def actions(self) -> list[Action]:
        """Return and forget the actions queued so far, in the order they must run."""
        out, self._actions = self._actions, []
        return out

    @property
    def session_count(self) -> int:
        """Number of live sessions."""
        return len(self._sessions)

    def connection_made(self, conn: int, now: float, source: str | None = None) -> None:
        """Register a new WebSocket connection `conn` at time `now` (s) from address `source` (None:
        not limited per source). A source past `max_connections_per_source` is sent a fatal
        `too_many_connections` and closed (§5)."""
        lim = self.limits
        server_private = self._random(32)
        challenge = Challenge(public_key(server_private), self._random(NONCE_BYTES))
        self._conns[conn] = _Conn(TokenBucket(lim.control_rate_per_s, lim.control_burst, now),
                                  server_private, challenge, source=source)
        if source is not None:
            src = self._sources.get(source)
            if src is None:
                src = self._sources[source] = _Source(
                    TokenBucket(lim.joins_per_source_per_s, lim.joins_burst_per_source, now),
                    TokenBucket(lim.relay_rate_per_source_Bps, lim.relay_burst_per_source_bytes, now))
            src.connections += 1
            if src.connections > lim.max_connections_per_source:
                self._fatal(conn, "too_many_connections",
                            f"Address {source} already has {lim.max_connections_per_source} connections open at "
                            "this rendezvous, its limit; close some and try again.", CLOSE_POLICY_VIOLATION, None)
                return
        self._send(conn, t="challenge", server_public=challenge.server_public, nonce=challenge.nonce)

    def _source(self, conn: int) -> _Source | None:
        source = self._conns[conn].source
        return self._sources.get(source) if source is not None else None

    def knows(self, conn: int) -> bool:
        """True while `conn` is open as far as the protocol is concerned (False once closed or lost)."""
        return conn in self._conns

    def connection_lost(self, conn: int, reason: str) -> None:
        """Forget `conn`: close its circuits and tell its session (proto_spec §4). Idempotent."""
        if conn in self._conns:
            self._leave(conn, reason)
            src = self._source(conn)
            if src is not None:
                src.connections -= 1
                if src.connections <= 0 and src.sessions <= 0 and src.circuits <= 0:
                    del self._sources[self._conns[conn].source]
            del self._conns[conn]

    def receive_message(self, conn: int, data: bytes | str, now: float) -> float:
        """Handle one WebSocket message from `conn` at time `now` (s).

        Returns:
            seconds the driver should wait before reading `conn` again (rate limits, §5).
        """
        if conn not in self._conns:
            return 0.0
        self._now = now
        try:
            msg = decode_message(data)  # text raises too
        except RemoteProtocolError as exc:
            self._fatal(conn, "malformed", str(exc), CLOSE_POLICY_VIOLATION, None)
            return 0.0
        if isinstance(msg, RelayData):
            return self._relay(conn, msg, now)
        req = msg.fields.get("req")
        req = req if isinstance(req, int) and not isinstance(req, bool) else None
        pause_s = self._conns[conn].bucket.consume(1, now)
        if len(data) > self.limits.max_control_bytes:
            self._fatal(conn, "message_too_large",
                        f"A control message of {len(data)} bytes exceeds the limit of "
                        f"{self.limits.max_control_bytes} bytes.", CLOSE_MESSAGE_TOO_BIG, req)
            return 0.0
        schema = _REQUESTS.get(msg.type)
        try:
            if schema is None:
                raise _Refusal("unknown_type", f"The rendezvous does not know message type {msg.type!r}.")
            check_fields(msg, schema)
            getattr(self, "_on_" + msg.type)(conn, msg.fields)
        except RemoteProtocolError as exc:
            self._fatal(conn, "malformed", str(exc), CLOSE_POLICY_VIOLATION, req)
        except _Refusal as refusal:
            self._send(conn, t="error", code=refusal.code, reason=refusal.reason, fatal=False,
                       **({"req": req} if req is not None else {}))
        return pause_s

    # --- helpers ------------------------------------------------------------------------------

    def _send(self, conn: int, **msg: Any) -> None:
        self._actions.append(SendTo(conn, encode_control(msg)))

    def _fatal(self, conn: int, code: str, reason: str, close_code: int, req: int | None) -> None:
        extra = {"req": req} if req is not None else {}
        self._send(conn, t="error", code=code, reason=reason, fatal=True, **extra)
        self._actions.append(CloseConn(conn, close_code, reason[:120]))
        self.connection_lost(conn, f"it sent a bad message: {reason}")

    def _session_of(self, conn: int) -> _Session:
        sid = self._conns[conn].session_id
        if sid is None:
            raise _Refusal("not_in_session", "Register or join a session first.")
        return self._sessions[sid]

    def _new_id(self, nbytes: int, taken: Any) -> Any:
        while True:
            raw = self._random(nbytes)
            new = base64.b32encode(raw).decode().lower() if nbytes == 5 else int.from_bytes(raw, "big")
            if new and new not in taken:
                return new

    def _close_circuit(self, circuit_id: int, reason: str, notify: tuple[int, ...]) -> None:
        circuit = self._circuits.pop(circuit_id, None)
        if circuit is None:
            return
        self._sessions[circuit.session_id].circuits.discard(circuit_id)
        opener = self._conns.get(circuit.ends[0])
        src = self._sources.get(opener.source) if opener is not None and opener.source is not None else None
        if src is not None:
            src.circuits -= 1
        for conn in notify:
            self._send(conn, t="circuit_closed", circuit=circuit_id, reason=reason)

    def _leave(self, conn: int, reason: str) -> None:
        """Unbind `conn` from its session (proto_spec §4)."""
        state = self._conns[conn]
        if state.session_id is None:
            return
        session = self._sessions[state.session_id]
        state.session_id = None
        if conn == session.host_conn:
            for cid in list(session.circuits):
                survivors = tuple(c for c in self._circuits[cid].ends if c != conn)
                self._close_circuit(cid, f"The session host left: {reason}", survivors)
            for peer, member in session.members.items():
                if member != conn:
                    self._conns[member].session_id = None
                    self._send(member, t="session_closed", session_id=session.session_id,
                               reason=f"The host {state.name!r} left the session: {reason}")
            del self._sessions[session.key]
            src = self._source(conn)
            if src is not None:
                src.sessions -= 1
            return
        for cid in list(session.circuits):
            ends = self._circuits[cid].ends
            if conn in ends:
                survivor = tuple(c for c in ends if c != conn)
                self._close_circuit(cid, f"Peer {state.name!r} left the session: {reason}", survivor)
        del session.members[state.peer_id]
        for member in session.members.values():
            self._send(member, t="member_left", peer_id=state.peer_id, reason=reason)

    def _prove(self, conn: int, request_type: str, f: dict) -> bytes:
        """Check the request's proof of its static key (proto_spec §2.4); return the proven key.

        Raises:
            _Refusal: `proof_required`, `peer_id_mismatch` or `bad_proof`.
        """
        state = self._conns[conn]
        sid = f.get("session_id") if request_type == "join" or isinstance(f.get("session_id"), str) else ""
        problem = check_proof(state.server_private, state.challenge, f["peer_id"], f.get("static_public"),
                              f.get("proof"), request_type, sid or "", f["name"])
        if problem is not None:
            raise _Refusal(*problem)
        return f["static_public"]

    def _supersede(self, old: int, session: _Session) -> None:
        """A newer proven connection of the same key replaces member connection `old` (§2.4)."""
        state = self._conns[old]
        reason = (f"Peer {state.peer_id!r} joined session {session.session_id!r} again from a newer "
                  "connection, which replaces this one.")
        self._send(old, t="error", code="superseded", reason=reason, fatal=True)
        self._actions.append(CloseConn(old, CLOSE_SUPERSEDED, reason[:120]))
        self.connection_lost(old, "it rejoined from a new connection")

    # --- requests (proto_spec §2.1) -----------------------------------------------------------

    def _on_register(self, conn: int, f: dict) -> None:
        lim, state = self.limits, self._conns[conn]
        if state.session_id is not None:
            raise _Refusal("already_in_session", "This connection is already in a session; leave it first.")
        if not 1 <= f["members"] <= lim.max_members:
            raise _Refusal("invalid_request",
                           f"A session has 1 to {lim.max_members} members; {f['members']} were asked for.")
        if len(self._sessions) >= lim.max_sessions:
            raise _Refusal("too_many_sessions", "The rendezvous is full; try again later.")
        src = self._source(conn)
        if src is not None and src.sessions >= lim.max_sessions_per_source:
            raise _Refusal("too_many_sessions",
                           f"Address {state.source} already hosts {lim.max_sessions_per_source} sessions at this "
                           "rendezvous, its limit; end one first.")
        state.static_public = self._prove(conn, "register", f)
        held = sum(1 for sess in self._sessions.values() if self._conns[sess.host_conn].static_public ==
                   state.static_public and not (f.get("session_id") and sess.session_id == f.get("session_id")))
        if held >= lim.max_sessions_per_key:
            raise _Refusal("too_many_sessions",
                           f"This host key already hosts {lim.max_sessions_per_key} sessions at this rendezvous, its "
                           "limit; end one first.")
        sid = self._reregistered_id(conn, f, state.static_public)
        if sid is None:
            sid = self._new_id(5, {s.session_id for s in self._sessions.values()})
        key = f"{sid}-{fingerprint(state.static_public)}"
        self._sessions[key] = _Session(
            sid, f["model_id"], f["members"], f["capability"], conn, {f["peer_id"]: conn},
            TokenBucket(lim.session_rate_Bps, lim.session_burst_bytes, self._now), key=key)
        state.session_id, state.peer_id, state.name = key, f["peer_id"], f["name"]
        if src is not None:
            src.sessions += 1
        self._send(conn, t="registered", session_id=sid, **({"stun": self.stun} if self.stun else {}), **_req(f))

    def _reregistered_id(self, conn: int, f: dict, static_public: bytes) -> "str | None":
        """The session id a `register` re-creates (§2.5), or None for a new session.

        A host that lost its connection (or whose rendezvous restarted) registers again with its
        session's id, proven with the same key. Sessions are held under the id *and* the host key's
        fingerprint (§2.2), so a session of another key under the same id (an outsider who saw the
        id and registered it first) is another session: it takes nothing from this one. A
        connection of this same key still holding it is superseded, as a member's rejoin is.

        Raises:
            _Refusal: `invalid_request` (not an id of the §2.2 form).
        """
        sid = f.get("session_id")
        if sid is None:
            return None
        if not isinstance(sid, str) or len(sid) != 8 or not all(c in "abcdefghijklmnopqrstuvwxyz234567" for c in sid):
            raise _Refusal("invalid_request", "A re-registered session id is 8 characters of lowercase base32.")
        old = self._sessions.get(f"{sid}-{fingerprint(static_public)}")
        if old is not None:
            holder = self._conns.get(old.host_conn)
            if holder is None or holder.static_public != static_public:  # a fingerprint collision (80 bits)
                raise _Refusal("duplicate_peer", f"Session {sid!r} is held by another host key.")
            reason = f"The host of session {sid!r} registered it again from a newer connection."
            self._send(old.host_conn, t="error", code="superseded", reason=reason, fatal=True)
            self._actions.append(CloseConn(old.host_conn, CLOSE_SUPERSEDED, reason[:120]))
            self.connection_lost(old.host_conn, "the host reconnected")
        return sid

    def _on_join(self, conn: int, f: dict) -> None:
        state = self._conns[conn]
        if state.session_id is not None:
            raise _Refusal("already_in_session", "This connection is already in a session; leave it first.")
        src = self._source(conn)
        if src is not None and src.joins.consume(1, self._now) > 0:
            raise _Refusal("rate_limited",
                           f"Address {state.source} is joining faster than {self.limits.joins_per_source_per_s:g} a "
                           "second; wait a moment and try again.")
        static_public = self._prove(conn, "join", f)
        fp = f.get("host_fingerprint")
        if not isinstance(fp, str):
            raise _Refusal("fingerprint_required",
                           "A 'join' must carry 'host_fingerprint', the part of the session code after its '-' "
                           "(this rendezvous admits only holders of the whole code); upgrade kafilad.")
        # the session id alone finds nothing: a wrong fingerprint reads exactly as no session (§2.2)
        session = self._sessions.get(f"{f['session_id'].lower()}-{fp.lower()}")
        if session is None:
            raise _Refusal("unknown_session",
                           f"No session {f['session_id']!r} is open at this rendezvous; check the code "
                           "and that the host is still running.")
        old = session.members.get(f["peer_id"])
        if old == session.host_conn:
            raise _Refusal("duplicate_peer",
                           f"Peer {f['peer_id']!r} is the host of session {session.session_id!r}; a host "
                           "cannot also join its own session.")
        if old is not None and self._conns[old].static_public != static_public:
            raise _Refusal("duplicate_peer",
                           f"Peer {f['peer_id']!r} is already a member of session {session.session_id!r} "
                           "with a different static key.")
        if old is not None:
            self._supersede(old, session)
        if len(session.members) >= session.expected:
            raise _Refusal("session_full",
                           f"Session {session.session_id!r} already has all {session.expected} members.")
        roster = [{"peer_id": p, "name": self._conns[c].name} for p, c in session.members.items()]
        for member in session.members.values():
            self._send(member, t="member_joined", peer_id=f["peer_id"], name=f["name"])
        session.members[f["peer_id"]] = conn
        state.session_id, state.peer_id, state.name = session.key, f["peer_id"], f["name"]
        state.static_public = static_public
        host_peer = self._conns[session.host_conn].peer_id
        self._send(conn, t="joined", session_id=session.session_id, host_peer_id=host_peer,
                   members=roster + [{"peer_id": f["peer_id"], "name": f["name"]}],
                   model_id=session.model_id, **({"stun": self.stun} if self.stun else {}), **_req(f))

    def _on_leave(self, conn: int, f: dict) -> None:
        self._session_of(conn)
        reason = f.get("reason")
        self._leave(conn, reason if isinstance(reason, str) else "it left")

    def _peer(self, session: _Session, peer_id: str) -> int:
        target = session.members.get(peer_id)
        if target is None:
            raise _Refusal("unknown_peer",
                           f"Peer {peer_id!r} is not a member of session {session.session_id!r}.")
        return target

    def _on_signal(self, conn: int, f: dict) -> None:
        target = self._peer(self._session_of(conn), f["to"])
        body = f["body"]
        self._actions.append(RecordPayload(SIGNAL_RECORD_CIRCUIT, msgpack.packb(body, use_bin_type=True)))
        self._send(target, t="signal", **{"from": self._conns[conn].peer_id}, body=body)

    def _on_circuit_open(self, conn: int, f: dict) -> None:
        session = self._session_of(conn)
        target = self._peer(session, f["to"])
        if target == conn:
            raise _Refusal("invalid_request", "A circuit must join two different members.")
        if len(session.circuits) >= self.limits.max_circuits:
            raise _Refusal("too_many_circuits",
                           f"Session {session.session_id!r} already has {self.limits.max_circuits} circuits.")
        src = self._source(conn)
        if src is not None and src.circuits >= self.limits.max_circuits_per_source:
            raise _Refusal("too_many_circuits",
                           f"Address {self._conns[conn].source} already has {self.limits.max_circuits_per_source} "
                           "circuits open at this rendezvous, its limit.")
        if src is not None:
            src.circuits += 1
        cid = self._new_id(8, self._circuits)
        self._circuits[cid] = _Circuit(session.key, (conn, target))
        session.circuits.add(cid)
        self._send(target, t="circuit_incoming", circuit=cid, **{"from": self._conns[conn].peer_id},
                   label=f["label"])
        self._send(conn, t="circuit_opened", req=f["req"], circuit=cid, to=f["to"])

    def _on_circuit_close(self, conn: int, f: dict) -> None:
        circuit = self._circuits.get(f["circuit"])
        if circuit is not None and conn in circuit.ends:
            other = tuple(c for c in circuit.ends if c != conn)
            self._close_circuit(f["circuit"], f["reason"], other)

    # --- relay (proto_spec §3, §5) ------------------------------------------------------------

    def _relay(self, conn: int, msg: RelayData, now: float) -> float:
        lim = self.limits
        if len(msg.payload) > lim.max_relay_payload_bytes:
            self._fatal(conn, "message_too_large",
                        f"A relay payload of {len(msg.payload)} bytes exceeds the limit of "
                        f"{lim.max_relay_payload_bytes} bytes (one Noise message plus overhead).",
                        CLOSE_MESSAGE_TOO_BIG, None)
            return 0.0
        circuit = self._circuits.get(msg.circuit_id)
        if circuit is None or conn not in circuit.ends:
            self._send(conn, t="circuit_closed", circuit=msg.circuit_id,
                       reason="No such circuit is open for this connection; the data was dropped.")
            return 0.0
        session = self._sessions[circuit.session_id]
        if session.relayed_bytes + len(msg.payload) > lim.session_budget_bytes:
            reason = (f"Session {session.session_id!r} has used its relay budget of "
                      f"{lim.session_budget_bytes} bytes; the circuit is closed.")
            self._send(conn, t="error", code="budget_exhausted", reason=reason, fatal=False)
            self._close_circuit(msg.circuit_id, reason, circuit.ends)
            return 0.0
        session.relayed_bytes += len(msg.payload)
        other = circuit.ends[1] if circuit.ends[0] == conn else circuit.ends[0]
        self._actions.append(RecordPayload(msg.circuit_id, msg.payload))
        self._actions.append(SendTo(other, encode_relay(msg.circuit_id, msg.payload)))
        pause_s = session.bucket.consume(len(msg.payload), now)
        src = self._source(conn)
        if src is not None:  # the sender's address pays too: many sessions of one client share its rate
            pause_s = max(pause_s, src.relay.consume(len(msg.payload), now))
        return pause_s


def _req(fields: dict) -> dict:
    req = fields.get("req")
    return {"req": req} if isinstance(req, int) and not isinstance(req, bool) else {}
