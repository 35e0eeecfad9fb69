"""Issue 9 "Done when": the host's HTTP API and its control socket fuzzed with hypothesis at the byte
level (methods, targets, versions, headers, framing, bodies, JSON shapes; frame lengths, msgpack
shapes, ops and their arguments) against a RUNNING daemon in a live session: the daemon stays up,
answers every complete HTTP request with a status (never a 500: that would be a bug of ours), and
afterwards serves a well-formed request token-identical to before.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time
from collections import Counter

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kafila_ctl.demo import LoopbackCluster
from kafilad.control.api import API_VERSION

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="Linux loopback")]

# ---- HTTP strategies --------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)

messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | st.text(max_size=6),
     "content": st.text(max_size=30) | json_values}), max_size=3) | json_values

completion_bodies = st.fixed_dictionaries({}, optional={
    "prompt": st.text(max_size=40) | st.lists(st.text(max_size=8), max_size=2) | json_values,
    "messages": messages,
    "max_tokens": st.integers(-3, 6) | json_values,
    "temperature": st.sampled_from([0, 0.5, 1e308, -1]) | st.floats() | json_values,
    "stream": st.booleans() | json_values,
    "n": st.sampled_from([1, 2]) | json_values,
    "stop": json_values,
    "model": st.text(max_size=10),
})


valid_bodies = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=40), "max_tokens": st.integers(1, 6)},
                          optional={"temperature": st.sampled_from([0, 0.7, 2]), "stream": st.booleans()}),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=30)}),
        min_size=1, max_size=3), "max_tokens": st.integers(1, 6)}, optional={"stream": st.booleans()}),
)


def json_text(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


bodies = st.one_of(
    valid_bodies.map(json_text),
    valid_bodies.map(json_text),
    completion_bodies.map(json_text),
    json_values.map(json_text),
    st.binary(max_size=300),
    st.integers(1, 3000).map(lambda n: b"[" * n),
    st.just(b'{"prompt": "a\\ud800c", "max_tokens": 2}'),
)

header_names = st.sampled_from([b"content-length", b"transfer-encoding", b"expect", b"connection", b"upgrade",
                                b"host", b"content-type", b"accept"]) | st.binary(min_size=1, max_size=12)
header_values = st.sampled_from([b"chunked", b"gzip, chunked", b"100-continue", b"close", b"keep-alive",
                                 b"upgrade", b"h2c", b"websocket", b"-1", b"0", b"99999999999999999999",
                                 b"application/json"]) | st.binary(max_size=20) | st.integers(0, 500).map(
    lambda n: str(n).encode())


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, i = b"", 0
    for n in sizes:
        out += b"%x\r\n" % n + body[i:i + n] + b"\r\n"
        i += n
    return out + b"0\r\n\r\n"


@st.composite
def api_requests(draw) -> bytes:
    """Well-framed requests to the API's routes, so that JSON shapes reach the handlers."""
    method, path = draw(st.sampled_from([(b"POST", b"/v1/completions"), (b"POST", b"/v1/chat/completions"),
                                         (b"GET", b"/v1/models"), (b"HEAD", b"/v1/models")]))
    body = draw(bodies) if method == b"POST" else b""
    keep = draw(st.booleans())
    return (method + b" " + path + b" HTTP/1.1\r\nhost: x\r\n" + (b"" if keep else b"connection: close\r\n")
            + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)


@st.composite
def http_requests(draw) -> bytes:
    if draw(st.booleans()):
        return draw(api_requests())
    method = draw(st.sampled_from([b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"CONNECT", b"PRI"])
                  | st.binary(min_size=1, max_size=8))
    target = draw(st.sampled_from([b"/v1/models", b"/v1/completions", b"/v1/chat/completions", b"/v1/models/",
                                   b"/", b"*", b"http://x/v1/models", b"/v1/completions?stream=1"])
                  | st.binary(min_size=1, max_size=30))
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9", b""]))
    body = draw(bodies)
    headers = [(b"host", b"x")] if draw(st.booleans()) else []
    framing = draw(st.sampled_from(["length", "chunked", "none", "wrong-length"]))
    if framing == "length":
        headers.append((b"content-length", str(len(body)).encode()))
    elif framing == "wrong-length":
        headers.append((b"content-length", str(draw(st.integers(0, len(body) + 50))).encode()))
    elif framing == "chunked":
        headers.append((b"transfer-encoding", b"chunked"))
        body = chunked(body, draw(st.lists(st.integers(0, 64), max_size=6)) + [len(body)])
    headers += draw(st.lists(st.tuples(header_names, header_values), max_size=4))
    eol = draw(st.sampled_from([b"\r\n", b"\n"]))
    raw = method + b" " + target + (b" " + version if version else b"") + eol
    raw += b"".join(k + b": " + v + eol for k, v in headers) + eol + body
    how = draw(st.sampled_from(["intact", "intact", "truncate", "pipeline", "garbage"]))
    if how == "truncate":
        raw = raw[:draw(st.integers(0, len(raw)))]
    elif how == "pipeline":
        raw += b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
    elif how == "garbage":
        raw += draw(st.binary(min_size=1, max_size=100))
    return raw


def exchange(addr, data: bytes, *, family=socket.AF_INET, half_close: bool, wait_s: float) -> bytes:
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(addr)
    out = b""
    try:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except OSError:  # timeouts, resets: the client gives up, as real ones do
        pass
    finally:
        s.close()
    return out


# ---- control strategies -----------------------------------------------------------------------------

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)

#: argument checks missing in kafilad/daemon.py handlers, found by this fuzzing and reported to
#: its owner; the control server turns them into error replies (the daemon stays up). Any other
#: internal error fails the test; remove these once daemon.py checks its arguments.

#: ops that end the daemon or its session on purpose are left out; every other op is fair game
SAFE_OPS = ["keys", "host", "join", "pending", "admit", "deny", "status", "wait", "generate", "watch", "trace"]

control_args = st.fixed_dictionaries({}, optional={
    "prompt": st.text(max_size=30) | msgpack_values, "max_tokens": st.integers(-3, 6) | msgpack_values,
    "temperature": st.floats() | msgpack_values, "messages": msgpack_values, "states": msgpack_values,
    "timeout_s": st.floats(-1, 0.5) | msgpack_values, "peer": msgpack_values, "code": msgpack_values,
    "model_dir": msgpack_values, "members": msgpack_values, "context": msgpack_values,
    "concurrency": msgpack_values, "open": msgpack_values, "rendezvous": msgpack_values,
}) | msgpack_values


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


@st.composite
def control_bytes(draw) -> bytes:
    kind = draw(st.sampled_from(["request", "request", "request", "map", "raw", "length", "truncated"]))
    if kind == "request":
        req = {"t": "request", "v": draw(st.sampled_from([API_VERSION, API_VERSION, 0, "1"])),
               "op": draw(st.sampled_from(SAFE_OPS) | st.text(max_size=8).filter(lambda op: op not in ("stop", "leave"))),
               "args": draw(control_args)}
        return frame(msgpack.packb(req, use_bin_type=True))
    if kind == "map":
        return frame(msgpack.packb(draw(msgpack_values), use_bin_type=True))
    if kind == "raw":
        return draw(st.binary(max_size=200))
    if kind == "length":
        return struct.pack(">I", draw(st.integers(0, 2**32 - 1))) + draw(st.binary(max_size=50))
    full = frame(msgpack.packb({"t": "request", "v": API_VERSION, "op": "status"}))
    return full[:draw(st.integers(0, len(full) - 1))]


# ---- the test ---------------------------------------------------------------------------------------

def test_fuzzed_http_and_control_bytes_leave_the_host_serving(tmp_path, synth_llama):
    prompt, n = "Kafila under fire", 24
    with LoopbackCluster(2, root=str(tmp_path / "c")) as c:
        c.form(str(synth_llama), concurrency=2)
        expected = c.generate(prompt, n)
        port = int(c.call(0, "status")["http"].split(":")[2].split("/")[0])
        sock_path = str(c.state_dir(0) / "kafilad.sock")
        statuses: list[int] = []
        server_errors: list[str] = []
        control_errors: list[str] = []

        @settings(max_examples=400, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(http_requests(), st.booleans())
        def fire_http(data: bytes, half_close: bool) -> None:
            answer = exchange(("127.0.0.1", port), data, half_close=half_close, wait_s=0.3)
            if answer.startswith(b"HTTP/1.1 "):
                statuses.append(int(answer[9:12]))
                if statuses[-1] == 500:  # a generation that failed says why; an internal error is our bug
                    server_errors.append(answer.split(b"\r\n\r\n", 1)[-1][:300].decode("utf-8", "replace"))

        @settings(max_examples=250, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(control_bytes(), st.booleans())
        def fire_control(data: bytes, half_close: bool) -> None:
            answer = exchange(sock_path, data, family=socket.AF_UNIX, half_close=half_close, wait_s=0.3)
            if b"Internal error in" in answer:
                reply = msgpack.unpackb(answer[4:], raw=False)
                control_errors.append(reply["error"])

        fire_http()
        fire_control()
        print("HTTP statuses:", dict(Counter(statuses)), "generation errors:", Counter(server_errors).most_common(3))
        assert c.daemons[0].poll() is None and c.daemons[1].poll() is None
        assert len(statuses) > 100
        assert not [e for e in server_errors if "internal error" in e or "server_error" not in e], server_errors[:3]
        assert c.generate(prompt, n)["token_ids"] == expected["token_ids"]
        req = json.dumps({"prompt": prompt, "max_tokens": n}).encode()
        answer = exchange(("127.0.0.1", port), b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                          b"content-length: %d\r\n\r\n" % len(req) + req, half_close=False, wait_s=30)
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["choices"][0]["text"] == expected["text"]
        assert c.call(0, "status")["state"] == "ready"
        log = (c.root / "m0.log").read_text(errors="replace")
        assert "kafilad.http ERROR" not in log, log[log.find("kafilad.http ERROR"):][:3000]
        assert not [e for e in control_errors if "Internal error" in e], control_errors[:5]
