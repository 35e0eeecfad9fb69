#!/usr/bin/env python3
"""Load test of the host's HTTP API (issue 9 "Done when"): many concurrent clients mixing normal,
slow and hostile requests against a 3-member ring on loopback, for a fixed time.

    python scripts/load_test.py                          # 200 clients, 60 s, synthesised model
    python scripts/load_test.py --clients 50 --duration 10 --json /tmp/load.json

A rendezvous and three daemons run as separate processes (kafila_ctl/demo.py LoopbackCluster);
the first hosts the session (`--concurrency`, default 4; queue 4x). Each client runs for the whole
duration, one request after another, in one of three roles (by index: 60% normal, 20% slow,
20% hostile):

- normal: a completion (`max_tokens` 4-24, streaming or not, greedy). It must be served (200
  with its tokens) or refused with 429 (the client then waits its `Retry-After`, capped at 2 s).
  Anything else counts as a failure, with its reason.
- slow: a streaming request whose client reads one chunk a second with a 1 KiB receive buffer;
  a body sent one byte a second (the server answers 408); headers sent one line a second; an idle
  connection held open.
- hostile: the inputs of issue 9 that once killed the daemon (HEAD, a non-UTF-8 body, 1,100 nested
  arrays, lone surrogates, a 400-digit temperature), malformed JSON and chat shapes, garbage bytes,
  an oversized Content-Length (413), a reset in the middle of a body. (A chat template that refuses
  its messages needs a model with such a template: tests/e2e/test_openai_api.py covers it.)

Meanwhile the script checks every second that every daemon is alive and that the control socket
answers (`status`, its latency kept), and samples each daemon's RSS. At the end one well-formed
request must be served token-identical to the same request before the load. It prints a summary
(and writes it as JSON with `--json`); the exit status is 0 only when no daemon exited, every
normal request was served or refused with 429, and the final request matched.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import time
from collections import Counter
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kafila_ctl.demo import LoopbackCluster  # noqa: E402

PROMPTS = ["Once upon a time", "Kafila serves", "The ring of machines", "A caravan crossed", "Hello"]

#: the inputs of issue 9's table (and their kin), as raw requests
HOSTILE = {
    "head": b"HEAD /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    "non_utf8": b"\xff",
    "deep_nesting": b"[" * 1100,
    "lone_surrogate": b'{"prompt": "a\\ud800c", "max_tokens": 2}',
    "chat_surrogate": b'{"messages": [{"role": "user", "content": "a\\udfffc"}], "max_tokens": 2}',
    "huge_number": b'{"prompt": "Once", "max_tokens": 2, "temperature": 1' + b"0" * 400 + b"}",
    "bad_json": b'{"prompt": "Once", "max_tokens": ',
    "wrong_types": b'{"prompt": ["a", "b"], "max_tokens": true, "stream": "yes"}',
    "chat_shape": b'{"messages": [{"role": 5}], "max_tokens": 2}',
}


def request_bytes(path: str, body: bytes, *, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n{extra}\r\n").encode() + body


async def exchange(port: int, data: bytes, *, timeout_s: float = 120, rcvbuf: int = 0) -> bytes:
    """Send `data`, read to EOF; the raw answer."""
    with trio.fail_after(timeout_s):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        if rcvbuf:
            stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        async with stream:
            await stream.send_all(data)
            out = b""
            while True:
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                if not chunk:
                    break
                out += chunk
            return out


def status_of(raw: bytes) -> int:
    try:
        return int(raw.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def header(raw: bytes, name: str) -> str | None:
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    for line in head.split("\r\n")[1:]:
        k, _, v = line.partition(":")
        if k.strip() == name:
            return v.strip()
    return None


class Load:
    def __init__(self, port: int, duration_s: float, seed: int):
        self.port = port
        self.end_s = 0.0
        self.duration_s = duration_s
        self.rng = random.Random(seed)
        self.outcomes: dict[str, Counter] = {"normal": Counter(), "slow": Counter(), "hostile": Counter()}
        self.failures: list[str] = []
        self.normal_latency_s: list[float] = []
        self.normal_tokens = 0

    def running(self) -> bool:
        return trio.current_time() < self.end_s

    # ---- normal -------------------------------------------------------------------------------
    async def normal(self, i: int) -> None:
        rng = random.Random(i)
        while self.running():
            stream = rng.random() < 0.3
            n = rng.randint(4, 24)
            body = json.dumps({"prompt": rng.choice(PROMPTS), "max_tokens": n, "stream": stream}).encode()
            t0 = trio.current_time()
            try:
                raw = await exchange(self.port, request_bytes("/v1/completions", body))
            except (OSError, trio.TooSlowError, trio.BrokenResourceError) as e:
                self._fail(f"normal: {type(e).__name__}: {e}")
                continue
            status = status_of(raw)
            if status == 200:
                ok = self._check_served(raw, stream, n)
                if ok:
                    self.outcomes["normal"]["served"] += 1
                    self.normal_latency_s.append(trio.current_time() - t0)
                else:
                    self._fail(f"normal: a malformed 200 answer: {raw[:200]!r}")
            elif status == 429:
                self.outcomes["normal"]["refused_429"] += 1
                retry = header(raw, "retry-after")
                if retry is None:
                    self._fail("normal: a 429 without Retry-After")
                await trio.sleep(min(2.0, float(retry or 1)) * rng.uniform(0.5, 1.0))
            else:
                self._fail(f"normal: status {status}: {raw[:300]!r}")

    def _check_served(self, raw: bytes, stream: bool, n: int) -> bool:
        body = raw.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in raw else b""
        if not stream:
            try:
                out = json.loads(body)
            except ValueError:
                return False
            self.normal_tokens += out["usage"]["completion_tokens"]
            return 1 <= out["usage"]["completion_tokens"] <= n
        text = body.decode("utf-8", "replace")
        if "data: [DONE]" not in text or '"error"' in text:
            return False
        self.normal_tokens += text.count('"text": ') - 1
        return True

    def _fail(self, reason: str) -> None:
        self.outcomes["normal"]["failed"] += 1
        if len(self.failures) < 50:
            self.failures.append(reason)

    # ---- slow ---------------------------------------------------------------------------------
    async def slow(self, i: int) -> None:
        rng = random.Random(1000 + i)
        kinds = [self.slow_reader, self.slow_body, self.slow_headers, self.idle]
        while self.running():
            kind = rng.choice(kinds)
            try:
                outcome = await kind(rng)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                outcome = "connection closed by the server"
            except trio.TooSlowError:
                outcome = "gave up (client timeout)"
            self.outcomes["slow"][f"{kind.__name__}: {outcome}"] += 1

    async def slow_reader(self, rng) -> str:
        body = json.dumps({"prompt": rng.choice(PROMPTS), "max_tokens": 64, "stream": True}).encode()
        with trio.fail_after(90):
            stream = await trio.open_tcp_stream("127.0.0.1", self.port)
            stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            async with stream:
                await stream.send_all(request_bytes("/v1/completions", body))
                got = b""
                while self.running() and len(got) < 2_000_000:
                    chunk = await stream.receive_some(256)
                    if not chunk:
                        break
                    got += chunk
                    await trio.sleep(1.0)
                return f"status {status_of(got)}" + (", done" if b"[DONE]" in got else "")

    async def slow_body(self, rng) -> str:
        with trio.fail_after(90):
            stream = await trio.open_tcp_stream("127.0.0.1", self.port)
            async with stream:
                body = json.dumps({"prompt": "Once", "max_tokens": 2}).encode()
                await stream.send_all(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}"
                                      "\r\n\r\n".encode())
                for b in body:
                    await stream.send_all(bytes([b]))
                    await trio.sleep(1.0)
                    if not self.running():
                        return "ended with the test"
                return f"status {status_of(await stream.receive_some(65536))}"

    async def slow_headers(self, rng) -> str:
        with trio.fail_after(90):
            stream = await trio.open_tcp_stream("127.0.0.1", self.port)
            async with stream:
                await stream.send_all(b"GET /v1/models HTTP/1.1\r\n")
                for n in range(60):
                    await stream.send_all(f"x-slow-{n}: y\r\n".encode())
                    await trio.sleep(1.0)
                    if not self.running():
                        return "ended with the test"
                return f"status {status_of(await stream.receive_some(65536))}"

    async def idle(self, rng) -> str:
        with trio.fail_after(90):
            stream = await trio.open_tcp_stream("127.0.0.1", self.port)
            async with stream:
                with trio.move_on_at(min(self.end_s, trio.current_time() + rng.uniform(5, 20))):
                    data = await stream.receive_some(1024)
                    return "closed by the server" if not data else f"status {status_of(data)}"
                return "held"

    # ---- hostile ------------------------------------------------------------------------------
    async def hostile(self, i: int) -> None:
        rng = random.Random(2000 + i)
        names = list(HOSTILE) + ["garbage", "oversized", "reset_mid_body", "chat_empty"]
        while self.running():
            name = rng.choice(names)
            try:
                outcome = await self._hostile_one(name, rng)
            except (OSError, trio.BrokenResourceError):
                outcome = "connection closed"
            except trio.TooSlowError:
                outcome = "no answer (client timeout)"
            self.outcomes["hostile"][f"{name}: {outcome}"] += 1
            await trio.sleep(rng.uniform(0.05, 0.5))

    async def _hostile_one(self, name: str, rng) -> str:
        if name == "head":
            raw = await exchange(self.port, HOSTILE["head"], timeout_s=30)
        elif name in HOSTILE:
            path = "/v1/chat/completions" if name.startswith("chat") else "/v1/completions"
            raw = await exchange(self.port, request_bytes(path, HOSTILE[name]), timeout_s=30)
        elif name == "chat_empty":  # no messages at all
            body = json.dumps({"messages": [], "max_tokens": 2}).encode()
            raw = await exchange(self.port, request_bytes("/v1/chat/completions", body), timeout_s=30)
        elif name == "garbage":
            raw = await exchange(self.port, bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 4096))),
                                 timeout_s=30)
        elif name == "oversized":
            raw = await exchange(self.port, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                                            b"content-length: 900000000\r\n\r\n{", timeout_s=30)
        else:  # reset in the middle of a body
            with trio.fail_after(30):
                s = socket.socket()
                s.setblocking(False)
                try:
                    await trio.socket.from_stdlib_socket(s).connect(("127.0.0.1", self.port))
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    s.send(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"pro")
                finally:
                    s.close()
            return "reset sent"
        return f"status {status_of(raw)}"


def rss_kib(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


async def monitor(c: LoopbackCluster, load: Load, report: dict) -> None:
    peak = {n: 0 for n in c.names}
    status_ms: list[float] = []
    exits: dict = {}
    client = c.client(0)
    while load.running():
        for i, p in enumerate(c.daemons):
            peak[c.names[i]] = max(peak[c.names[i]], rss_kib(p.pid))
            if p.poll() is not None and c.names[i] not in exits:
                exits[c.names[i]] = p.returncode
        t0 = time.perf_counter()
        try:
            with trio.fail_after(10):
                snap = await client.call("status")
            status_ms.append((time.perf_counter() - t0) * 1e3)
            report["max_running"] = max(report.get("max_running", 0), snap["requests"]["running"])
            report["max_queued"] = max(report.get("max_queued", 0), snap["requests"]["queued"])
        except Exception as e:  # noqa: BLE001 - a control socket that does not answer is a finding
            report.setdefault("control_errors", []).append(repr(e)[:200])
        await trio.sleep(1.0)
    report["peak_rss_mib"] = {n: round(k / 1024, 1) for n, k in peak.items()}
    report["daemon_exits"] = exits
    status_ms.sort()
    report["control_status_ms"] = {"n": len(status_ms), "median": round(status_ms[len(status_ms) // 2], 1),
                                   "max": round(status_ms[-1], 1)} if status_ms else None


async def run_load(c: LoopbackCluster, port: int, *, clients: int, duration_s: float, seed: int) -> dict:
    load = Load(port, duration_s, seed)
    report: dict = {}
    n_normal = int(clients * 0.6)
    n_slow = int(clients * 0.2)
    n_hostile = clients - n_normal - n_slow
    load.end_s = trio.current_time() + duration_s
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(monitor, c, load, report)
        for i in range(n_normal):
            nursery.start_soon(load.normal, i)
        for i in range(n_slow):
            nursery.start_soon(load.slow, i)
        for i in range(n_hostile):
            nursery.start_soon(load.hostile, i)
    lat = sorted(load.normal_latency_s)
    report.update(clients={"normal": n_normal, "slow": n_slow, "hostile": n_hostile},
                  wall_s=round(time.perf_counter() - t0, 1),
                  outcomes={k: dict(v) for k, v in load.outcomes.items()}, failures=load.failures,
                  normal_tokens=load.normal_tokens,
                  normal_latency_s={"median": round(lat[len(lat) // 2], 2), "p95": round(lat[int(len(lat) * 0.95)], 2),
                                    "max": round(lat[-1], 2)} if lat else None)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=4, help="the session's --concurrency")
    p.add_argument("--model", help="model directory (default: a synthesised Llama-shaped model)")
    p.add_argument("--seed", type=int, default=9)
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    if args.model is None:
        from kafilad.executor.synth import synthesize_model
        import tempfile
        model = synthesize_model(Path(tempfile.mkdtemp(prefix="kafila-load-")) / "synth-llama", arch="llama",
                                 seed=7, num_hidden_layers=6, hidden_size=64)
    else:
        model = Path(args.model)
    with LoopbackCluster(3) as c:
        c.form(str(model), concurrency=args.concurrency, context=512)
        status = c.call(0, "status")
        port = int(status["http"].rsplit(":", 1)[1].split("/")[0])
        reference = c.generate("Kafila serves", 16)["token_ids"]
        report = trio.run(lambda: run_load(c, port, clients=args.clients, duration_s=args.duration, seed=args.seed))
        alive = [c.names[i] for i, d in enumerate(c.daemons) if d.poll() is None]
        after = c.generate("Kafila serves", 16)["token_ids"] if len(alive) == 3 else None
        report.update(command=" ".join([os.path.basename(sys.executable), *sys.argv]),
                      concurrency=args.concurrency, queue_limit=status["requests"]["queue_limit"],
                      head=next(m["name"] for m in status["members"] if m["head"]),
                      alive_after=alive, token_identical_after=after == reference,
                      final_status_requests=c.call(0, "status")["requests"] if len(alive) == 3 else None)
    ok = (not report["daemon_exits"] and len(report["alive_after"]) == 3 and report["token_identical_after"]
          and not report["outcomes"]["normal"].get("failed"))
    report["ok"] = ok
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
