"""API keys of the host's HTTP API (issue 22 §3; DESIGN §7).

Keys come from `kafilad --api-key KEY` (repeatable) and `KAFILA_API_KEYS` (comma-separated); any
of them opens the API. A client presents one the way the clients of each API send it:

```
Authorization: Bearer KEY     OpenAI's clients (api_key=...), Ollama's (OLLAMA_API_KEY / headers=...), curl -H
x-api-key: KEY                Anthropic's clients (api_key=...)
```
The scheme name is case-insensitive (RFC 9110 §11.1) and the token is RFC 6750 §2.1's
`b68token` (letters, digits, `-._~+/`, then `=`s); anything else presents no key. A key is compared
in constant time: SHA-256 of the presented token against SHA-256 of every key with
`hmac.compare_digest`, all keys every time, so neither the match nor a key's length shows in
the answer's timing.

Without keys the API is open, which `kafilad` allows only on a loopback address (127.0.0.0/8,
::1, localhost) unless `--http-insecure` says so (`check_binding`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from typing import Iterable, Mapping, Optional

from kafilad.errors import KafilaError

#: environment variable: API keys, comma-separated
KEYS_ENV = "KAFILA_API_KEYS"
#: RFC 6750 §2.1 b64token
_B64TOKEN = re.compile(rb"[A-Za-z0-9\-._~+/]+=*")
#: a key must be at least this long (a short key is guessable over the network)
MIN_KEY_CHARS = 16


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class ApiKeys:
    """The keys that open the API; empty: the API is open.

    Args:
        keys: the keys (strings of RFC 6750 b64token characters, at least MIN_KEY_CHARS long).
    Raises:
        KafilaError: a key is too short or holds a character a header cannot carry as a token.
    """

    def __init__(self, keys: Iterable[str] = ()):
        clean = []
        for key in keys:
            key = key.strip()
            if not key:
                continue
            if not _B64TOKEN.fullmatch(key.encode("utf-8", "replace")):
                raise KafilaError("An API key may hold only letters, digits and - . _ ~ + / (then = signs), as an "
                                  "`Authorization: Bearer` header carries it; make one with `openssl rand -hex 24`.")
            if len(key) < MIN_KEY_CHARS:
                raise KafilaError(f"An API key must be at least {MIN_KEY_CHARS} characters long (one of those given "
                                  f"has {len(key)}); make one with `openssl rand -hex 24`.")
            clean.append(key)
        self._digests = tuple(_digest(k.encode()) for k in dict.fromkeys(clean))

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def opens(self, token: Optional[bytes]) -> bool:
        """Whether `token` is one of the keys (constant time in the token and over all keys)."""
        if token is None or not self._digests:
            return False
        d = _digest(token)
        ok = False
        for key in self._digests:
            ok |= hmac.compare_digest(d, key)
        return ok

    def allows(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """Whether a request with `headers` (lower-case names) may use the API: no keys, or one of them
        presented (`presented_key`)."""
        return not self._digests or self.opens(presented_key(headers))


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> Optional[bytes]:
    """The key a request presents: the token of its first Authorization header when that is
    `Bearer TOKEN` with a valid token, else its first `x-api-key` when that is a valid token
    (module docstring); None when it presents neither.

    Args:
        headers: (name, value) pairs, names lower-case (as h11 gives them).
    """
    bearer = api_key = None
    for name, value in headers:
        if name == b"authorization" and bearer is None:
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip(b" \t")
            bearer = token if scheme.lower() == b"bearer" and _B64TOKEN.fullmatch(token) else b""
        elif name == b"x-api-key" and api_key is None:
            token = value.strip(b" \t")
            api_key = token if _B64TOKEN.fullmatch(token) else b""
    return bearer or api_key or None


def keys_from(flags: Iterable[str], environ: Mapping[str, str] = os.environ) -> ApiKeys:
    """The daemon's keys: `--api-key` flags and KAFILA_API_KEYS (comma-separated).

    Raises:
        KafilaError: a key that is too short or not a token (ApiKeys).
    """
    return ApiKeys([*flags, *environ.get(KEYS_ENV, "").split(",")])


def is_loopback(host: str) -> bool:
    """Whether listening on `host` serves this machine only: 127.0.0.0/8, ::1 or localhost."""
    h = host.strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_binding(host: str, keys: ApiKeys, insecure: bool) -> None:
    """Refuse to serve the API without keys on an address other machines can reach.

    Raises:
        KafilaError: `host` is not loopback, there are no keys, and `insecure` is False; a sentence.
    """
    if keys or insecure or is_loopback(host):
        return
    raise KafilaError(f"The HTTP API would listen on {host}, which other machines can reach, with no API key: anyone "
                      "there could use the model and read the session's status. Give a key with --api-key KEY or "
                      f"{KEYS_ENV}=KEY (make one with `openssl rand -hex 24`), listen on 127.0.0.1, or pass "
                      "--http-insecure to serve it open anyway.")


__all__ = ["ApiKeys", "KEYS_ENV", "MIN_KEY_CHARS", "presented_key", "keys_from", "is_loopback", "check_binding"]
