"""A small hardened HTTP/1.1 server: h11 (the sans-IO machine) and its trio driver (DESIGN §7).

It serves the host's OpenAI-compatible API (kafilad/control/openai_api.py) and is written so that
nothing a client sends can stop the daemon (issue 9). Why not hypercorn: measured on this
machine, hypercorn's trio worker keeps up (3,100 small GETs/s, 28,700 SSE events/s, against
9,200 and 33,600 here), but its public API has no connection limit, no hook on its accept loop and
no lingering close, so 2,100 idle connections still ran the process out of file handles for 5 s
and a 413 before an 8 MB body reached the client as a reset; it also brings HTTP/2 (h2c upgrade,
prior knowledge) and WebSocket surfaces this API does not need.

One connection goes through these phases (RFC 9112; statuses of RFC 9110 §15):

```
phase     from                           until               on timeout                        limit
idle      connect / end of a response    first byte          close quietly (keep-alive ends)   idle_timeout_s
head      first byte of a request        end of its headers  408, close                        header_timeout_s
body      end of the headers             end of the body     408, close                        body_timeout_s
handler   end of the body                end of the answer   (a write stalled) close           send_timeout_s per write
```
Limits, each answered with a sentence in `{"error": {"message", "type"}}`:
- headers over `max_header_bytes`: 431; malformed framing: 400 (h11's hint), then close; a body
  framed by both Content-Length and Transfer-Encoding: 400 at once (RFC 9112 §6.1); an HTTP
  version other than 1.0 and 1.1: 505.
- a body over `max_body_bytes`: 413 (from Content-Length before any of it is read, or as it
  arrives when chunked). Body memory is reserved from `max_total_body_bytes` as bytes arrive, never
  as declared (a Content-Length a client never sends holds nothing); when the bytes that did
  arrive fill it, slow bodies are evicted to make room, and past that the answer is 413 with
  `Retry-After` (RFC 9110 §15.5.14: a temporary condition).
- a body is *slow* once it is `body_grace_s` old and has not kept up with `min_body_rate_Bps`
  (capped at its Content-Length), or has sent nothing for `body_grace_s`. Its connection is closed
  like one idle or in its headers when another client needs the room, after a 408 with
  `Retry-After` saying why (issue 22 §4: 16 clients declaring 4 MiB and sending 1 byte used to hold
  every POST at 413 for 30 s).
- more than `max_connections` open connections, or `max_connections_per_address` from one peer
  address: that address's (or the server's) connection longest idle or in its headers is closed to
  make room, else its slowest body (so idle and trickling connections cannot lock normal clients
  out); when every such connection is in a request, the new one gets 503 with `Retry-After` and a
  sentence, then a lingering close, never a reset. At most MAX_REFUSING are refused at a time; past
  that the server stops accepting until one ends, so newcomers wait in the kernel's listen queue
  instead of being reset (300 trickling connections used to get every new one reset).
After an answer that leaves part of a request unread, the server shuts down its sending side and
discards what the client still sends for up to `linger_s` (RFC 9112 §9.6 "lingering close"), so
the client reads the answer instead of a connection reset.

While the handler runs, the driver watches the connection: the client closing it cancels the
handler (a client gone is a request gone), or, for a handler that must not be interrupted
mid-await, sets `Responder.client_gone` for it to end its work at a safe point. Every connection runs inside a guard: an error in a
handler or in the driver ends that connection (500 when nothing was answered yet) and is logged;
it never reaches the caller's nursery.
"""

from __future__ import annotations

import errno
import itertools
from http import HTTPStatus
import json
import logging
import math
import re
import sys
from typing import Awaitable, Callable, Optional

import attrs
import h11
import trio

from kafilad.errors import only_cancelled

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger("kafilad.http")

RECEIVE_BYTES = 65_536
#: connections answered 503 at once (each holds a file handle for at most 1 s + REFUSAL_LINGER_S);
#: past that the accept loop waits, so newcomers queue in the kernel instead of being reset
MAX_REFUSING = 128
#: after a 503 refusal (or a 408 to a body closed to make room) the server reads what the client
#: still sends (a short lingering close: the request the client had sent is read, so closing sends
#: FIN, not a reset) until the client closes, sends nothing for REFUSAL_QUIET_S, or
#: REFUSAL_LINGER_S have passed
REFUSAL_LINGER_S = 1.0
REFUSAL_QUIET_S = 0.2
#: the answer to a request the daemon had not answered when it began to stop (503, Retry-After 5)
SHUTTING_DOWN = "The daemon is shutting down, so this request was not finished; send it again once it is back."
#: the answer to a request whose connection was closed to make room just as it was read (503, Retry-After 1)
EVICTED = "The server closed this connection to make room for others as this request arrived; send it again."
#: the last event of a stream the daemon ended by stopping (api_common.stream_generation)
SHUTTING_DOWN_MID_STREAM = ("The daemon is shutting down, so this request was ended before it finished; send it "
                            "again once the daemon is back.")


@attrs.frozen
class HttpLimits:
    """Limits of one server (the defaults suit a local API; tests shrink them)."""

    max_connections: int = 256
    max_connections_per_address: int = 64
    max_header_bytes: int = 16 * 1024
    max_body_bytes: int = 4 * 1024 * 1024
    max_total_body_bytes: int = 64 * 1024 * 1024
    idle_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    send_timeout_s: float = 30.0
    linger_s: float = 2.0
    linger_bytes: int = 64 * 1024 * 1024
    #: a body slower than this (after `body_grace_s`) may be evicted when another client needs room
    min_body_rate_Bps: float = 16 * 1024
    body_grace_s: float = 2.0


@attrs.frozen
class Request:
    """A complete request: `method` upper-case ("GET"), `path` without the query, `body` bytes."""

    method: str
    target: str
    path: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    http_version: str
    #: the IP address the connection arrived at (this server's side); None off a socket
    local_ip: Optional[str] = None

    def header(self, name: bytes) -> Optional[bytes]:
        """The first value of header `name` (lower-case bytes), or None."""
        for k, v in self.headers:
            if k == name:
                return v
        return None


class ClientGone(Exception):
    """The client closed the connection, reset it, or stopped reading past `send_timeout_s`."""


class BodyBudget:
    """Bytes of request bodies held by all connections of one server, bounded by `limit_bytes`."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.held_bytes = 0

    def take(self, n: int) -> bool:
        """Reserve `n` bytes; False (and nothing reserved) when that would pass the limit."""
        if self.held_bytes + n > self.limit_bytes:
            return False
        self.held_bytes += n
        return True

    def give(self, n: int) -> None:
        self.held_bytes -= n


def reason_phrase(status: int) -> bytes:
    """The reason phrase of a status line (RFC 9110 §15, as http.HTTPStatus spells it), e.g.
    b"Service Unavailable" for 503; empty for a code without one (RFC 9112 §4 allows that)."""
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


def h11_reason(e: Exception) -> str:
    """h11's reason for refusing a request, for a sentence: its byte reprs as plain quoted text
    ("illegal request line: bytearray(b'GARBAGE')" -> "illegal request line: 'GARBAGE'"), no final period."""
    text = re.sub(r"bytearray\((b'[^']*'|b\"[^\"]*\")\)", r"\1", str(e))
    text = re.sub(r"\bb('[^']*'|\"[^\"]*\")", r"\1", text)
    return " ".join(text.split()).rstrip(".") or type(e).__name__


def error_body(status: int, message: str) -> bytes:
    """The JSON body of an error answer (the OpenAI error shape)."""
    kind = {404: "not_found", 408: "timeout", 413: "request_too_large", 429: "rate_limit_exceeded",
            501: "invalid_request_error", 505: "invalid_request_error",  # what the client sent, not a fault here
            503: "service_unavailable"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()


class Responder:
    """Writes the answer to one request; a HEAD request gets the headers without the body.

    Every write waits at most `send_timeout_s`; a write that fails raises ClientGone.
    """

    def __init__(self, conn: h11.Connection, stream: trio.abc.Stream, method: str, send_timeout_s: float):
        self._conn, self._stream, self._send_timeout_s = conn, stream, send_timeout_s
        self._head = method == "HEAD"
        self.started = False
        self.finished = False
        self.close_after = False
        #: set when the client closes its side while the handler runs
        self.client_gone = trio.Event()
        #: True: the server cancels the handler when the client leaves. A handler whose work must
        #: not be interrupted mid-await (a session's generate) sets False and watches `client_gone`.
        self.cancel_on_disconnect = True
        #: headers the handler wants on whatever it answers (e.g. CORS), added by `start`
        self.extra_headers: list[tuple[str, str]] = []
        #: the body of the server's own error answers (a stop, an internal error): `error_body` (the
        #: OpenAI shape) unless the handler's API has its own (Ollama's {"error": "..."})
        self.error_shape: Callable[[int, str], bytes] = error_body

    async def _send(self, event) -> None:
        await send_event(self._conn, self._stream, event, self._send_timeout_s)

    async def start(self, status: int, headers: list[tuple[str, str]]) -> None:
        """Send the status line and headers (a body without content-length is sent chunked)."""
        if self.extra_headers:
            headers = [*headers, *self.extra_headers]
        if self.close_after:
            headers = [*headers, ("connection", "close")]
        self.started = True
        await self._send(h11.Response(status_code=status, headers=headers, reason=reason_phrase(status)))

    async def write(self, data: bytes) -> None:
        if data and not self._head:
            await self._send(h11.Data(data=data))

    async def end(self) -> None:
        self.finished = True
        await self._send(h11.EndOfMessage())

    async def send(self, status: int, body: bytes, *, content_type: str = "application/json",
                   headers: Optional[list[tuple[str, str]]] = None) -> None:
        """A whole answer with a content-length."""
        await self.start(status, [("content-type", content_type), ("content-length", str(len(body))),
                                  *(headers or [])])
        await self.write(body)
        await self.end()

    async def error(self, status: int, message: str, headers: Optional[list[tuple[str, str]]] = None) -> None:
        await self.send(status, self.error_shape(status, message), headers=headers)


Handler = Callable[[Request, Responder], Awaitable[None]]


async def send_event(conn: h11.Connection, stream: trio.abc.Stream, event, timeout_s: float) -> None:
    """Send one h11 event, waiting at most `timeout_s` for the client to take it.

    Raises:
        ClientGone: the connection broke or the client did not read in time.
    """
    data = conn.send(event)
    if not data:
        return
    try:
        with trio.move_on_after(timeout_s) as scope:
            await stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError) as e:
        raise ClientGone(f"the client went away ({type(e).__name__})") from None
    if scope.cancelled_caught:
        raise ClientGone(f"the client did not read for {timeout_s:g} s")


@attrs.define
class _Slot:
    phase: str  # "idle" | "head" | "body" | "handler"
    since_s: float
    scope: trio.CancelScope
    #: the peer's address (its IP), None for a stream that is not a socket (tests' memory streams)
    address: Optional[str] = None
    #: its key in the server's table of connections
    cid: int = -1
    #: body bytes reserved from the server's BodyBudget for the request being read
    held_bytes: int = 0
    #: the body's Content-Length (None when chunked), bytes of it received, when the last arrived
    body_declared: Optional[int] = None
    body_bytes: int = 0
    last_data_s: float = 0.0
    #: the phase the connection was in when the server closed it to make room (`_close_evicted`;
    #: it may have read on to another phase before the cancellation reached it)
    evicted: Optional[str] = None


def peer_address(stream: trio.abc.Stream, *, local: bool = False) -> Optional[str]:
    """The IP address at the other end of a socket stream (with `local`, at this end); None for
    any other stream."""
    sock = getattr(stream, "socket", None)
    if sock is None:
        return None
    try:
        peer = sock.getsockname() if local else sock.getpeername()
    except OSError:
        return None
    return str(peer[0]) if isinstance(peer, tuple) else None


class _Refused(Exception):
    """End the connection after answering `status` (the request could not be read)."""

    def __init__(self, status: int, message: str, *, linger: bool, retry_after_s: Optional[int] = None):
        super().__init__(message)
        self.status, self.message, self.linger, self.retry_after_s = status, message, linger, retry_after_s


class HttpServer:
    """Serves `handler` on listeners under `limits` (see the module docstring).

    Args:
        handler: `async def handler(request, responder)`; it must answer through the responder.
        limits: this server's limits.
    """

    def __init__(self, handler: Handler, limits: HttpLimits = HttpLimits()):
        self.handler = handler
        self.limits = limits
        self.budget = BodyBudget(limits.max_total_body_bytes)
        self._slots: dict[int, _Slot] = {}
        self._ids = itertools.count()
        #: refusals in flight; the accept loop waits for one of these before it accepts
        self._refusal_room = trio.CapacityLimiter(MAX_REFUSING)

    @property
    def open_connections(self) -> int:
        """Connections being served, not counting those closed to make room that are still closing
        (each for at most REFUSAL_QUIET_S, or 1 s + REFUSAL_LINGER_S after an answer)."""
        return sum(1 for s in self._slots.values() if s.evicted is None)

    async def serve(self, listeners: list[trio.SocketListener], *,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Accept on `listeners` until cancelled; accept errors (EMFILE...) wait and retry."""
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept_loop, listener, nursery)
            task_status.started()

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        async with listener:
            while True:
                turn = object()  # holds a refusal's room from before the accept to the refusal's end
                await self._refusal_room.acquire_on_behalf_of(turn)
                try:
                    stream = await listener.accept()
                except OSError as e:
                    self._refusal_room.release_on_behalf_of(turn)
                    if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS):
                        raise
                    log.warning("http: accept failed (%s); retrying in 0.1 s", e.strerror)
                    await trio.sleep(0.1)
                    continue
                except BaseException:
                    self._refusal_room.release_on_behalf_of(turn)
                    raise
                admitted = self._admit(peer_address(stream))
                if isinstance(admitted, _Slot):
                    self._refusal_room.release_on_behalf_of(turn)
                    nursery.start_soon(self._serve_admitted, stream, admitted)
                else:
                    nursery.start_soon(self._refuse_busy, stream, admitted, turn)

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one connection to its end (or refuse it with 503 when the server is full); never
        raises an Exception (a structural guarantee)."""
        admitted = self._admit(peer_address(stream))
        if isinstance(admitted, _Slot):
            await self._serve_admitted(stream, admitted)
        else:
            await self._refuse_busy(stream, admitted, None)

    def _admit(self, address: Optional[str]) -> "_Slot | str":
        """Take a slot for a new connection from `address`, evicting one idle, in its headers or
        slow in its body where the limits need it (module docstring); else the 503's sentence."""
        lim = self.limits
        if address is not None:
            mine = [s for s in self._slots.values() if s.address == address and not s.scope.cancel_called]
            if len(mine) >= lim.max_connections_per_address and not self._evict(mine):
                return (f"This server is answering {len(mine)} connections from your address, its limit per "
                        "address; retry shortly, or reuse a connection (keep-alive).")
        live = [s for s in self._slots.values() if not s.scope.cancel_called]
        if len(live) >= lim.max_connections and not self._evict(live):
            return f"The server is answering {len(live)} connections, its limit; retry shortly."
        slot = _Slot("idle", trio.current_time(), trio.CancelScope(), address=address, cid=next(self._ids))
        self._slots[slot.cid] = slot
        return slot

    async def _serve_admitted(self, stream: trio.abc.Stream, slot: _Slot) -> None:
        try:
            with slot.scope:
                await self._connection(stream, slot)
            if slot.evicted is not None and slot.phase != "handler":  # unanswered: told why, not reset
                await self._close_evicted(stream, slot)
        except Exception:  # noqa: BLE001 - one connection's failure must not reach the server
            log.exception("http: internal error on a connection; closed it")
        finally:
            self._slots.pop(slot.cid, None)
            self._release(slot)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)

    def _release(self, slot: _Slot) -> None:
        """Give back the body bytes `slot` holds (at its request's end, or when it is evicted)."""
        self.budget.give(slot.held_bytes)
        slot.held_bytes = 0

    def body_behind_s(self, slot: _Slot, now: float) -> Optional[float]:
        """How far behind a body is, in seconds at `min_body_rate_Bps` (or of silence past
        `body_grace_s`); None when it is not in its body or not slow (module docstring)."""
        lim = self.limits
        age_s = now - slot.since_s
        if slot.phase != "body" or age_s <= lim.body_grace_s:
            return None
        expected = (age_s - lim.body_grace_s) * lim.min_body_rate_Bps
        if slot.body_declared is not None:
            expected = min(expected, slot.body_declared)
        behind_s = max((expected - slot.body_bytes) / lim.min_body_rate_Bps,
                       now - slot.last_data_s - lim.body_grace_s)
        return behind_s if behind_s > 0 else None

    def _evict(self, among: list[_Slot], *, holding: bool = False) -> bool:
        """Close one connection of `among` to make room: the longest idle or in its headers, else
        the slowest body; with `holding`, only a slow body holding body bytes (given back at once).
        False when none of them may be closed."""
        victim: Optional[_Slot] = None
        if not holding:
            waiting = [s for s in among if s.phase in ("idle", "head") and not s.scope.cancel_called]
            victim = min(waiting, key=lambda s: s.since_s, default=None)
        if victim is None:
            now = trio.current_time()
            slow = [(behind, s) for s in among if not s.scope.cancel_called and (not holding or s.held_bytes)
                    and (behind := self.body_behind_s(s, now)) is not None]
            victim = max(slow, key=lambda bs: bs[0], default=(None, None))[1]
        if victim is None:
            return False
        log.debug("http: closing a connection %s from %s to make room", victim.phase, victim.address)
        victim.evicted = victim.phase
        victim.scope.cancel()
        self._release(victim)
        return True

    async def _refuse_busy(self, stream: trio.abc.Stream, message: str, turn: Optional[object]) -> None:
        """Answer 503 with Retry-After and `message`, then close without a reset (`_answer_and_close`);
        `turn` (the accept loop's) is released at the end."""
        try:
            await self._answer_and_close(stream, 503, message)
        finally:
            if turn is not None:
                self._refusal_room.release_on_behalf_of(turn)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)

    async def _close_evicted(self, stream: trio.abc.Stream, slot: _Slot) -> None:
        """Close a connection evicted to make room without a reset: a body or headers in progress get
        408 with Retry-After and why; an idle one is closed quietly unless a request turns out to be
        waiting in it (accepted in a burst, not read yet), which gets 503 with Retry-After."""
        if slot.phase == "body":
            why = (f": its body arrived slower than {self.limits.min_body_rate_Bps:g} bytes/s, or stopped"
                   if slot.evicted == "body" else " before reading all of it")
            await self._answer_and_close(stream, 408, f"The server closed this request to make room for others{why}; "
                                                      "send it again.")
            return
        if slot.phase == "head":
            await self._answer_and_close(stream, 408, "The server closed this connection to make room for others "
                                                      "before its request headers were complete; send it again.")
            return
        try:
            with trio.move_on_after(REFUSAL_QUIET_S) as quiet:
                data = await stream.receive_some(RECEIVE_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        if quiet.cancelled_caught or not data:
            return  # idle indeed (closing sends FIN: nothing unread), or closed by the client too
        await self._answer_and_close(stream, 503, "The server closed this connection to make room for others before "
                                                  "reading its request; send it again.")

    async def _answer_and_close(self, stream: trio.abc.Stream, status: int, message: str) -> None:
        """Send `status` with Retry-After and `message` (no request read, or one abandoned), then close
        without a reset: shut down our side and read what the client still sends until it closes, is
        quiet for REFUSAL_QUIET_S, or REFUSAL_LINGER_S pass (RFC 9112 §9.6)."""
        try:
            body = error_body(status, message)
            head = (f"HTTP/1.1 {status} {reason_phrase(status).decode()}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n").encode()
            with trio.move_on_after(min(1.0, self.limits.send_timeout_s)):
                await stream.send_all(head + body)
            with trio.move_on_after(min(REFUSAL_LINGER_S, self.limits.linger_s)):
                await stream.send_eof()
                while True:
                    with trio.move_on_after(REFUSAL_QUIET_S) as quiet:
                        data = await stream.receive_some(RECEIVE_BYTES)
                    if quiet.cancelled_caught or not data:
                        break
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, AttributeError):
            pass  # AttributeError: a stream without send_eof

    # ---- one connection ------------------------------------------------------------------------
    async def _connection(self, stream: trio.abc.Stream, slot: _Slot) -> None:
        lim = self.limits
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=lim.max_header_bytes)
        while True:
            try:
                try:
                    request = await self._read_request(conn, stream, slot)
                except _Refused as r:
                    self._release(slot)  # its body's bytes are not kept while it lingers
                    await self._answer_refusal(conn, stream, r)
                    return
                if request is None:
                    return
                slot.phase, slot.since_s = "handler", trio.current_time()
                responder = Responder(conn, stream, request.method, lim.send_timeout_s)
                if not await self._run_handler(request, responder, conn, stream, slot):
                    return
            finally:
                self._release(slot)
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                if conn.their_state not in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):  # part of the request unread
                    await self._linger(stream)
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return
            slot.phase, slot.since_s = "idle", trio.current_time()

    async def _receive(self, conn: h11.Connection, stream: trio.abc.Stream) -> bool:
        """Feed the next bytes to h11; False at EOF or when the connection broke."""
        try:
            data = await stream.receive_some(RECEIVE_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        conn.receive_data(data)
        return bool(data)

    async def _read_request(self, conn: h11.Connection, stream: trio.abc.Stream, slot: _Slot) -> Optional[Request]:
        """Read one request with its body under the phase timers; None when the client is done.

        Raises:
            _Refused: a request the server answers with an error and then closes.
        """
        lim = self.limits
        now = trio.current_time()
        idle_deadline = now + lim.idle_timeout_s
        head_deadline = math.inf if not conn.trailing_data[0] else now + lim.header_timeout_s
        if head_deadline != math.inf:
            slot.phase = "head"
        request: Optional[h11.Request] = None
        body = bytearray()
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as e:
                status = e.error_status_hint if 400 <= e.error_status_hint < 600 else 400
                reason = h11_reason(e)
                message = ("The request headers are larger than the server accepts "
                           f"({lim.max_header_bytes} bytes)." if status == 431 else
                           f"This server takes a request body with a Content-Length or `Transfer-Encoding: "
                           f"chunked` and no other coding ({reason})." if status == 501 else
                           f"The request is not valid HTTP/1.1: {reason}.")
                raise _Refused(status, message, linger=True) from None
            if event is h11.NEED_DATA:
                if request is None and slot.phase == "idle":
                    with trio.move_on_at(idle_deadline):
                        got = await self._receive(conn, stream)
                        if got:
                            slot.phase, slot.since_s = "head", trio.current_time()
                            head_deadline = slot.since_s + lim.header_timeout_s
                        continue
                    return None  # idle keep-alive connection: close quietly
                deadline = head_deadline if request is None else body_deadline
                with trio.move_on_at(deadline):
                    await self._receive(conn, stream)
                    continue
                what = "its headers" if request is None else "its body"
                limit_s = lim.header_timeout_s if request is None else lim.body_timeout_s
                raise _Refused(408, f"The client did not send {what} within {limit_s:g} s.", linger=False)
            if isinstance(event, h11.Request):
                request = event
                # h11 bounds headers still arriving; these arrived whole in one read
                head_bytes = len(event.method) + len(event.target) + 12 + sum(len(k) + len(v) + 4
                                                                             for k, v in event.headers)
                if head_bytes > lim.max_header_bytes:
                    raise _Refused(431, "The request headers are larger than the server accepts "
                                        f"({lim.max_header_bytes} bytes).", linger=True)
                self._check_framing(event)
                slot.phase, slot.since_s = "body", trio.current_time()
                slot.last_data_s, slot.body_bytes = slot.since_s, 0
                body_deadline = slot.since_s + lim.body_timeout_s
                slot.body_declared = self._check_declared_length(event)
                if conn.they_are_waiting_for_100_continue:
                    try:
                        await send_event(conn, stream, h11.InformationalResponse(status_code=100, headers=[],
                                                                             reason=reason_phrase(100)),
                                         lim.send_timeout_s)
                    except ClientGone:
                        return None
            elif isinstance(event, h11.Data):
                body += event.data
                slot.body_bytes, slot.last_data_s = len(body), trio.current_time()
                if len(body) > lim.max_body_bytes:
                    raise _Refused(413, f"The request body is larger than {lim.max_body_bytes} bytes.", linger=True)
                if len(body) > slot.held_bytes:
                    self._take_body(slot, len(body) - slot.held_bytes)
                    slot.held_bytes = len(body)
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                target = request.target.decode("latin-1")
                return Request(method=request.method.decode("latin-1").upper(), target=target,
                               path=target.split("?", 1)[0], headers=tuple(request.headers),
                               body=bytes(body), http_version=request.http_version.decode("latin-1"),
                               local_ip=peer_address(stream, local=True))
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return None

    @staticmethod
    def _check_framing(request: h11.Request) -> None:
        """Refuse what this server cannot read safely: an HTTP version other than 1.0 and 1.1 (505,
        RFC 9110 §15.6.6), and a body framed both by Content-Length and Transfer-Encoding (400:
        RFC 9112 §6.1 lets a server reject it, and reading either framing could be the wrong one -
        request smuggling - or wait for bytes the client never sends).

        Raises:
            _Refused: 505 or 400 with a sentence; the connection is closed after it.
        """
        version = request.http_version.decode("latin-1")
        if version not in ("1.0", "1.1"):
            raise _Refused(505, f"This server speaks HTTP/1.1 (and HTTP/1.0), not HTTP/{version}; send the request "
                                "as HTTP/1.1.", linger=True)
        names = {name for name, _ in request.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            raise _Refused(400, "The request has both a Content-Length and a Transfer-Encoding header, so its body's "
                                "length is ambiguous (RFC 9112 §6.1); send only one of them.", linger=True)

    def _check_declared_length(self, request: h11.Request) -> Optional[int]:
        """The request's Content-Length (None when it has none); nothing is reserved for it here:
        body memory is taken as bytes arrive (`_take_body`).

        Raises:
            _Refused: 413 for a declared length over `max_body_bytes`.
        """
        for name, value in request.headers:
            if name == b"content-length":
                n = int(value)  # h11 checked it is digits
                if n > self.limits.max_body_bytes:
                    raise _Refused(413, f"The request body ({n} bytes) is larger than "
                                        f"{self.limits.max_body_bytes} bytes.", linger=True)
                return n
        return None

    def _take_body(self, slot: _Slot, n: int) -> None:
        """Reserve `n` more body bytes for `slot`, evicting slow bodies that hold bytes while the
        budget is short.

        Raises:
            _Refused: 413 with Retry-After when the bytes other requests hold leave no room.
        """
        while not self.budget.take(n):
            others = [s for s in self._slots.values() if s is not slot]
            if not self._evict(others, holding=True):
                raise self._budget_refusal()

    def _budget_refusal(self) -> _Refused:
        return _Refused(413, f"The server is holding {self.budget.held_bytes} bytes of request bodies, its limit; "
                             "retry shortly.", linger=True, retry_after_s=1)

    async def _answer_refusal(self, conn: h11.Connection, stream: trio.abc.Stream, r: _Refused) -> None:
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            responder = Responder(conn, stream, "GET", min(self.limits.send_timeout_s, 5.0))
            responder.close_after = True
            try:
                await responder.error(r.status, r.message,
                                      [("retry-after", str(r.retry_after_s))] if r.retry_after_s else None)
            except (ClientGone, h11.LocalProtocolError):
                return
        if r.linger:
            await self._linger(stream)

    async def _linger(self, stream: trio.abc.Stream) -> None:
        """Shut down our side, then discard what the client still sends (RFC 9112 §9.6)."""
        with trio.move_on_after(self.limits.linger_s):
            try:
                await stream.send_eof()
                seen = 0
                while seen < self.limits.linger_bytes:
                    data = await stream.receive_some(RECEIVE_BYTES)
                    if not data:
                        return
                    seen += len(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, AttributeError):
                return

    async def _run_handler(self, request: Request, responder: Responder, conn: h11.Connection,
                           stream: trio.abc.Stream, slot: Optional[_Slot] = None) -> bool:
        """Run the handler while watching for the client leaving; True when the connection may go on."""
        gone = False

        async def watch(scope: trio.CancelScope) -> None:
            nonlocal gone
            try:
                data = await stream.receive_some(RECEIVE_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if data:
                conn.receive_data(data)  # a pipelined request: kept for the next cycle
                return
            gone = True
            responder.client_gone.set()
            if responder.cancel_on_disconnect:
                scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, nursery.cancel_scope)
                await self.handler(request, responder)
                nursery.cancel_scope.cancel()
        except Exception as e:  # noqa: BLE001 - the guard of every request
            if _only(e, (ClientGone, trio.BrokenResourceError, trio.ClosedResourceError)):
                return False
            log.exception("http: internal error answering %s %s", request.method, request.path)
            if not responder.started and not gone:
                responder.close_after = True
                try:
                    await responder.error(500, "The server hit an internal error answering this request; "
                                               "it is logged on the host.")
                except (ClientGone, h11.LocalProtocolError):
                    pass
            return False
        except BaseException as e:  # the daemon stops: a request not yet answered learns why, then it closes
            if not only_cancelled(e):
                raise
            if not responder.started and not gone:
                responder.close_after = True
                evicted = slot is not None and slot.evicted is not None  # closed to make room, as it was read
                with trio.CancelScope(shield=True), trio.move_on_after(min(1.0, self.limits.send_timeout_s)):
                    try:
                        await responder.error(503, EVICTED if evicted else SHUTTING_DOWN,
                                              headers=[("retry-after", "1" if evicted else "5")])
                    except (ClientGone, h11.LocalProtocolError):
                        pass
            raise
        if gone:
            return False
        if not responder.finished:  # a handler that returned without answering: a bug, but not a hang
            log.error("http: the handler for %s %s returned without answering", request.method, request.path)
            if not responder.started:
                responder.close_after = True
                try:
                    await responder.error(500, "The server did not answer this request; it is logged on the host.")
                except (ClientGone, h11.LocalProtocolError):
                    pass
            return False
        return not responder.close_after


def _only(exc: BaseException, kinds: tuple[type, ...]) -> bool:
    """True when `exc` is one of `kinds`, or a group holding only those."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only(e, kinds) for e in exc.exceptions)
    return isinstance(exc, kinds)


async def open_listeners(host: str, port: int) -> list[trio.SocketListener]:
    """TCP listeners on host:port, refusing with a sentence what cannot be served.

    Raises:
        ValueError: port outside 0..65535 (never wrapped around to another port).
        OSError: the address is in use or cannot be bound.
    """
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port {port} is outside 0..65535")
    return await trio.open_tcp_listeners(port, host=host)
