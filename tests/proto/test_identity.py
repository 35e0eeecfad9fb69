"""Peer ids, fingerprints, session codes and the prologue (kafilad.proto.identity)."""

from __future__ import annotations

import base64
import hashlib

import pytest

from kafilad.errors import LocalProtocolError, SessionError
from kafilad.proto import identity
from kafilad.proto.noise import generate_keypair

# A fixed key (the responder static public key of the cacophony XX vector) with digests computed
# independently below, so the test pins the format rather than restating the code.
PUB = bytes.fromhex("31e0303fd6418d2f8c0e78b91f22e8caed0fbe48656dcf4767e4834f701b8f62")


def test_peer_id_and_fingerprint_format():
    pid, fp = identity.peer_id(PUB), identity.fingerprint(PUB)
    assert len(pid) == 8 and len(fp) == 16
    assert pid == base64.b32encode(hashlib.blake2b(PUB, digest_size=5).digest()).decode().lower()
    assert base64.b32decode(fp.upper()) == hashlib.blake2b(PUB, digest_size=10).digest()
    assert set(pid + fp) <= set("abcdefghijklmnopqrstuvwxyz234567")
    # 80 bits: a different digest size, not a prefix of the peer id's digest.
    assert not fp.startswith(pid)


def test_distinct_keys_give_distinct_fingerprints():
    fps = {identity.fingerprint(generate_keypair()[1]) for _ in range(50)}
    assert len(fps) == 50


def test_session_code_round_trip_is_case_insensitive():
    code = identity.compose_session_code("k3v9q2xa", PUB)
    assert code == f"k3v9q2xa-{identity.fingerprint(PUB)}"
    assert identity.parse_session_code(code) == ("k3v9q2xa", identity.fingerprint(PUB))
    assert identity.parse_session_code("  " + code.upper() + "\n") == ("k3v9q2xa", identity.fingerprint(PUB))
    # A session id may itself contain '-': the fingerprint is after the last one.
    assert identity.parse_session_code(identity.compose_session_code("ab-cd", PUB))[0] == "ab-cd"
    assert identity.fingerprint_matches(identity.parse_session_code(code.upper())[1], PUB)
    assert not identity.fingerprint_matches(identity.fingerprint(generate_keypair()[1]), PUB)


@pytest.mark.parametrize(
    "code, message",
    [
        ("k3v9q2xa", "has no '-'"),
        ("k3v9q2xa-abc", "not a host key fingerprint"),
        ("k3v9q2xa-" + "a" * 15 + "1", "not a host key fingerprint"),  # '1' is not base32
        ("k3v9q2xa-" + "a" * 17, "not a host key fingerprint"),
        ("-" + "a" * 16, "session id is empty"),
        ("k3_9q2xa-" + "a" * 16, "only letters a-z, digits"),
        ("x" * 65 + "-" + "a" * 16, "longer than 64"),
        ("", "has no '-'"),
    ],
)
def test_malformed_session_codes(code: str, message: str):
    with pytest.raises(SessionError, match=message):
        identity.parse_session_code(code)


def test_session_prologue():
    assert identity.session_prologue("k3v9q2xa") == b"kafila/1 session k3v9q2xa"
    with pytest.raises(LocalProtocolError, match="session id is empty"):
        identity.session_prologue("")
    with pytest.raises(LocalProtocolError, match="32 bytes"):
        identity.fingerprint(b"\x00" * 31)
    with pytest.raises(LocalProtocolError, match="Cannot compose"):
        identity.compose_session_code("bad id", PUB)
