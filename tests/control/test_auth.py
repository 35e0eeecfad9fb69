"""API keys of the HTTP API (kafilad/control/auth.py, issue 22 §3): how a key is presented and
compared, which routes ask for it, each API's 401 shape, the binding rule, and the web page's own
origin on a real socket at a non-loopback address."""

from __future__ import annotations

import json
import socket
import sys
from functools import partial

import pytest
import trio
from hypothesis import given, settings, strategies as st

from kafilad.proto.status import NodeStatus
from kafilad.control import openai_api
from kafilad.control.auth import ApiKeys, check_binding, is_loopback, keys_from, presented_key
from kafilad.control.http_server import HttpServer
from kafilad.errors import KafilaError
from kafilad.control.node_view import SessionOnly

from control.http_harness import http_request

KEY = "k3y-0123456789abcdef-XYZ"
OTHER = "another-key-0123456789"
IDLE = SessionOnly(None, NodeStatus.from_json({"role": None, "state": "idle", "name": "anvil"}))


async def exchange(raw: bytes, keys: ApiKeys) -> tuple[int, dict, bytes]:
    server = HttpServer(partial(openai_api.handle, IDLE, keys=keys))
    client, srv = trio.testing.memory_stream_pair()
    out = bytearray()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_stream, srv)
        await client.send_all(raw)
        while data := await client.receive_some(65536):
            out += data
    head, _, body = bytes(out).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    return int(lines[0].split()[1]), {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}, body


def call(method: str, path: str, headers: dict | None = None, keys: ApiKeys = ApiKeys([KEY, OTHER])):
    return trio.run(exchange, http_request(method, path, headers), keys)


# ---- presenting and comparing a key ------------------------------------------------------------

@pytest.mark.parametrize("headers, key", [
    ([(b"authorization", b"Bearer " + KEY.encode())], KEY.encode()),            # OpenAI's and Ollama's clients
    ([(b"authorization", b"bearer  " + KEY.encode())], KEY.encode()),           # the scheme is case-insensitive
    ([(b"x-api-key", KEY.encode())], KEY.encode()),                             # Anthropic's clients
    ([(b"authorization", b"Basic " + KEY.encode())], None),
    ([(b"authorization", b"Bearer"), (b"x-api-key", KEY.encode())], KEY.encode()),  # a malformed bearer: x-api-key
    ([(b"authorization", b"Bearer a b")], None),
    ([(b"authorization", b"Bearer " + KEY.encode()), (b"authorization", b"Bearer x")], KEY.encode()),  # the first
    ([(b"authorization", b"Bearer \xff\xfe")], None),
    ([], None),
])
def test_the_key_a_request_presents(headers, key):
    assert presented_key(headers) == key


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([b"authorization", b"x-api-key", b"host", b"cookie"]),
                          st.one_of(st.binary(max_size=60),
                                    st.builds(lambda p, k: p + k, st.sampled_from([b"Bearer ", b"bearer ", b"BEARER\t",
                                                                                   b"Bearer  ", b"", b"Token "]),
                                              st.sampled_from([KEY.encode(), OTHER.encode(), KEY.encode()[:-1],
                                                               KEY.encode() + b"=", b"x" * 30])))),
                max_size=5))
def test_hostile_headers_never_raise_and_open_the_api_only_with_a_key(headers):
    """Any header bytes: parsing never raises; the API opens exactly when the first Authorization
    header (or, with none valid, the first x-api-key) carries one of the keys, byte for byte."""
    keys = ApiKeys([KEY, OTHER])
    got = presented_key(headers)
    assert got is None or (isinstance(got, bytes) and got)
    auth = [v for n, v in headers if n == b"authorization"]
    xkey = [v for n, v in headers if n == b"x-api-key"]
    presented = None
    if auth:
        scheme, _, token = auth[0].strip().partition(b" ")
        if scheme.lower() == b"bearer" and token.strip(b" \t") and all(
                chr(c).isalnum() and c < 128 or chr(c) in "-._~+/=" for c in token.strip(b" \t")):
            presented = token.strip(b" \t")
    if presented is None and xkey and xkey[0].strip(b" \t"):
        presented = xkey[0].strip(b" \t")
    expected = presented if presented in (KEY.encode(), OTHER.encode()) else None
    assert keys.allows(headers) is (expected is not None), (headers, got)


def test_keys_are_checked_and_compared_whole():
    keys = ApiKeys([KEY])
    assert keys.opens(KEY.encode()) and not keys.opens(KEY.encode()[:-1]) and not keys.opens(KEY.encode() + b"x")
    assert not keys.opens(None) and not ApiKeys().opens(KEY.encode()) and ApiKeys().allows([])
    with pytest.raises(KafilaError, match="at least 16 characters long"):
        ApiKeys(["short"])
    with pytest.raises(KafilaError, match="only letters, digits"):
        ApiKeys(["has a space in it, quite long"])
    both = keys_from([KEY], {"KAFILA_API_KEYS": f" {OTHER} ,,"})
    assert len(both) == 2 and both.opens(OTHER.encode()) and both.opens(KEY.encode())
    assert not keys_from([], {})


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("[::1]", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("192.0.2.2", False), ("example.org", False)])
def test_binding_anything_but_loopback_needs_a_key_or_insecure(host, loopback):
    assert is_loopback(host) is loopback
    check_binding(host, ApiKeys([KEY]), insecure=False)
    check_binding(host, ApiKeys(), insecure=True)
    if loopback:
        check_binding(host, ApiKeys(), insecure=False)
    else:
        with pytest.raises(KafilaError, match="--api-key KEY or KAFILA_API_KEYS=KEY.*--http-insecure"):
            check_binding(host, ApiKeys(), insecure=False)


# ---- routes ---------------------------------------------------------------------------------------

def test_without_a_key_each_api_answers_401_in_its_own_shape():
    status, headers, body = call("GET", "/v1/models")
    assert status == 401 and headers["www-authenticate"].startswith("Bearer")
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert "Authorization: Bearer KEY" in error["message"]
    status, _, body = call("POST", "/v1/chat/completions", {"authorization": "Bearer wrong-key-0123456789"})
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    for path in ("/api/tags", "/api/version", "/api/nothing", "/api/kafila/status"):
        status, _, body = call("GET", path)
        assert status == 401 and set(json.loads(body)) == {"error"}, path  # Ollama's shape


def test_a_key_opens_every_route_and_the_page_and_health_need_none():
    status, _, body = call("GET", "/api/tags", {"authorization": f"Bearer {KEY}"})
    assert status == 200 and json.loads(body) == {"models": []}
    status, _, body = call("GET", "/api/kafila/status", {"x-api-key": OTHER})
    assert status == 200 and json.loads(body)["node"] == "anvil"
    status, _, body = call("GET", "/v1/models", {"authorization": f"bearer {KEY}"})
    assert status == 503  # past the key: no session is served
    for path in ("/", "/app.js", "/style.css"):
        assert call("GET", path)[0] == 200, path
    status, _, body = call("GET", "/health")
    assert status == 503 and json.loads(body) == {"status": "unavailable"}
    status, headers, _ = call("OPTIONS", "/v1/chat/completions", {"origin": "http://localhost:3000",
                                                                  "access-control-request-method": "POST",
                                                                  "access-control-request-headers": "authorization"})
    assert status == 204 and headers["access-control-allow-headers"] == "authorization"  # preflights carry no key
    status, _, body = call("GET", "/v1/models", keys=ApiKeys())
    assert status == 503  # no keys: the API is open


# ---- the page's own origin, at a non-loopback address, on real sockets -------------------------

def outside_ip() -> str | None:
    """An address of this machine other than loopback, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


async def real_call(ip: str, keys: ApiKeys, host: str, origin: str, key: str | None) -> tuple[int, dict, bytes]:
    server = HttpServer(partial(openai_api.handle, IDLE, keys=keys))
    listeners = await trio.open_tcp_listeners(0, host=ip)
    port = listeners[0].socket.getsockname()[1]
    headers = {"origin": origin.replace("PORT", str(port)), "content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    raw = http_request("POST", "/v1/chat/completions", headers, b'{"messages": [{"role": "user", "content": "hi"}]}')
    raw = raw.replace(b"host: x\r\n", f"host: {host.replace('PORT', str(port))}\r\n".encode())
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve, listeners)
            s = await trio.open_tcp_stream(ip, port)
            await s.send_all(raw)
            out = bytearray()
            while data := await s.receive_some(65536):
                out += data
            nursery.cancel_scope.cancel()
    head, _, body = bytes(out).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    return int(lines[0].split()[1]), {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}, body


@pytest.mark.skipif(outside_ip() is None, reason="this machine has no address but loopback")
def test_the_page_opened_at_the_lan_address_may_call_the_api():
    """Issue 22 §3: the page opened at http://LAN-IP:PORT posted from its own origin and got 403."""
    ip = outside_ip()
    own = "http://" + ip + ":PORT"
    # no keys (an --http-insecure host): its own IP origin passes CORS (503: no session), a rebound name does not
    status, headers, _ = trio.run(real_call, ip, ApiKeys(), ip + ":PORT", own, None)
    assert status == 503 and headers["access-control-allow-origin"].startswith(own[:-4])
    status, _, body = trio.run(real_call, ip, ApiKeys(), "rebound.example:PORT", "http://rebound.example:PORT", None)
    assert status == 403 and "may not call this API" in json.loads(body)["error"]["message"]
    # with keys: its own origin, by IP or by name, needs the key, then passes
    status, _, body = trio.run(real_call, ip, ApiKeys([KEY]), ip + ":PORT", own, None)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, headers, _ = trio.run(real_call, ip, ApiKeys([KEY]), ip + ":PORT", own, KEY)
    assert status == 503 and headers["access-control-allow-origin"].startswith(own[:-4])
    status, headers, _ = trio.run(real_call, ip, ApiKeys([KEY]), "kafila.lan:PORT", "http://kafila.lan:PORT", KEY)
    assert status == 503 and headers["access-control-allow-origin"].startswith("http://kafila.lan:")
    # another site's page is still refused, key or not
    status, _, _ = trio.run(real_call, ip, ApiKeys([KEY]), ip + ":PORT", "https://evil.example", KEY)
    assert status == 403


@settings(max_examples=400, deadline=None)
@given(origin=st.one_of(st.text(max_size=40), st.sampled_from(["http://192.0.2.2:8400", "https://192.0.2.2:8400",
                                                               "http://kafila.lan:8400", "http://[fe80::1]:8400",
                                                               "http://user@192.0.2.2:8400", "http://192.0.2.2:8400/x"])),
       host=st.one_of(st.text(max_size=30), st.sampled_from(["192.0.2.2:8400", "kafila.lan:8400", "[fe80::1]:8400"])),
       local=st.sampled_from([None, "192.0.2.2", "fe80::1", "127.0.0.1"]), keyed=st.booleans())
def test_hostile_origin_and_host_headers_never_raise_and_only_the_own_origin_passes(origin, host, local, keyed):
    """Any Origin and Host: the CORS check never raises; a non-local origin passes only as the API's
    own (scheme http/https, no user or path, its host:port equal to Host, and that host the IP the
    connection arrived at, or any name once the API has keys)."""
    from urllib.parse import urlsplit
    from kafilad.control.cors import origin_allowed
    from kafilad.control.http_server import Request
    req = Request(method="POST", target="/", path="/", headers=((b"host", host.encode("utf-8", "replace")),),
                  body=b"", http_version="1.1", local_ip=local)
    allowed = origin_allowed(origin, {}, request=req, keyed=keyed)
    assert isinstance(allowed, bool)
    if allowed and not origin_allowed(origin, {}):  # passed as the API's own origin, not a local one
        parts = urlsplit(origin)
        assert parts.scheme in ("http", "https") and parts.username is None and parts.path in ("", "/")
        assert parts.netloc.lower() == host.encode("utf-8", "replace").decode("latin-1").strip().lower()
        assert keyed or parts.hostname.strip("[]") == local
