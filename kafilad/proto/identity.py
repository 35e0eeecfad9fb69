"""Peer identity, key fingerprints and session codes (proto_spec 01 §1; DESIGN §3 step 1, §4).

A daemon's identity is its long-lived X25519 static public key (32 bytes). Two short names derive
from it, both lowercase RFC 4648 base32 without padding of a BLAKE2b digest of the key::

    peer id     = b32(blake2b(pub, digest_size=5))    40 bits ->  8 chars   (display, CLI)
    fingerprint = b32(blake2b(pub, digest_size=10))   80 bits -> 16 chars   (authenticates the host)

The peer id is a handle for humans, not a security boundary: two keys may share one. The
fingerprint is what a joining member checks the host's static key against (proto_spec 01 §4.1).

Session code (proto_spec 01 §1.2)::

    <session_id> "-" <fingerprint>          e.g.  "k3v9q2xa-mfrggzdfmztwq2lk"

``session_id`` is what the rendezvous returned: 1..64 chars of ``[a-z0-9-]``. The code is read
case-insensitively and surrounding whitespace is ignored; the fingerprint is the part after the
last ``-``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re

from kafilad.errors import LocalProtocolError, SessionError

PEER_ID_DIGEST_BYTES = 5
FINGERPRINT_DIGEST_BYTES = 10
PEER_ID_CHARS = 8
FINGERPRINT_CHARS = 16
SESSION_ID_MAX_CHARS = 64
#: Prefix of the Noise prologue; the session id follows it (proto_spec 01 §1.3).
PROLOGUE_PREFIX = b"kafila/1 session "

_SESSION_ID_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?")
_FINGERPRINT_RE = re.compile(r"[a-z2-7]{16}")


def _b32(digest: bytes) -> str:
    return base64.b32encode(digest).decode("ascii").rstrip("=").lower()


def _check_public(public: bytes) -> None:
    if not isinstance(public, (bytes, bytearray)) or len(public) != 32:
        raise LocalProtocolError("A Kafila public key is 32 bytes of X25519 key material.")


def peer_id(public: bytes) -> str:
    """Short display id of a static public key: 8 base32 chars (40 bits; proto_spec 01 §1.1).

    Raises:
        LocalProtocolError: ``public`` is not 32 bytes.
    """
    _check_public(public)
    return _b32(hashlib.blake2b(bytes(public), digest_size=PEER_ID_DIGEST_BYTES).digest())


def fingerprint(public: bytes) -> str:
    """Fingerprint of a static public key: 16 base32 chars (80 bits; proto_spec 01 §1.1).

    Raises:
        LocalProtocolError: ``public`` is not 32 bytes.
    """
    _check_public(public)
    return _b32(hashlib.blake2b(bytes(public), digest_size=FINGERPRINT_DIGEST_BYTES).digest())


def fingerprint_matches(expected_fingerprint: str, public: bytes) -> bool:
    """True when ``public`` has this fingerprint (case-insensitive, constant-time compare)."""
    return hmac.compare_digest(fingerprint(public).encode(), expected_fingerprint.strip().lower().encode())


def _check_session_id(session_id: str) -> str | None:
    """The problem with a session id, as a phrase, or None when it is well formed."""
    if not isinstance(session_id, str) or not session_id:
        return "the session id is empty"
    if len(session_id) > SESSION_ID_MAX_CHARS:
        return f"the session id is longer than {SESSION_ID_MAX_CHARS} characters"
    if not _SESSION_ID_RE.fullmatch(session_id):
        return "the session id may hold only letters a-z, digits and inner '-'"
    return None


def compose_session_code(session_id: str, host_public: bytes) -> str:
    """The code a host prints: ``<session_id>-<fingerprint of host_public>`` (proto_spec 01 §1.2).

    Args:
        session_id: as returned by the rendezvous (lowercase ``[a-z0-9-]``, 1..64 chars).
        host_public: the host's 32-byte static public key.
    Raises:
        LocalProtocolError: the session id or key is malformed.
    """
    problem = _check_session_id(session_id)
    if problem:
        raise LocalProtocolError(f"Cannot compose a session code: {problem} ({session_id!r}).")
    return f"{session_id}-{fingerprint(host_public)}"


def parse_session_code(code: str) -> tuple[str, str]:
    """Split a session code into (session_id, host fingerprint), both lowercase (proto_spec 01 §1.2).

    Raises:
        SessionError: the code is not of the form ``<session id>-<16-char fingerprint>``.
    """
    if not isinstance(code, str):
        raise SessionError("A session code is text such as 'k3v9q2xa-mfrggzdfmztwq2lk'.")
    text = code.strip().lower()
    session_id, sep, fp = text.rpartition("-")
    if not sep:
        raise SessionError(
            f"The session code {code!r} has no '-': a code is <session id>-<host key fingerprint>, "
            "as printed by `kafila-ctl host`; check that it was copied whole."
        )
    if not _FINGERPRINT_RE.fullmatch(fp):
        raise SessionError(
            f"The session code {code!r} ends in {fp!r}, which is not a host key fingerprint "
            f"({FINGERPRINT_CHARS} characters of a-z and 2-7); check that it was copied whole."
        )
    problem = _check_session_id(session_id)
    if problem:
        raise SessionError(f"The session code {code!r} is malformed: {problem}.")
    return session_id, fp


def session_prologue(session_id: str) -> bytes:
    """The Noise prologue binding a handshake to one session: ``b"kafila/1 session " + id``.

    proto_spec 01 §1.3. Both sides must use the same id (lowercase), or message 2 fails.

    Raises:
        LocalProtocolError: the session id is malformed.
    """
    problem = _check_session_id(session_id)
    if problem:
        raise LocalProtocolError(f"Cannot build a Noise prologue: {problem} ({session_id!r}).")
    return PROLOGUE_PREFIX + session_id.encode("ascii")
