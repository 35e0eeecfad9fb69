"""HOST:PORT parsing (kafilad/proto/address.py): the one parser for command lines, STUN lists, bind addresses."""

from __future__ import annotations

import argparse
import functools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kafilad.errors import KafilaError
from kafilad.net import stun_client
from kafilad.proto.address import AddressError, parse_host_port


@pytest.mark.parametrize(
    "text, default, expected",
    [
        ("172.16.0.10:3479", None, ("172.16.0.10", 3479)),
        ("rdv.example.org:7400", None, ("rdv.example.org", 7400)),
        ("[2001:db8::1]:3478", None, ("2001:db8::1", 3478)),
        (" [::1]:80 ", None, ("::1", 80)),
        ("rdv.example", 3478, ("rdv.example", 3478)),
        ("[::1]", 3478, ("::1", 3478)),
        ("::1", 3478, ("::1", 3478)),  # more than one ':' without brackets: a bare IPv6 literal
        ("fe80::1:80", 9, ("fe80::1:80", 9)),
        ("0.0.0.0:65535", None, ("0.0.0.0", 65535)),
    ],
)
def test_accepted_forms(text, default, expected):
    assert parse_host_port(text, default) == expected


@pytest.mark.parametrize(
    "text, default, message",
    [
        ("host:99999", None, "port between 1 and 65535"),
        ("host:0", None, "port between 1 and 65535"),
        ("host:-1", None, "port between 1 and 65535"),
        ("host:http", None, "port between 1 and 65535"),
        ("host:²", None, "port between 1 and 65535"),
        ("rdv.example", None, "names no port"),
        ("::1", None, "names no port"),
        (":7400", None, "names no host"),
        ("[::1", 1, r"written \[ADDRESS\]:PORT"),
        ("[::1]x", 1, r"written \[ADDRESS\]:PORT"),
    ],
)
def test_refusals_are_sentences(text, default, message):
    with pytest.raises(AddressError, match=message) as info:
        parse_host_port(text, default)
    assert isinstance(info.value, KafilaError) and isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"'{text.strip()}' is not HOST:PORT")


def test_port_zero_for_listen_and_bind_addresses():
    assert parse_host_port("0.0.0.0:0", allow_any_port=True) == ("0.0.0.0", 0)
    assert parse_host_port("[::]:0", allow_any_port=True) == ("::", 0)
    with pytest.raises(AddressError, match="between 0 and 65535"):
        parse_host_port("h:65536", allow_any_port=True)


def test_stun_servers_default_to_the_stun_port():
    assert stun_client.parse_host_port("rdv.example") == ("rdv.example", stun_client.STUN_PORT) == ("rdv.example", 3478)
    assert stun_client.parse_host_port("10.0.0.1:3479") == ("10.0.0.1", 3479)


def test_argparse_type_turns_the_error_into_a_usage_error_with_the_sentence(capsys):
    """`kafilad rendezvous --listen HOST:PORT` (port 0: any free port) needs no wrapper of its own."""
    p = argparse.ArgumentParser(prog="kafilad")
    p.add_argument("--listen", type=functools.partial(parse_host_port, allow_any_port=True))
    p.add_argument("--stun", type=parse_host_port, action="append", default=[])
    args = p.parse_args(["--listen", "0.0.0.0:0", "--stun", "[2001:db8::1]:3478"])
    assert args.listen == ("0.0.0.0", 0) and args.stun == [("2001:db8::1", 3478)]
    with pytest.raises(SystemExit):
        p.parse_args(["--listen", "127.0.0.1"])
    assert "argument --listen: '127.0.0.1' is not HOST:PORT: it names no port." in capsys.readouterr().err


@given(host=st.from_regex(r"[a-z0-9][a-z0-9.-]{0,30}", fullmatch=True), port=st.integers(1, 65535))
def test_formatted_addresses_parse_back(host, port):
    assert parse_host_port(f"{host}:{port}") == (host, port)
    v6 = f"2001:db8::{port:x}"
    assert parse_host_port(f"[{v6}]:{port}") == (v6, port)
