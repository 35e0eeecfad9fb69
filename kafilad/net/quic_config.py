"""QUIC settings of a ring edge and the few qh3 internals the driver needs (DESIGN §4; proto_spec 07 §4, §4a).

The QUIC library is qh3 (an aioquic fork whose packet core is native code, with aioquic's sans-IO
API): on this project's measurements it moves 4-8 times more datagrams per CPU second than
aioquic 1.7.2 (docs/performance-transport.md). qh3 fixes a connection's datagram size when it
is created and can only lower it afterwards, so kafilad/net/quic_transport.py raises the size
with a successor connection; the helpers for that live here:

- :func:`cap_datagram_bytes` lowers a live connection's size (qh3==2.1.0 internals, pinned);
- :func:`successor_dcid` names the Initial DCID of generation g+1 from generation g's, so the
  receiver routes a successor's first datagram without an expectation per remote address::

      successor DCID = SHA-256("kafila/quic-successor" || previous original DCID)[0:8]
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import socket
import ssl
from typing import Optional

from qh3.quic.configuration import QuicConfiguration
from qh3.quic.connection import QuicConnection

from kafilad.proto.quic_header import CID_BYTES

ALPN = "kafila/1"
#: Datagram size of a network path until path MTU probes raise it: the size every QUIC path must
#: carry (RFC 9000 §14.1), so a handshake never depends on fragments (proto_spec 07 §4a).
START_DATAGRAM_BYTES = 1200
#: An Internet-sized datagram (fits a 1500-byte MTU with IPv6 + UDP headers and some tunnel
#: overhead); benchmarks use it on loopback (scripts/bench_paths.py, scripts/bench_hop.py).
MAX_DATAGRAM_BYTES = 1350
#: Datagram size toward a peer on this host (loopback, or one of our own addresses), where the
#: path is the loopback interface (MTU 65,536) and nothing on it fragments or drops large
#: datagrams. Kept below 16,383, the largest 2-byte QUIC varint (packet and STREAM frame lengths).
SAME_HOST_DATAGRAM_BYTES = 16000
#: Largest datagram size a connection accepts (:func:`cap_datagram_bytes`, set_datagram_bytes).
MAX_SETTABLE_DATAGRAM_BYTES = 16383
#: The max_udp_payload_size every qh3 client announces (RFC 9000 §18.2), so the most a server
#: sends. A server starts at most this large: lowering the size mid-handshake, when the client's
#: parameters arrive, would strand CRYPTO frames already built for larger packets.
CLIENT_ANNOUNCED_UDP_PAYLOAD_BYTES = 1472
#: QUIC idle timeout; keepalive PINGs go out well before it (QUIC closes silently after it).
IDLE_TIMEOUT_S = 60.0
#: QUIC flow-control windows: a window below the path's bandwidth-delay product plus the
#: receiver's reading lag stalls a fast sender between MAX_DATA updates.
FLOW_WINDOW_BYTES = 16 * 1024 * 1024

_CERT: Optional[tuple] = None


def self_signed_certificate() -> tuple:
    """(certificate, private_key) as qh3 objects: EC P-256, self-signed, generated once per process.

    Made with ``cryptography`` and handed to qh3 as PEM (qh3 reads certificates only from PEM).
    """
    global _CERT
    if _CERT is None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
        from qh3.tls import load_pem_private_key, load_pem_x509_certificates

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kafila")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=30))
                .sign(key, hashes.SHA256()))
        cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        _CERT = (load_pem_x509_certificates(cert_pem)[0], load_pem_private_key(key_pem))
    return _CERT


def path_datagram_bytes(remote: tuple[str, int]) -> int:
    """QUIC datagram size for the path to ``remote`` (ip, port) (proto_spec 07 §4).

    SAME_HOST_DATAGRAM_BYTES when ``remote`` is a loopback address or an address of this host (the
    kernel picks it as its own source toward it, so the path never leaves the loopback
    interface); START_DATAGRAM_BYTES otherwise, since an interface's MTU says nothing about the
    rest of an Internet path (probes raise it later). Asks the kernel's routing table; sends nothing.
    """
    try:
        ip = ipaddress.ip_address(remote[0])
    except ValueError:
        return START_DATAGRAM_BYTES
    if getattr(ip, "ipv4_mapped", None) is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return SAME_HOST_DATAGRAM_BYTES
    if ip.is_unspecified or ip.is_multicast:
        return START_DATAGRAM_BYTES
    try:
        with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((str(ip), int(remote[1]) or 9))
            local = ipaddress.ip_address(s.getsockname()[0].split("%")[0])
    except (OSError, ValueError):
        return START_DATAGRAM_BYTES
    return SAME_HOST_DATAGRAM_BYTES if local == ip else START_DATAGRAM_BYTES


def configuration(*, is_client: bool, datagram_bytes: int = START_DATAGRAM_BYTES) -> QuicConfiguration:
    """qh3 configuration of one edge (proto_spec 07 §4).

    Args:
        is_client: the edge's sender (client) or receiver (server).
        datagram_bytes: the largest UDP payload this side sends (1200 .. 16,383). qh3's own path
            MTU probing stays off: it would send datagrams above this size, and the edge's
            search (kafilad/node/paths/manager.py, proto_spec 07 §4a) decides the size.
    Returns:
        A QuicConfiguration; a server's carries the process's self-signed certificate and sends
        at most CLIENT_ANNOUNCED_UDP_PAYLOAD_BYTES (mostly acknowledgements: the client sends the data).
    """
    if not is_client:
        datagram_bytes = min(int(datagram_bytes), CLIENT_ANNOUNCED_UDP_PAYLOAD_BYTES)
    cfg = QuicConfiguration(is_client=is_client, alpn_protocols=[ALPN], idle_timeout=IDLE_TIMEOUT_S,
                            max_datagram_size=int(datagram_bytes), probe_datagram_size=False,
                            verify_mode=ssl.CERT_NONE, server_name="kafila", connection_id_length=CID_BYTES,
                            max_data=FLOW_WINDOW_BYTES, max_stream_data=FLOW_WINDOW_BYTES)
    if not is_client:
        cfg.certificate, cfg.private_key = self_signed_certificate()
    return cfg


def datagram_bytes_of(conn: QuicConnection) -> int:
    """The datagram size ``conn`` builds packets for now (its active path's MTU)."""
    core = conn._core
    return int(core.active_path[5]) if core is not None else int(conn.configuration.max_datagram_size)


def cap_datagram_bytes(conn: QuicConnection, n: int) -> bool:
    """Lower ``conn``'s datagram size to ``n`` bytes (>= 1200) from now on; frames in lost packets
    are sent again in packets of the new size (RFC 9000 §13.3).

    qh3 2.1.0 has no call for this; its core applies the peer's max_udp_payload_size transport
    parameter (RFC 9000 §18.2) as a cap on the size, so this applies the peer's parameters again
    with a smaller one (flow-control limits only ever grow there, so the rest changes nothing).

    Returns:
        False when the handshake has not delivered the peer's parameters yet (nothing changed).
    """
    p = conn._applied_transport_parameters
    core = conn._core
    if p is None or core is None:
        return False
    core.apply_peer_transport_parameters(
        p.initial_max_data or 0, p.initial_max_stream_data_bidi_local or 0,
        p.initial_max_stream_data_bidi_remote or 0, p.initial_max_stream_data_uni or 0,
        p.initial_max_streams_bidi or 0, p.initial_max_streams_uni or 0,
        3 if p.ack_delay_exponent is None else p.ack_delay_exponent,
        0.025 if p.max_ack_delay is None else p.max_ack_delay / 1000,
        None if not p.max_idle_timeout else p.max_idle_timeout / 1000,
        p.max_datagram_frame_size, p.stateless_reset_token, p.active_connection_id_limit or 2,
        bool(p.disable_active_migration), max(START_DATAGRAM_BYTES, int(n)))
    return True


def successor_dcid(previous_odcid: bytes) -> bytes:
    """The Initial DCID of the connection that succeeds one whose original DCID was ``previous_odcid``."""
    return hashlib.sha256(b"kafila/quic-successor" + bytes(previous_odcid)).digest()[:CID_BYTES]


def initial_dcid(sender_ufrag: str, sender_pwd: str, receiver_ufrag: str, receiver_pwd: str) -> bytes:
    """The Initial DCID an edge's sender uses for the first connection of one attempt (proto_spec 07 §4).

    Both ends know both attempts' ICE credentials (RFC 8445 §5.3; fresh per attempt, exchanged in
    the offers of 07 §2), so the receiver accepts exactly this connection and ignores a datagram
    left over from an earlier connection between the same sockets. First CID_BYTES bytes of
    SHA-256("kafila/quic-initial" ‖ sender ufrag ‖ ":" ‖ sender pwd ‖ ":" ‖ receiver ufrag ‖ ":" ‖ receiver pwd).
    """
    material = ":".join((sender_ufrag, sender_pwd, receiver_ufrag, receiver_pwd)).encode()
    return hashlib.sha256(b"kafila/quic-initial" + material).digest()[:CID_BYTES]
