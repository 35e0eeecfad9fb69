"""Issue 9, measured as a user would: hostile connection patterns against a RUNNING host daemon.

- 2,100 idle TCP connections to the HTTP port of a daemon that may hold only 1,024 file handles:
  the control socket and the API still answer (separate limits; idle connections make room).
  That they answer is asserted, within a hang guard, not how fast: a loaded machine is slow.
- 100 unfinished 4 MB bodies and 8 unfinished large control frames: the daemon's memory stays
  bounded (a total, not per connection) and the excess is answered 413 / 503 / 408 (each with
  Retry-After; none reset) or an error reply.
- A streaming client that never reads slows only itself: another request is served meanwhile.
"""

from __future__ import annotations

import json
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import trio

from kafila_ctl.demo import LoopbackCluster

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="Linux /proc and rlimits")]


class TightFileLimitCluster(LoopbackCluster):
    """Daemons whose hard limit is 1,024 open files (a common default), so they cannot raise it."""

    def start_daemon(self, i: int) -> subprocess.Popen:
        self.state_dir(i).mkdir(parents=True, exist_ok=True)
        log = open(self.root / f"{self.names[i]}.log", "ab")
        return subprocess.Popen(self.daemon_argv(i), stdout=log, stderr=log, env=self.daemon_env(i),
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)))


#: seconds after which an answer that has not come is a hung test (what is asserted is that it comes)
HANG_GUARD_S = 60.0


def call_within(c: LoopbackCluster, i: int, op: str, **args):
    """`c.call(i, op, **args)`, failing the test (trio.TooSlowError) after HANG_GUARD_S without an answer."""
    async def call():
        with trio.fail_after(HANG_GUARD_S):
            return await c.client(i).call(op, **args)
    return trio.run(call)


def http_port(c: LoopbackCluster) -> int:
    return int(c.call(0, "status")["http"].split(":")[2].split("/")[0])


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def get(port: int, path: str = "/v1/models", timeout_s: float = 10) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_idle_connection_flood_never_starves_the_control_socket_or_the_api(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2_300:
        pytest.skip(f"this test process may open only {soft} files")
    with TightFileLimitCluster(1, root=str(tmp_path / "c")) as c:
        port = http_port(c)
        idle = []
        try:
            for _ in range(2_100):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            time.sleep(1.0)
            snap = call_within(c, 0, "status")  # answered at all: a starved socket would leave it unanswered
            assert snap["state"] == "idle"
            status, body = get(port, timeout_s=HANG_GUARD_S)
            assert status == 503 and "No session is being served" in body["error"]["message"]
        finally:
            for s in idle:
                s.close()
        assert c.daemons[0].poll() is None
        log = (c.root / "m0.log").read_text(errors="replace")
        assert "Traceback" not in log and "EMFILE" not in log and "Too many open files" not in log


def test_unfinished_bodies_and_control_frames_are_bounded_in_total(tmp_path):
    with LoopbackCluster(1, root=str(tmp_path / "c")) as c:
        port, pid = http_port(c), c.daemons[0].pid
        before = rss_bytes(pid)
        conns, refused = [], 0
        chunk = b"x" * (1 << 20)
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 4194304\r\n\r\n")
            try:
                for _ in range(3):
                    s.sendall(chunk)
            except OSError:
                pass
            conns.append(s)
        time.sleep(1.0)
        evicted = 0
        for s in conns:
            s.settimeout(0.2)
            try:
                head = s.recv(4096)  # a reset would raise here: none may be
            except socket.timeout:
                continue
            if head.startswith(b"HTTP/1.1 413 "):
                assert b"retry-after: 1" in head and b"its limit; retry shortly." in head
                refused += 1
            elif head.startswith((b"HTTP/1.1 408 ", b"HTTP/1.1 503 ")):  # closed to make room, or past the
                assert b"retry-after: 1" in head and b"retry shortly" in head or b"send it again" in head  # limit
                evicted += 1  # of connections per address (issue 22 §4)
        grown = rss_bytes(pid) - before
        # bytes held count as they arrive (3 MiB each): about 21 fit in 64 MiB, the rest are told why
        assert refused + evicted >= 100 - 22 and grown < 120 * (1 << 20), (refused, evicted, grown)
        for s in conns:
            s.close()

        # control frames: one over 16 MiB is refused from its header; unfinished ones share 64 MiB
        sock_path = str(c.state_dir(0) / "kafilad.sock")
        frames, replies = [], 0
        for _ in range(8):
            u = socket.socket(socket.AF_UNIX)
            u.connect(sock_path)
            u.sendall(struct.pack(">I", 15 << 20))
            try:
                u.settimeout(5)
                for _ in range(14):
                    u.sendall(chunk)
            except OSError:
                pass
            frames.append(u)
        time.sleep(1.0)
        for u in frames:
            u.settimeout(0.2)
            try:
                if b"unfinished control requests, its limit" in u.recv(4096):
                    replies += 1
            except (socket.timeout, ConnectionResetError):
                pass
        assert replies >= 4 and rss_bytes(pid) - before < 120 * (1 << 20), (replies, rss_bytes(pid) - before)
        big = socket.socket(socket.AF_UNIX)
        big.connect(sock_path)
        big.sendall(struct.pack(">I", 60 << 20))
        big.settimeout(5)
        said = b""
        while chunk_in := big.recv(4096):  # refused from the length alone: an error reply, then the close
            said += chunk_in
        assert b"length prefix announces 62914560 bytes" in said and len(said) < 4096, said
        for u in [*frames, big]:
            u.close()
        assert c.call(0, "status")["state"] == "idle" and c.daemons[0].poll() is None


def test_a_streaming_client_that_never_reads_slows_only_itself(tmp_path, synth_llama):
    with LoopbackCluster(2, root=str(tmp_path / "c")) as c:
        c.form(str(synth_llama), concurrency=2)
        port = http_port(c)
        expected = c.generate("Kafila serves", 8)
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(("127.0.0.1", port))
        body = json.dumps({"prompt": "a", "max_tokens": 480, "stream": True}).encode()
        stuck.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.5)
        results = []

        def normal():
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(
                {"prompt": "Kafila serves", "max_tokens": 8}).encode())
            with urllib.request.urlopen(req, timeout=60) as r:
                results.append(json.loads(r.read())["choices"][0]["text"])

        t = threading.Thread(target=normal)
        t.start()
        t.join(HANG_GUARD_S)
        assert results == [expected["text"]]
        # served, and not by the server giving up on the stuck client first (its send timeout, 30 s,
        # cancels that request: a `generation` record with finish_reason "cancelled")
        gens = [r for r in c.call(0, "trace") if r["event"] == "generation"]
        assert [r for r in gens if r["finish_reason"] == "cancelled"] == [], gens
        stuck.close()
        assert c.call(0, "status")["state"] == "ready"
