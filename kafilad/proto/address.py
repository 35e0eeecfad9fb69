"""HOST:PORT text, the one parser (command lines, STUN server lists, KAFILA_UDP_BIND), pure.

Accepted forms (RFC 3986 §3.2.2 brackets for IPv6 literals)::

    host:port         rdv.example:7400, 203.0.113.10:3478
    [v6]:port         [2001:db8::1]:3478
    host | [v6] | v6  no port: ``default_port`` (an error where a port is required)

A text with more than one ":" and no brackets is a bare IPv6 literal (no port).
"""

from __future__ import annotations

import argparse

from kafilad.errors import KafilaError

Address = tuple[str, int]


class AddressError(KafilaError, ValueError, argparse.ArgumentTypeError):
    """Not a HOST:PORT; the message is a whole sentence.

    Also a ValueError and an ``argparse.ArgumentTypeError``, so ``parse_host_port`` (or a
    ``functools.partial`` of it) serves as an argparse ``type=`` and a bad value becomes a usage
    error carrying this sentence.
    """


def parse_host_port(text: str, default_port: int | None = None, *, allow_any_port: bool = False) -> Address:
    """Parse "host:port", "[v6]:port", "host", "[v6]" or a bare IPv6 literal into (host, port).

    Args:
        text: the address text; surrounding white space is ignored.
        default_port: the port when the text names none; None: a port is required.
        allow_any_port: accept port 0 ("any free port", for listen and bind addresses).
    Returns:
        (host without brackets, port).
    Raises:
        AddressError: no host, no port where one is required, or a port that is not a number in
            1..65535 (0..65535 with ``allow_any_port``).
    """
    text = text.strip()
    host, port_text = text, ""
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise AddressError(f"'{text}' is not HOST:PORT: an IPv6 literal is written [ADDRESS]:PORT.")
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    lowest = 0 if allow_any_port else 1
    if not host:
        raise AddressError(f"'{text}' is not HOST:PORT: it names no host.")
    if not port_text:
        if default_port is None:
            raise AddressError(f"'{text}' is not HOST:PORT: it names no port.")
        return host, default_port
    if not (port_text.isascii() and port_text.isdigit()) or not lowest <= int(port_text) <= 65535:
        raise AddressError(f"'{text}' is not HOST:PORT with a port between {lowest} and 65535.")
    return host, int(port_text)
