#!/usr/bin/env python3
"""Per-stage cost of one ring hop and bulk transfer over the direct path, in one run (issue 12 item 5).

    python scripts/bench_hop.py [--runs 3] [--mib 16] [--pings 300]

Stages of an 8 KiB activation hop (each timed alone, median over ``--pings`` repetitions):

- frame:  proto_spec 02 frame encode + decode (msgpack) of {"t": "act", "seq", "h": 8 KiB}
- noise:  Noise transport encrypt + decrypt of that frame (ChaCha20-Poly1305, kafilad/proto/noise.py)
- quic:   the QUIC library alone, sans-IO: one 8 KiB stream message from client to server through
          two connections pumped in one process (no sockets), qh3 and, when installed, aioquic
- hop:    the whole thing, one way (half the median 8 KiB ping-pong round trip between two Links:
          frame + Noise + QUIC + UDP on loopback + trio hand-offs, kafilad/node/paths/link.py over
          kafilad/net/quic_transport.py), at 1,350-byte datagrams and at the same-host size

Bulk: ``--mib`` MiB on one stream, (a) sans-IO pumped pair per library at 1,350-byte datagrams,
(b) Links over real UDP sockets on loopback at 1,350-byte datagrams (MAX_DATAGRAM_BYTES) and at the
same-host size. Each measurement runs ``--runs`` times; the medians are printed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import ssl
import statistics
import sys
import time

import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_paths import bench_links, direct  # noqa: E402  (Links over QUIC on two UDP endpoints)

from kafilad.net.quic_config import MAX_DATAGRAM_BYTES, SAME_HOST_DATAGRAM_BYTES  # noqa: E402
from kafilad.proto.frames import FrameDecoder, encode_frame  # noqa: E402
from kafilad.proto.noise import CipherState  # noqa: E402
from kafilad.proto.quic_header import quic_dcid  # noqa: E402

ACT_BYTES = 8 * 1024


def _median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def stage_frame(n: int) -> float:
    body = {"t": "act", "seq": 7, "h": os.urandom(ACT_BYTES)}

    def once():
        d = FrameDecoder()
        d.receive_data(encode_frame(body))
        assert d.next_event()["seq"] == 7
    return _median_us(once, n)


def stage_noise(n: int) -> float:
    key = os.urandom(32)
    tx, rx = CipherState(key), CipherState(key)
    frame = encode_frame({"t": "act", "seq": 7, "h": os.urandom(ACT_BYTES)})

    def once():
        assert rx.decrypt_with_ad(b"", tx.encrypt_with_ad(b"", frame)) == frame
    return _median_us(once, n)


class _Pumped:
    """Two QUIC connections of ``lib`` (qh3 or aioquic) and a pump between them, no sockets."""

    def __init__(self, lib: str, datagram_bytes: int):
        cfg_mod = importlib.import_module(lib + ".quic.configuration")
        self.C = importlib.import_module(lib + ".quic.connection").QuicConnection
        self.E = importlib.import_module(lib + ".quic.events")
        self.lib, self.now = lib, 0.0

        def cfg(client: bool):
            kw = dict(is_client=client, alpn_protocols=["kafila/1"], max_datagram_size=datagram_bytes,
                      verify_mode=ssl.CERT_NONE, server_name="kafila", max_data=16 << 20, max_stream_data=16 << 20)
            if lib == "qh3":
                kw["probe_datagram_size"] = False
            c = cfg_mod.QuicConfiguration(**kw)
            if not client:
                if lib == "qh3":
                    from kafilad.net.quic_config import self_signed_certificate
                    c.certificate, c.private_key = self_signed_certificate()
                else:
                    c.certificate, c.private_key = _cryptography_certificate()
            return c
        self.cfg = cfg
        self.cl = self.C(configuration=cfg(True))
        self.cl.connect(("127.0.0.1", 2), now=0.0)
        self.sv = None
        for _ in range(10):
            self.step()
        self.cl.send_stream_data(0, b"")
        self.step()

    def step(self) -> int:
        """One pump round both ways, timers included; the stream bytes the server received."""
        self.now += 0.0001
        got = 0
        for data, _ in self.cl.datagrams_to_send(self.now):
            if self.sv is None:
                self.sv = self.C(configuration=self.cfg(False), original_destination_connection_id=quic_dcid(data))
            self.sv.receive_datagram(data, ("127.0.0.1", 1), self.now)
        if self.sv is not None:
            while (ev := self.sv.next_event()) is not None:
                if isinstance(ev, self.E.StreamDataReceived):
                    got += len(ev.data)
            for data, _ in self.sv.datagrams_to_send(self.now):
                self.cl.receive_datagram(data, ("127.0.0.1", 2), self.now)
        while self.cl.next_event() is not None:
            pass
        for c in (self.cl, self.sv):
            t = c.get_timer() if c is not None else None
            if t is not None and t <= self.now:
                c.handle_timer(self.now)
        return got


def _cryptography_certificate():
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kafila")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    return cert, key


def stage_quic(lib: str, n: int) -> float:
    p = _Pumped(lib, MAX_DATAGRAM_BYTES)
    msg = os.urandom(ACT_BYTES)

    def once():
        p.cl.send_stream_data(0, msg)
        got = 0
        while got < ACT_BYTES:
            got += p.step()
    return _median_us(once, n)


def bulk_quic(lib: str, mib: int) -> float:
    """MB/s of ``mib`` MiB through a pumped pair of ``lib`` at 1,350-byte datagrams."""
    p = _Pumped(lib, MAX_DATAGRAM_BYTES)
    total, chunk = mib << 20, os.urandom(65536)
    sent = got = 0
    t0 = time.perf_counter()
    while got < total:
        if sent < total and sent - got < (8 << 20):
            p.cl.send_stream_data(0, chunk)
            sent += len(chunk)
        got += p.step()
    return total / (time.perf_counter() - t0) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--pings", type=int, default=300)
    args = ap.parse_args()
    libs = ["qh3"]
    try:
        importlib.import_module("aioquic")
        libs.append("aioquic")
    except ImportError:
        pass
    rows: dict[str, list[float]] = {}

    def add(name, value):
        rows.setdefault(name, []).append(value)
    for _ in range(args.runs):
        add("frame encode+decode, 8 KiB (us)", stage_frame(args.pings))
        add("noise encrypt+decrypt, 8 KiB (us)", stage_noise(args.pings))
        for lib in libs:
            add(f"quic sans-IO {lib}, 8 KiB message (us)", stage_quic(lib, args.pings))
            add(f"quic sans-IO {lib}, bulk 1350 B (MB/s)", bulk_quic(lib, args.mib))
        for label, size in (("1350 B", MAX_DATAGRAM_BYTES), (f"{SAME_HOST_DATAGRAM_BYTES} B", None)):
            rtt_s, xfer_s = trio.run(_direct, args.pings, args.mib, size)
            add(f"hop one way over UDP, {label} datagrams (us)", rtt_s / 2 * 1e6)
            add(f"bulk over UDP, {label} datagrams (MB/s)", args.mib * (1 << 20) / xfer_s / 1e6)
    width = max(len(k) for k in rows)
    print(f"{'stage':<{width}}  {'median':>9}  runs")
    for name, values in rows.items():
        print(f"{name:<{width}}  {statistics.median(values):>9.1f}  " + " ".join(f"{v:.1f}" for v in values))


async def _direct(pings: int, mib: int, datagram_bytes):
    return await direct(pings, mib, datagram_bytes=datagram_bytes)


if __name__ == "__main__":
    main()
