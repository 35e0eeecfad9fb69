"""Proof of possession of a static key at the rendezvous, X25519 only (proto_spec/03-rendezvous.md §2.4).

A peer id is a hash of the daemon's X25519 static public key (proto_spec 01 §1.1); the rendezvous
accepts a claimed peer id in `register` / `join` only with proof that the client holds the
matching private key. With no signature scheme at hand, the proof is a MAC keyed by a
Diffie-Hellman result only the key holder and the server can compute::

    server, on WebSocket connect:  e = random X25519 private key (per connection), n = 16 random bytes
                                   -> `challenge` {server_public: X25519(e, 9), nonce: n}
    client:                        k = X25519(static_private, server_public)            32 bytes
                                   proof = HMAC-BLAKE2b-512(k, proof_input(...))         64 bytes
    server:                        k = X25519(e, static_public); compare in constant time;
                                   peer_id == peer_id(static_public)

proof_input, all fields concatenated (integers big-endian)::

    +-----------------------------+-----------+---------------+---------------+
    | "kafila/1 rendezvous proof" | nonce     | server_public | static_public |
    | 25 bytes ASCII              | 16 bytes  | 32 bytes      | 32 bytes      |
    +-----------------------------+-----------+---------------+---------------+
    | len u32 | request type       | len u32 | session_id    | len u32 | name  |
    |         | "register"/"join"  |         | UTF-8 as sent |         | UTF-8 |
    +---------+--------------------+---------+---------------+---------+-------+

``session_id`` is empty for `register`. A fresh ``e`` and ``n`` per connection make a proof
useless on any other connection (no replay); the request fields bind it to one request.
Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import attrs
from nacl.bindings import crypto_scalarmult, crypto_scalarmult_base
from nacl.exceptions import CryptoError

from kafilad.errors import LocalProtocolError
from kafilad.proto.identity import peer_id as peer_id_of

PROOF_LABEL = b"kafila/1 rendezvous proof"
KEY_BYTES = 32
NONCE_BYTES = 16
PROOF_BYTES = 64  # HMAC-BLAKE2b-512 output
_LEN = struct.Struct(">I")


@attrs.frozen
class Challenge:
    """What the server sends on connect (proto_spec 03 §2.4 `challenge`).

    Attributes:
        server_public: the server's per-connection X25519 ephemeral public key, 32 bytes.
        nonce: 16 random bytes.
    """

    server_public: bytes
    nonce: bytes


def public_key(private: bytes) -> bytes:
    """The X25519 public key (32 bytes) of a 32-byte private key.

    Raises:
        LocalProtocolError: ``private`` is not 32 bytes.
    """
    if not isinstance(private, (bytes, bytearray)) or len(private) != KEY_BYTES:
        raise LocalProtocolError("A Kafila static private key is 32 bytes of X25519 key material.")
    return crypto_scalarmult_base(bytes(private))


def proof_input(challenge: Challenge, static_public: bytes, request_type: str, session_id: str,
                name: str) -> bytes:
    """The bytes the proof MACs (layout in the module docstring; proto_spec 03 §2.4)."""
    out = [PROOF_LABEL, challenge.nonce, challenge.server_public, static_public]
    for text in (request_type, session_id, name):
        raw = text.encode("utf-8")
        out += [_LEN.pack(len(raw)), raw]
    return b"".join(out)


def make_proof(static_private: bytes, challenge: Challenge, request_type: str, session_id: str,
               name: str) -> tuple[bytes, bytes]:
    """Client side: prove possession of ``static_private`` for one `register` / `join`.

    Args:
        static_private: the daemon's 32-byte X25519 static private key.
        challenge: the `challenge` this connection received.
        request_type: "register" or "join".
        session_id: the `join`'s session id exactly as sent ("" for `register`).
        name: the display name exactly as sent.
    Returns:
        (static_public 32 bytes, proof 64 bytes).
    Raises:
        LocalProtocolError: the key is not 32 bytes, or the server's key is unusable
            (a low-order point: the shared secret would be zero).
    """
    static_public = public_key(static_private)
    try:
        shared = crypto_scalarmult(bytes(static_private), challenge.server_public)
    except CryptoError:
        raise LocalProtocolError(
            "The rendezvous sent an unusable challenge key (a low-order X25519 point); "
            "it may be faulty or not a Kafila rendezvous.") from None
    mac = hmac.new(shared, proof_input(challenge, static_public, request_type, session_id, name),
                   hashlib.blake2b).digest()
    return static_public, mac


def check_proof(server_private: bytes, challenge: Challenge, claimed_peer_id: str, static_public: object,
                proof: object, request_type: str, session_id: str, name: str) -> tuple[str, str] | None:
    """Server side: verify a `register` / `join` proof (proto_spec 03 §2.4).

    Args:
        server_private: this connection's 32-byte ephemeral private key (its public is in ``challenge``).
        challenge: what this connection was sent.
        claimed_peer_id, static_public, proof, session_id, name: the request's fields, as received.
    Returns:
        None when the proof holds, else (error code, reason sentence): ``proof_required`` when the
        key or proof is missing or of the wrong size, ``peer_id_mismatch`` when the peer id is not
        that of the key, ``bad_proof`` when the MAC does not verify.
    """
    if not (isinstance(static_public, bytes) and len(static_public) == KEY_BYTES
            and isinstance(proof, bytes) and len(proof) == PROOF_BYTES):
        return ("proof_required",
                f"A {request_type!r} must carry 'static_public' ({KEY_BYTES} bytes) and 'proof' "
                f"({PROOF_BYTES} bytes): this rendezvous admits a peer id only with proof of its static "
                "key (proto_spec 03 §2.4). Upgrade the daemon.")
    actual = peer_id_of(static_public)
    if claimed_peer_id != actual:
        return ("peer_id_mismatch",
                f"Peer id {claimed_peer_id!r} is not the id of the static key presented (that key's id "
                f"is {actual!r}); a daemon may use only the peer id of its own key.")
    try:
        shared = crypto_scalarmult(server_private, static_public)
    except CryptoError:
        shared = None  # a low-order key: anyone could compute the MAC, so it proves nothing
    if shared is not None:
        expected = hmac.new(shared, proof_input(challenge, static_public, request_type, session_id, name),
                            hashlib.blake2b).digest()
        if hmac.compare_digest(expected, proof):
            return None
    return ("bad_proof",
            f"The proof for peer {claimed_peer_id!r} does not verify against this connection's challenge: "
            "the client does not hold that peer's static key, or reused a proof made for another "
            "connection or request.")
