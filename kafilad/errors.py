"""The error hierarchy (STYLE.md "Errors"): one root, local vs remote protocol errors split.

Messages are whole sentences a user can act on.
"""

from __future__ import annotations


class KafilaError(Exception):
    """Root of every error Kafila raises on purpose."""


class LocalProtocolError(KafilaError):
    """We were asked to send something the protocol forbids (our bug or our caller's)."""


class RemoteProtocolError(KafilaError):
    """The peer sent something malformed or out of order; the link carrying it is closed."""


class HandshakeError(RemoteProtocolError):
    """The Noise handshake failed or the remote static key is not the one expected."""


class ModelFormatError(KafilaError):
    """A model directory is missing a file or holds a malformed config or safetensors header."""


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


class GenerationError(SessionError):
    """A request failed mid-generation; the message names the member at fault."""


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
