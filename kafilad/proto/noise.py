"""Noise_XX_25519_ChaChaPoly_BLAKE2b, sans-IO, on pynacl primitives (proto_spec 01; DESIGN §4).

Implements the Noise Protocol Framework, revision 34, §4 (crypto functions), §5 (CipherState,
SymmetricState, HandshakeState) for the one pattern Kafila uses (§7.5 ``XX``)::

    XX:
      -> e                 message 1, initiator -> responder
      <- e, ee, s, es      message 2, responder -> initiator
      -> s, se             message 3, initiator -> responder

Byte layouts of the three handshake messages (``p`` = payload length, proto_spec 01 §2)::

    message 1:  | e.pub (32) | payload (p, plaintext) |                      32 + p bytes
    message 2:  | e.pub (32) | enc(s.pub) (32+16) | enc(payload) (p+16) |   96 + p bytes
    message 3:  | enc(s.pub) (32+16) | enc(payload) (p+16) |                64 + p bytes

A transport message is ``ChaChaPoly(k, n, ad=b"", plaintext)``: ciphertext || 16-byte tag, with
``n`` counting from 0 in each direction (proto_spec 01 §3). Every Noise message is at most
65535 bytes (Noise §3), so a transport message carries at most 65519 plaintext bytes.

No I/O happens here: callers move the bytes (``kafilad.net.noise_stream`` does so over trio).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import nacl.bindings
import nacl.exceptions

from kafilad.errors import HandshakeError, LocalProtocolError, RemoteProtocolError

#: Noise §8 protocol name; hashed into the initial handshake hash.
PROTOCOL_NAME = b"Noise_XX_25519_ChaChaPoly_BLAKE2b"
#: Noise §3: no Noise message (handshake or transport) exceeds this many bytes.
MAX_MESSAGE_BYTES = 65535
#: Poly1305 authentication tag appended to every ciphertext (Noise §5.1, ChaChaPoly).
TAG_BYTES = 16
#: Largest plaintext one transport message can carry.
MAX_PLAINTEXT_BYTES = MAX_MESSAGE_BYTES - TAG_BYTES

DH_BYTES = 32  # X25519 public key and shared secret size (Noise §12.1)
HASH_BYTES = 64  # BLAKE2b output size, HASHLEN (Noise §12.8)
KEY_BYTES = 32  # cipher key size (Noise §4.2)
_MAX_NONCE = 2**64 - 1  # reserved (Noise §5.1); reaching it means the key is worn out


# --- §4 crypto functions -------------------------------------------------------------------------


def generate_keypair() -> tuple[bytes, bytes]:
    """A fresh X25519 key pair (Noise §4.1 GENERATE_KEYPAIR).

    Returns:
        (private, public), 32 bytes each.
    """
    public, private = nacl.bindings.crypto_box_keypair()
    return private, public


def public_key(private: bytes) -> bytes:
    """The X25519 public key (32 bytes) of a 32-byte private key.

    Raises:
        LocalProtocolError: the private key is not 32 bytes.
    """
    _check_key_length(private, "private key")
    return nacl.bindings.crypto_scalarmult_base(private)


def _dh(private: bytes, public: bytes) -> bytes:
    """Noise §4.1 DH(): X25519. A low-order remote key (all-zero result) fails the handshake."""
    try:
        return nacl.bindings.crypto_scalarmult(private, public)
    except (nacl.exceptions.RuntimeError, nacl.exceptions.ValueError, nacl.exceptions.TypeError) as exc:
        raise HandshakeError(
            "The peer sent an invalid X25519 public key (a low-order point); the handshake was aborted."
        ) from exc


def _hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.blake2b).digest()


def _hkdf(chaining_key: bytes, ikm: bytes, num_outputs: int) -> tuple[bytes, ...]:
    """Noise §4.3 HKDF with HMAC-BLAKE2b; returns 2 or 3 outputs of HASH_BYTES each."""
    temp_key = _hmac(chaining_key, ikm)
    out1 = _hmac(temp_key, b"\x01")
    out2 = _hmac(temp_key, out1 + b"\x02")
    if num_outputs == 2:
        return out1, out2
    return out1, out2, _hmac(temp_key, out2 + b"\x03")


def _check_key_length(key: bytes, what: str) -> None:
    if not isinstance(key, (bytes, bytearray)) or len(key) != DH_BYTES:
        raise LocalProtocolError(f"The {what} must be {DH_BYTES} bytes of X25519 key material.")


# --- §5.1 CipherState ----------------------------------------------------------------------------


class CipherState:
    """A key and a 64-bit nonce (Noise §5.1); ChaChaPoly with a 96-bit nonce 0^32 || LE64(n)."""

    def __init__(self, key: bytes | None = None):
        self.k = key
        self.n = 0

    def has_key(self) -> bool:
        return self.k is not None

    def _nonce(self) -> bytes:
        if self.n >= _MAX_NONCE:
            raise LocalProtocolError("The Noise nonce is exhausted; open a new secure channel.")
        return b"\x00\x00\x00\x00" + struct.pack("<Q", self.n)

    def encrypt_with_ad(self, ad: bytes, plaintext: bytes) -> bytes:
        if self.k is None:
            return bytes(plaintext)
        ct = nacl.bindings.crypto_aead_chacha20poly1305_ietf_encrypt(bytes(plaintext), ad, self._nonce(), self.k)
        self.n += 1
        return ct

    def decrypt_with_ad(self, ad: bytes, ciphertext: bytes) -> bytes:
        """Raises nacl.exceptions.CryptoError on a bad tag; the nonce then does not advance."""
        if self.k is None:
            return bytes(ciphertext)
        pt = nacl.bindings.crypto_aead_chacha20poly1305_ietf_decrypt(bytes(ciphertext), ad, self._nonce(), self.k)
        self.n += 1
        return pt


# --- §5.2 SymmetricState -------------------------------------------------------------------------


class SymmetricState:
    """Chaining key ``ck``, handshake hash ``h`` and a CipherState (Noise §5.2)."""

    def __init__(self, protocol_name: bytes):
        if len(protocol_name) <= HASH_BYTES:
            self.h = protocol_name.ljust(HASH_BYTES, b"\x00")
        else:
            self.h = _hash(protocol_name)
        self.ck = self.h
        self.cipher = CipherState()

    def mix_key(self, ikm: bytes) -> None:
        self.ck, temp_k = _hkdf(self.ck, ikm, 2)
        self.cipher = CipherState(temp_k[:KEY_BYTES])

    def mix_hash(self, data: bytes) -> None:
        self.h = _hash(self.h + data)

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ciphertext = self.cipher.encrypt_with_ad(self.h, plaintext)
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        plaintext = self.cipher.decrypt_with_ad(self.h, ciphertext)
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[CipherState, CipherState]:
        temp_k1, temp_k2 = _hkdf(self.ck, b"", 2)
        return CipherState(temp_k1[:KEY_BYTES]), CipherState(temp_k2[:KEY_BYTES])


# --- transport phase -----------------------------------------------------------------------------


class NoiseTransport:
    """The two CipherStates after Split (Noise §5.2): one to send with, one to receive with.

    Transport messages have no associated data and no framing of their own (proto_spec 01 §3).
    """

    def __init__(self, send: CipherState, receive: CipherState):
        self._send = send
        self._receive = receive

    @property
    def send_nonce(self) -> int:
        """How many messages this side has encrypted."""
        return self._send.n

    @property
    def receive_nonce(self) -> int:
        """How many messages this side has decrypted."""
        return self._receive.n

    def encrypt(self, plaintext: bytes) -> bytes:
        """Encrypt one transport message: ``len(plaintext) + 16`` bytes out.

        Raises:
            LocalProtocolError: plaintext is over MAX_PLAINTEXT_BYTES (65519); chunk it first
                (``kafilad.proto.frames.chunk``).
        """
        if len(plaintext) > MAX_PLAINTEXT_BYTES:
            raise LocalProtocolError(
                f"A Noise transport message carries at most {MAX_PLAINTEXT_BYTES} plaintext bytes, "
                f"not {len(plaintext)}; chunk the payload (proto_spec 02 §3)."
            )
        return self._send.encrypt_with_ad(b"", plaintext)

    def decrypt(self, ciphertext: bytes) -> bytes:
        """Decrypt one transport message.

        Raises:
            RemoteProtocolError: wrong length, or the tag does not authenticate (tampered, replayed,
                reordered or from another session).
        """
        if len(ciphertext) < TAG_BYTES or len(ciphertext) > MAX_MESSAGE_BYTES:
            raise RemoteProtocolError(
                f"The peer sent a Noise transport message of {len(ciphertext)} bytes; "
                f"valid messages are {TAG_BYTES}..{MAX_MESSAGE_BYTES} bytes."
            )
        try:
            return self._receive.decrypt_with_ad(b"", ciphertext)
        except nacl.exceptions.CryptoError as exc:
            raise RemoteProtocolError(
                f"A Noise transport message (number {self._receive.n}) failed authentication; "
                "it was corrupted or tampered with in transit, so the link is closed."
            ) from exc


# --- §5.3 HandshakeState, pattern XX -------------------------------------------------------------

# Message i is written by the initiator when i is even (Noise §7.5 XX: 3 messages).
_XX_TOKENS: tuple[tuple[str, ...], ...] = (("e",), ("e", "ee", "s", "es"), ("s", "se"))


class NoiseXX:
    """One side of a Noise XX handshake (Noise §5.3, §7.5), sans-IO.

    Drive it by alternating ``write_message``/``read_message`` in pattern order (the initiator
    writes first); once ``complete``, call ``split()`` for the transport CipherStates.

    Args:
        initiator: True for the side that sends message 1.
        static_private: this side's long-lived X25519 private key (32 bytes).
        prologue: bytes both sides must agree on (Kafila: ``identity.session_prologue``); a
            mismatch makes message 2 fail to authenticate (proto_spec 01 §1).
        ephemeral_private: fixed ephemeral key, for test vectors only; random when None.
    """

    def __init__(
        self,
        initiator: bool,
        static_private: bytes,
        prologue: bytes = b"",
        *,
        ephemeral_private: bytes | None = None,
    ):
        _check_key_length(static_private, "static private key")
        if ephemeral_private is not None:
            _check_key_length(ephemeral_private, "ephemeral private key")
        self.initiator = initiator
        self._s = bytes(static_private)
        self._s_pub = public_key(self._s)
        self._fixed_e = ephemeral_private
        self._e: bytes | None = None
        self._e_pub: bytes | None = None
        self._re: bytes | None = None
        self.remote_static: bytes | None = None
        self._ss = SymmetricState(PROTOCOL_NAME)
        self._ss.mix_hash(bytes(prologue))
        self._index = 0  # next message number, 0-based
        self._failed = False

    @property
    def local_static(self) -> bytes:
        """This side's static public key (32 bytes)."""
        return self._s_pub

    @property
    def complete(self) -> bool:
        """True after all three messages were written or read."""
        return self._index == len(_XX_TOKENS)

    @property
    def wants_write(self) -> bool:
        """True when the next step is ``write_message`` (False when complete)."""
        return not self.complete and (self._index % 2 == 0) == self.initiator

    @property
    def handshake_hash(self) -> bytes:
        """The handshake hash ``h`` (64 bytes); after completion it names the session (Noise §11.2)."""
        return self._ss.h

    def _dh_for(self, token: str) -> bytes:
        """Noise §7.1 DH tokens: "es" = DH(initiator e, responder s), "se" = DH(initiator s, responder e)."""
        if token == "ee":
            return _dh(self._e, self._re)
        if (token == "es") == self.initiator:  # initiator's "es" or responder's "se": our e, their s
            return _dh(self._e, self.remote_static)
        return _dh(self._s, self._re)  # initiator's "se" or responder's "es": our s, their e

    def write_message(self, payload: bytes = b"") -> bytes:
        """Produce the next handshake message carrying ``payload`` (proto_spec 01 §2).

        Returns:
            The message bytes (32 + p, 96 + p or 64 + p bytes for messages 1, 2, 3).
        Raises:
            LocalProtocolError: it is not this side's turn to write, the handshake failed or is
                complete, or the message would exceed 65535 bytes.
        """
        if self._failed:
            raise LocalProtocolError("This Noise handshake already failed; start a new one.")
        if not self.wants_write:
            raise LocalProtocolError(
                f"It is not this side's turn to write Noise XX message {self._index + 1} "
                f"(initiator={self.initiator}, complete={self.complete})."
            )
        tokens = _XX_TOKENS[self._index]
        overhead = sum(DH_BYTES if t == "e" else DH_BYTES + TAG_BYTES if t == "s" else 0 for t in tokens)
        overhead += TAG_BYTES if (self._ss.cipher.has_key() or "ee" in tokens) else 0
        if overhead + len(payload) > MAX_MESSAGE_BYTES:
            raise LocalProtocolError(
                f"A handshake payload of {len(payload)} bytes makes Noise message {self._index + 1} "
                f"longer than {MAX_MESSAGE_BYTES} bytes."
            )
        out = bytearray()
        for token in tokens:
            if token == "e":
                self._e = self._fixed_e if self._fixed_e is not None else generate_keypair()[0]
                self._e_pub = public_key(self._e)
                out += self._e_pub
                self._ss.mix_hash(self._e_pub)
            elif token == "s":
                out += self._ss.encrypt_and_hash(self._s_pub)
            else:
                self._ss.mix_key(self._dh_for(token))
        out += self._ss.encrypt_and_hash(bytes(payload))
        self._index += 1
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        """Consume the peer's next handshake message and return its payload.

        After message 2 (initiator) or message 3 (responder) ``remote_static`` is set; check it
        (proto_spec 01 §4) before trusting anything else.

        Raises:
            HandshakeError: the message is out of order, too short or long, carries an invalid key,
                or fails authentication (tampered, or a different prologue on the two sides).
                The handshake is then dead.
        """
        if self._failed:
            raise HandshakeError("This Noise handshake already failed; start a new one.")
        if self.complete or self.wants_write:
            self._failed = True
            raise HandshakeError(
                f"The peer sent a Noise handshake message out of order (we expected to "
                f"{'send' if not self.complete else 'finish'}, not to read message {self._index + 1})."
            )
        try:
            return self._read(bytes(message))
        except HandshakeError:
            self._failed = True
            raise

    def _read(self, message: bytes) -> bytes:
        number = self._index + 1
        if len(message) > MAX_MESSAGE_BYTES:
            raise HandshakeError(f"Noise handshake message {number} is {len(message)} bytes, over {MAX_MESSAGE_BYTES}.")
        view = memoryview(message)
        pos = 0

        def take(n: int) -> bytes:
            nonlocal pos
            if len(message) - pos < n:
                raise HandshakeError(
                    f"Noise handshake message {number} is truncated ({len(message)} bytes); "
                    "the peer may not speak Kafila's Noise XX."
                )
            chunk = bytes(view[pos : pos + n])
            pos += n
            return chunk

        try:
            for token in _XX_TOKENS[self._index]:
                if token == "e":
                    self._re = take(DH_BYTES)
                    self._ss.mix_hash(self._re)
                elif token == "s":
                    size = DH_BYTES + (TAG_BYTES if self._ss.cipher.has_key() else 0)
                    self.remote_static = self._ss.decrypt_and_hash(take(size))
                else:
                    self._ss.mix_key(self._dh_for(token))
            rest = bytes(view[pos:])
            if self._ss.cipher.has_key() and len(rest) < TAG_BYTES:
                raise HandshakeError(f"Noise handshake message {number} is truncated (no room for its payload tag).")
            payload = self._ss.decrypt_and_hash(rest)
        except nacl.exceptions.CryptoError as exc:
            raise HandshakeError(
                f"Noise handshake message {number} failed authentication: it was tampered with, or the "
                "two sides disagree on the prologue (session id) or keys."
            ) from exc
        self._index += 1
        return payload

    def split(self) -> NoiseTransport:
        """The transport phase (Noise §5.2 Split): initiator sends with the first key.

        Raises:
            LocalProtocolError: the handshake is not complete.
        """
        if not self.complete or self._failed:
            raise LocalProtocolError("Split() needs a completed Noise handshake.")
        c1, c2 = self._ss.split()
        return NoiseTransport(c1, c2) if self.initiator else NoiseTransport(c2, c1)
