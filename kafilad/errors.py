"""The error hierarchy (STYLE.md "Errors"): one root, local vs remote protocol errors split.

Messages are whole sentences a user can act on.
"""

from __future__ import annotations


#: `code`s callers decide on (STYLE.md "Errors": never on a message's text). The control socket sends an
#: error's code to kafila-ctl (proto_spec 05 §4); `denied` frames carry the join refusals' (proto_spec 05 §2).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
INVALID_LOGIT_BIAS = "invalid_logit_bias"
DENIED = "denied"  # the host's `kafila-ctl deny`, or a refusal without a code (an older host)
ALREADY_IN_SESSION = "already_in_session"
SESSION_COMPLETE = "session_complete"
ADMIT_TIMEOUT = "admit_timeout"
SESSION_FAILED = "session_failed"
HOST_KEY_MISMATCH = "host_key_mismatch"
DUPLICATE_PEER = "duplicate_peer"
HEAD_UNREACHABLE = "head_unreachable"  # a member head the host must ask cannot be reached now (proto_spec 05 §4)
SHUTTING_DOWN = "shutting_down"  # the daemon stops, so the operation was not finished (proto_spec 05 §4)


class KafilaError(Exception):
    """Root of every error Kafila raises on purpose.

    Attributes:
        code: a short stable word naming the refusal for programs ("" when none is named); callers decide
            on an error's type and this, never on its message, which is a sentence for people.
    """

    code: str = ""

    def __init__(self, *args, code: str | None = None):
        super().__init__(*args)
        if code is not None:
            self.code = code


class LocalProtocolError(KafilaError):
    """We were asked to send something the protocol forbids (our bug or our caller's)."""


class RemoteProtocolError(KafilaError):
    """The peer sent something malformed or out of order; the link carrying it is closed."""


class FramingError(RemoteProtocolError):
    """A byte stream that is not a frame stream (proto_spec 02 §2): the link or connection is closed.

    Attributes:
        code: "length" (a length prefix of 0 or over the limit), "msgpack" (a body that is not
            msgpack), "not_map" (a msgpack value other than a map), "no_type" (a map without a str
            "t"), "eof" (the stream ended inside a frame).
        header: the 4 length bytes of the frame at fault (b"" for "eof"). length: the length they announce.
        cause: msgpack's own exception ("msgpack"). raw: the body's bytes ("msgpack"). value: the
            decoded value ("not_map").
    """

    CODES = ("length", "msgpack", "not_map", "no_type", "eof")

    def __init__(self, message: str, *, code: str, header: bytes = b"", length: int = 0, cause=None,
                 raw: bytes = b"", value=None):
        super().__init__(message)
        self.code = code
        self.header = header
        self.length = length
        self.cause = cause
        self.raw = raw
        self.value = value


class MalformedFrame(RemoteProtocolError):
    """A received frame map is not one of its layer's frames (proto_spec 05 §3, 07 §7): the link that
    carried it is closed with this reason.

    Attributes:
        code: what was wrong, one of ``MalformedFrame.CODES``: "not_map" (the body is no map with a
            str "t"), "missing" (a required field is absent), "type" (a field of the wrong type),
            "range" (a number or length out of bounds), "sequence" (an edge's ``es`` is not a
            positive integer).
        frame_type: the frame's "t" ("" when it had none). field: the field at fault ("" for none).
    """

    CODES = ("not_map", "missing", "type", "range", "sequence")

    def __init__(self, message: str, *, code: str, frame_type: str = "", field: str = ""):
        super().__init__(message)
        self.code = code
        self.frame_type = frame_type
        self.field = field


class SequenceGap(RemoteProtocolError):
    """A ring edge carried frame ``got`` where frame ``expected`` was due (proto_spec 07 §7): frames
    were skipped, so the edge cannot deliver in order and breaks.

    Attributes:
        expected, got: edge sequence numbers (``es``).
    """

    def __init__(self, message: str, *, expected: int, got: int):
        super().__init__(message)
        self.expected = expected
        self.got = got


class HandshakeError(RemoteProtocolError):
    """The Noise handshake failed or the remote static key is not the one expected."""


class HandshakeTimeout(HandshakeError):
    """The Noise handshake did not finish in time, or the transport closed during it.

    Not a verdict on the peer's key: on a direct path it means "this path does not carry us",
    and the edge falls back to the relay (proto_spec 07 §3).
    """


class HandshakeRefused(HandshakeError):
    """The remote static key is not the one expected (session code fingerprint, roster): an error on any path."""


class LinkClosed(KafilaError):
    """A secure link ended; ``reason`` says why (a whole sentence naming the peer).

    Split as trio splits ``ClosedResourceError`` / ``BrokenResourceError``: :class:`LinkBroken` when the
    transport was lost or the peer misbehaved, :class:`LinkEnded` when it was closed in an orderly way.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class LinkEnded(LinkClosed):
    """The link was closed in an orderly way (by us, or the peer's clean EOF / goodbye)."""


class LinkBroken(LinkClosed):
    """The link was lost (transport error, liveness deadline) or closed for a protocol violation."""


class ModelFormatError(KafilaError):
    """A model directory is missing a file or holds a malformed config or safetensors header."""


class StageBuildError(KafilaError):
    """A stage could not be built from its share of the model (its tensors do not fit the config, or
    mlx-lm's code for the architecture cannot run that share; issue 21 item 3). Any plan fails the same
    way, so the session fails at once instead of re-forming (proto_spec 05 §2.3, `failed` with code
    "stage_build"). The message is a sentence naming the member, the architecture and the reason."""


class PlanError(KafilaError):
    """No division of the model exists for this fleet (see AdmissionError for the memory case)."""


class AdmissionError(PlanError):
    """A device cannot hold its share at the declared context and concurrency (DESIGN §5.4).

    Attributes:
        device: name of the undersized device.
        shortfall_bytes: how many more bytes it would need.
    """

    def __init__(self, message: str, device: str, shortfall_bytes: int):
        super().__init__(message)
        self.device = device
        self.shortfall_bytes = shortfall_bytes


class SessionError(KafilaError):
    """A session could not be formed or continued (denied, timed out, member lost)."""


class RendezvousRefused(SessionError):
    """The rendezvous answered a request with an `error` frame (proto_spec 03 §2).

    Attributes:
        code: the frame's `code`, e.g. "unknown_session" (no session with that id is open there:
            its host is away), "session_full", "duplicate_peer"; "" if it gave none.
    """

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code


class RingEdgeError(SessionError):
    """A ring edge to or from one member could not be made (kafilad/node/paths/edge.py `form_ring`).

    Attributes:
        peer_id: the member at the other end of that edge: the one found unreachable (it left the
            rendezvous session, refused the handshake, or its circuit could not be opened).
    """

    def __init__(self, message: str, peer_id: str):
        super().__init__(message)
        self.peer_id = peer_id


class GenerationError(SessionError):
    """A request failed mid-generation; the message names the member at fault.

    Args:
        code: e.g. INVALID_LOGIT_BIAS (the head cannot apply the request's sampling: the client's fault,
            an HTTP 400); None keeps the class's code.
    """

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class JoinRefused(SessionError):
    """The host refused this device's join (its `denied` frame, proto_spec 05 §2), or this device refused
    the host (its key does not match the session code: HOST_KEY_MISMATCH).

    Attributes:
        code: DENIED, ALREADY_IN_SESSION, SESSION_COMPLETE, ADMIT_TIMEOUT, SESSION_FAILED or HOST_KEY_MISMATCH.
    """

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class ContextTooLongError(GenerationError):
    """The prompt plus the requested tokens exceed the session's admitted context (DESIGN §5.4).

    Attributes:
        prompt_tokens, max_tokens, context: the numbers that did not fit (tokens).
        at_least: prompt_tokens is a lower bound (the prompt was refused without being tokenized).
        prompt_field: set by an API when its client sent no max_tokens (the API chose it): the field
            holding the prompt, which alone leaves no room (kafilad/control/api_common.py).
    """

    code = CONTEXT_LENGTH_EXCEEDED

    def __init__(self, message: str, *, prompt_tokens: int, max_tokens: int, context: int, at_least: bool = False):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context = context
        self.at_least = at_least
        self.prompt_field: str | None = None


class SessionNotReadyError(GenerationError):
    """A request arrived while the session cannot serve (forming, recovering, failed); ``state`` names it."""

    def __init__(self, message: str, *, state: str):
        super().__init__(message)
        self.state = state


class HostBusyError(GenerationError):
    """The host already serves as many requests as its plan holds memory for, and its queue is full
    (kafilad/node/serving/admission.py). The HTTP API answers 429 with ``Retry-After``.

    Attributes:
        running, queued: requests being served and waiting when this one was refused.
        retry_after_s: seconds the client should wait before retrying (>= 1).
    """

    def __init__(self, message: str, *, running: int, queued: int, retry_after_s: int):
        super().__init__(message)
        self.running = running
        self.queued = queued
        self.retry_after_s = retry_after_s


class GenerationCancelled(GenerationError):
    """A request was ended before its last token because its client went away (or read too slowly).

    Attributes:
        tokens: tokens it produced before it ended.
    """

    def __init__(self, message: str, *, tokens: int = 0):
        super().__init__(message)
        self.tokens = tokens


def find_kafila_error(exc: BaseException) -> "KafilaError | None":
    """The first KafilaError inside `exc` or inside (nested) exception groups, else None.

    Trio nurseries wrap errors of their tasks in groups; users must see only the sentence.
    """
    if isinstance(exc, KafilaError):
        return exc
    for inner in getattr(exc, "exceptions", ()) or ():
        found = find_kafila_error(inner)
        if found is not None:
            return found
    return None


def _leaves(exc: BaseException) -> list[BaseException]:
    """The non-group exceptions inside `exc`, depth first (`exc` itself if it is not a group)."""
    if isinstance(exc, BaseExceptionGroup):
        out: list[BaseException] = []
        for inner in exc.exceptions:
            out.extend(_leaves(inner))
        return out
    return [exc]


def _is_trio_cancelled(exc: BaseException) -> bool:
    """Whether `exc` is trio's Cancelled (checked by name: this module imports no trio)."""
    t = type(exc)
    return t.__name__ == "Cancelled" and t.__module__.startswith("trio")


def only_cancelled(exc: BaseException) -> bool:
    """Whether `exc` is trio's Cancelled, or a (nested) group holding nothing else: the caller's scope
    is being cancelled (e.g. the daemon stops), with no failure of its own."""
    return all(_is_trio_cancelled(e) for e in _leaves(exc))


def collapse(exc: BaseException) -> BaseException:
    """The exception a caller should see for `exc` (trio ≥ 0.25 strict exception groups).

    A nursery wraps whatever its tasks or its body raise in a (possibly nested) group, so an
    ``except SessionError`` above it would never match. This returns:

    - `exc` itself when it is not a group;
    - the sole leaf when the groups hold exactly one exception (what trio < 0.25 raised), not
      counting trio's ``Cancelled`` beside a real error: trio cancels level-triggered, so an
      enclosing cancelled scope raises ``Cancelled`` again at the caller's next checkpoint;
    - the first leaf when every leaf is a KafilaError (two tasks of one operation failing for
      related reasons, e.g. both ring edges refused; the first is the one the caller reports);
    - otherwise `exc` unchanged (several unrelated failures: a bug, to be seen whole).
    """
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves = _leaves(exc)
    real = [e for e in leaves if not _is_trio_cancelled(e)]
    if real and len(real) < len(leaves):
        leaves = real
    if len(leaves) == 1:
        return leaves[0]
    if leaves and all(isinstance(e, KafilaError) for e in leaves):
        return leaves[0]
    return exc


class collapse_groups:
    """Context manager: re-raise a group from its block as :func:`collapse` of it.

    Wrap every nursery whose failures a caller handles by type::

        with collapse_groups():
            async with trio.open_nursery() as nursery:
                ...

    The group stays reachable as the raised exception's ``__context__``.
    """

    def __enter__(self) -> "collapse_groups":
        return self

    def __exit__(self, typ, exc, tb) -> bool:
        if exc is None or not isinstance(exc, BaseExceptionGroup):
            return False
        inner = collapse(exc)
        if inner is exc:
            return False
        raise inner
