"""The host API's rules for browser clients (DESIGN §7).

Browser clients (CORS, https://fetch.spec.whatwg.org/#http-cors-protocol): a request whose
`Origin` is allowed gets `Access-Control-Allow-Origin` (that origin) and `Vary: Origin`; the
allowed origins are the host's own machine (http or https, any port, on localhost, 127.0.0.1,
[::1] or 0.0.0.0), as Ollama allows by default, plus those listed in `KAFILA_HTTP_ORIGINS`
(comma-separated origins, or `*` for any), plus the API's own origin: the page it serves, opened
at whatever address the API is bound to (http://LAN-IP:PORT: issue 22 §3). Its own origin is one
whose host and port are the request's `Host`, when that host is the IP address the connection
arrived at, or any name when the API has keys. (Without keys a name is not trusted: a page of
another site whose name was rebound to this address would send its own name as Host; with keys
such a page lacks the key, which the real page keeps in its own origin's storage.) A preflight (`OPTIONS` with
`Access-Control-Request-Method`) is answered 204 with the path's methods and the requested
headers (and `Access-Control-Allow-Private-Network` when asked, for Chrome's Private Network
Access), or 403 with a sentence for an origin not allowed; so is any other request but GET and HEAD
from an origin not allowed (`refuse_foreign_origin`: a simple cross-origin POST needs no preflight).
"""

from __future__ import annotations

import ipaddress
import os
import re
from urllib.parse import urlsplit

from kafilad.control.api_common import HttpError, shown

#: environment variable: extra origins allowed to call the API from a browser (comma-separated, or *)
ORIGINS_ENV = "KAFILA_HTTP_ORIGINS"
#: how long a browser may cache a preflight answer (s)
PREFLIGHT_MAX_AGE_S = 600
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]", "::1", "0.0.0.0")
_HEADER_TOKEN = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")


def origin_allowed(origin: str, environ=os.environ, *, request=None, keyed: bool = False) -> bool:
    """Whether a browser page of `origin` may call the API (module docstring).

    Args:
        request: the request (kafilad/control/http_server.py Request), for the API's own origin.
        keyed: whether the API has keys (a name in Host then counts as its own origin).
    """
    extra = [o.strip().rstrip("/") for o in environ.get(ORIGINS_ENV, "").split(",") if o.strip()]
    if "*" in extra or origin.rstrip("/") in extra:
        return True
    try:
        parts = urlsplit(origin)
        host = parts.hostname
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or host is None:
        return False
    return host in _LOCAL_HOSTS or f"[{host}]" in _LOCAL_HOSTS or own_origin(parts, request, keyed)


def own_origin(parts, request, keyed: bool) -> bool:
    """Whether the origin split into `parts` is the API's own as `request` reached it (module docstring)."""
    if request is None or parts.username is not None or parts.path not in ("", "/"):
        return False
    host_header = (request.header(b"host") or b"").decode("latin-1").strip().lower()
    if not host_header or parts.netloc.lower() != host_header:
        return False
    if keyed:
        return True
    local = getattr(request, "local_ip", None)
    if local is None:
        return False
    try:
        return ipaddress.ip_address(parts.hostname) == ipaddress.ip_address(local.split("%")[0])
    except ValueError:
        return False


def cors_headers(request, *, keyed: bool = False) -> list[tuple[str, str]]:
    """The CORS headers of an answer to `request` (none when it has no allowed Origin)."""
    origin = request.header(b"origin")
    if origin is None:
        return []
    o = origin.decode("latin-1")
    allowed = origin_allowed(o, request=request, keyed=keyed)
    return [("access-control-allow-origin", o), ("vary", "origin")] if allowed else [("vary", "origin")]


def refuse_foreign_origin(request, *, keyed: bool = False) -> None:
    """Refuse a request that changes or spends something (any method but GET, HEAD, OPTIONS) sent by
    a browser page of an origin not allowed. A "simple" cross-origin POST (text/plain, no
    preflight) reaches the server whatever CORS says: the page could not read the answer, but its
    generation would run on the ring.

    Raises:
        HttpError: 403 with a sentence naming the origin.
    """
    if request.method in ("GET", "HEAD", "OPTIONS"):
        return
    origin = request.header(b"origin")
    if origin is not None and not origin_allowed(origin.decode("latin-1"), request=request, keyed=keyed):
        raise _foreign(origin.decode("latin-1"))


def preflight_headers(request, methods: tuple[str, ...], *, keyed: bool = False) -> list[tuple[str, str]]:
    """The headers of a 204 answer to a CORS preflight of a path serving `methods`.

    Raises:
        HttpError: 403 when the page's origin is not allowed.
    """
    origin = (request.header(b"origin") or b"").decode("latin-1")
    if not origin_allowed(origin, request=request, keyed=keyed):
        raise _foreign(origin)
    asked = (request.header(b"access-control-request-headers") or b"").decode("latin-1")
    names = [h.strip() for h in asked.split(",") if h.strip()]
    allowed = ", ".join(h for h in names if _HEADER_TOKEN.match(h)) or "authorization, content-type"
    out = [("access-control-allow-origin", origin), ("vary", "origin"),
           ("access-control-allow-methods", ", ".join((*methods, "OPTIONS"))),
           ("access-control-allow-headers", allowed), ("access-control-max-age", str(PREFLIGHT_MAX_AGE_S))]
    if (request.header(b"access-control-request-private-network") or b"").lower() == b"true":
        out.append(("access-control-allow-private-network", "true"))
    return out


def _foreign(origin: str) -> HttpError:
    """The 403 for a browser page of an origin not allowed."""
    return HttpError(403, f"Browser pages from the origin '{shown(origin)}' may not call this API; the host "
                          f"allows its own machine's origins, its own page (at an IP address, or at any name once "
                          f"the API has keys), and those listed in {ORIGINS_ENV}.", "permission_denied")
