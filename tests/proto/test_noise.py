"""Noise XX (kafilad.proto.noise): published vectors, interop with `noiseprotocol`, failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from noise.connection import Keypair, NoiseConnection

from kafilad.errors import HandshakeError, LocalProtocolError, RemoteProtocolError
from kafilad.proto import noise as kn

VECTORS = Path(__file__).resolve().parents[2] / "proto_spec" / "vectors" / "noise_xx_25519_chachapoly_blake2b.json"


def _vector() -> dict:
    (vector,) = json.loads(VECTORS.read_text())["vectors"]
    assert vector["name"] == kn.PROTOCOL_NAME.decode()
    return vector


def _pair(prologue_i: bytes = b"p", prologue_r: bytes = b"p") -> tuple[kn.NoiseXX, kn.NoiseXX]:
    return (
        kn.NoiseXX(True, kn.generate_keypair()[0], prologue_i),
        kn.NoiseXX(False, kn.generate_keypair()[0], prologue_r),
    )


def _run_handshake(i: kn.NoiseXX, r: kn.NoiseXX, payloads=(b"", b"", b"")) -> list[bytes]:
    received = []
    received.append(r.read_message(i.write_message(payloads[0])))
    received.append(i.read_message(r.write_message(payloads[1])))
    received.append(r.read_message(i.write_message(payloads[2])))
    return received


# --- published vectors (cacophony) ---------------------------------------------------------------


def test_cacophony_vector_handshake_and_transport():
    v = _vector()
    h = bytes.fromhex
    i = kn.NoiseXX(True, h(v["init_static"]), h(v["init_prologue"]), ephemeral_private=h(v["init_ephemeral"]))
    r = kn.NoiseXX(False, h(v["resp_static"]), h(v["resp_prologue"]), ephemeral_private=h(v["resp_ephemeral"]))
    messages = v["messages"]
    assert len(messages) == 6
    for k, m in enumerate(messages[:3]):
        writer, reader = (i, r) if k % 2 == 0 else (r, i)
        assert writer.wants_write and not reader.wants_write
        ct = writer.write_message(h(m["payload"]))
        assert ct.hex() == m["ciphertext"], f"handshake message {k + 1}"
        assert reader.read_message(ct) == h(m["payload"])
    assert i.complete and r.complete
    assert i.remote_static == kn.public_key(h(v["resp_static"]))
    assert r.remote_static == kn.public_key(h(v["init_static"]))
    assert i.handshake_hash == r.handshake_hash and len(i.handshake_hash) == 64
    ti, tr = i.split(), r.split()
    # After XX the responder sends next: messages keep alternating (cacophony convention).
    for k, m in enumerate(messages[3:], start=3):
        writer, reader = (ti, tr) if k % 2 == 0 else (tr, ti)
        ct = writer.encrypt(h(m["payload"]))
        assert ct.hex() == m["ciphertext"], f"transport message {k + 1}"
        assert reader.decrypt(ct) == h(m["payload"])


def test_message_sizes_match_spec_layout():
    """proto_spec 01 §2: 32 + p, 96 + p, 64 + p bytes; transport p + 16."""
    i, r = _pair()
    m1 = i.write_message(b"a" * 5)
    assert len(m1) == 32 + 5 and m1.endswith(b"aaaaa")  # message 1 payload is not encrypted
    r.read_message(m1)
    m2 = r.write_message(b"b" * 7)
    assert len(m2) == 96 + 7
    i.read_message(m2)
    m3 = i.write_message(b"c" * 9)
    assert len(m3) == 64 + 9
    r.read_message(m3)
    assert len(i.split().encrypt(b"xyz")) == 3 + 16


# --- interop with the noiseprotocol package ------------------------------------------------------


def _oracle(initiator: bool, private: bytes, prologue: bytes) -> NoiseConnection:
    conn = NoiseConnection.from_name(kn.PROTOCOL_NAME)
    conn.set_as_initiator() if initiator else conn.set_as_responder()
    conn.set_keypair_from_private_bytes(Keypair.STATIC, private)
    conn.set_prologue(prologue)
    conn.start_handshake()
    return conn


@pytest.mark.parametrize("we_initiate", [True, False], ids=["kafila-initiator", "kafila-responder"])
def test_interop_with_noiseprotocol(we_initiate: bool):
    prologue = b"kafila/1 session abc123"
    ours_priv, ours_pub = kn.generate_keypair()
    theirs_priv, theirs_pub = kn.generate_keypair()
    ours = kn.NoiseXX(we_initiate, ours_priv, prologue)
    theirs = _oracle(not we_initiate, theirs_priv, prologue)
    payloads = [b"", b"responder payload \x00\xff", b"initiator payload"]
    for k, payload in enumerate(payloads):
        ours_writes = (k % 2 == 0) == we_initiate
        if ours_writes:
            assert bytes(theirs.read_message(ours.write_message(payload))) == payload
        else:
            assert ours.read_message(bytes(theirs.write_message(payload))) == payload
    assert ours.complete and theirs.handshake_finished
    assert ours.remote_static == theirs_pub
    assert ours.handshake_hash == theirs.get_handshake_hash()
    assert ours.local_static == ours_pub
    t = ours.split()
    for n in range(3):
        msg = bytes([n]) * (100 * n + 1)
        assert bytes(theirs.decrypt(t.encrypt(msg))) == msg
        assert t.decrypt(bytes(theirs.encrypt(msg[::-1]))) == msg[::-1]
    big = bytes(range(256)) * 255 + b"x" * (kn.MAX_PLAINTEXT_BYTES - 256 * 255)
    ct = t.encrypt(big)
    assert len(ct) == kn.MAX_MESSAGE_BYTES
    assert bytes(theirs.decrypt(ct)) == big
    assert t.send_nonce == 4 and t.receive_nonce == 3


# --- failures ------------------------------------------------------------------------------------


@pytest.mark.parametrize("message_index", [1, 2])
def test_tampered_handshake_message_raises_handshake_error(message_index: int):
    i, r = _pair()
    msgs = [i.write_message(b"hello")]
    r.read_message(msgs[0])
    m2 = r.write_message(b"r")
    if message_index == 1:
        bad = bytearray(m2)
        bad[40] ^= 0x01  # inside the encrypted static key
        with pytest.raises(HandshakeError, match="failed authentication"):
            i.read_message(bytes(bad))
        with pytest.raises(HandshakeError, match="already failed"):
            i.read_message(m2)
        return
    i.read_message(m2)
    m3 = bytearray(i.write_message(b"i"))
    m3[-1] ^= 0x80  # the payload tag
    with pytest.raises(HandshakeError, match="message 3 failed authentication"):
        r.read_message(bytes(m3))


def test_wrong_prologue_fails_at_message_two():
    i, r = _pair(prologue_i=b"kafila/1 session aaaa", prologue_r=b"kafila/1 session bbbb")
    r.read_message(i.write_message())  # message 1 is unauthenticated; the mismatch shows next
    with pytest.raises(HandshakeError, match="prologue"):
        i.read_message(r.write_message())


def test_truncated_and_out_of_order_messages():
    i, r = _pair()
    m1 = i.write_message()
    with pytest.raises(HandshakeError, match="truncated"):
        r.read_message(m1[:31])
    i2, r2 = _pair()
    with pytest.raises(HandshakeError, match="out of order"):
        i2.read_message(b"\x00" * 32)  # the initiator must write first
    with pytest.raises(LocalProtocolError, match="not this side's turn"):
        r2.write_message()
    with pytest.raises(LocalProtocolError, match="completed"):
        r2.split()


def test_low_order_ephemeral_key_is_rejected():
    i, r = _pair()
    r.read_message(b"\x00" * 32)  # all-zero ephemeral: read fine, DH in the next write fails
    with pytest.raises(HandshakeError, match="invalid X25519 public key"):
        r.write_message()


def test_handshake_payload_too_big_for_one_message():
    i, _ = _pair()
    with pytest.raises(LocalProtocolError, match="longer than 65535"):
        i.write_message(b"x" * (kn.MAX_MESSAGE_BYTES - 31))
    assert len(i.write_message(b"x" * (kn.MAX_MESSAGE_BYTES - 32))) == kn.MAX_MESSAGE_BYTES


def test_transport_limits_and_tampering():
    i, r = _pair()
    _run_handshake(i, r)
    ti, tr = i.split(), r.split()
    with pytest.raises(LocalProtocolError, match="at most 65519"):
        ti.encrypt(b"x" * (kn.MAX_PLAINTEXT_BYTES + 1))
    ct = bytearray(ti.encrypt(b"secret"))
    ct[0] ^= 1
    with pytest.raises(RemoteProtocolError, match="failed authentication"):
        tr.decrypt(bytes(ct))
    with pytest.raises(RemoteProtocolError, match="valid messages are 16..65535"):
        tr.decrypt(b"short")
    # A replayed or reordered message fails too: nonces are implicit and strictly increasing.
    ti.encrypt(b"1")  # the first message, never delivered
    second = ti.encrypt(b"2")
    with pytest.raises(RemoteProtocolError):
        tr.decrypt(second)


def test_keys():
    priv, pub = kn.generate_keypair()
    assert len(priv) == 32 and len(pub) == 32
    assert kn.public_key(priv) == pub
    with pytest.raises(LocalProtocolError, match="32 bytes"):
        kn.NoiseXX(True, b"short")
