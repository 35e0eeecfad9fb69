"""Trio driver for NAT behaviour discovery on the daemon's one UDP socket (DESIGN §3 step 3, §4).

All logic lives in :class:`kafilad.proto.natclass.NatClassifier` (proto_spec §4.4); this module
feeds it datagrams and the clock. While :func:`classify_nat` runs it is the socket's only reader:
call it before the socket's demultiplexer starts, or hand it datagrams from there instead.

Command line (the NAT lab runs it inside a member's namespace)::

    python -m kafilad.net.stun_client 172.16.0.10:3478 [more servers] [--bind IP:PORT]

prints the NatReport as one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import sys
from collections.abc import Sequence

import trio

from kafilad.errors import KafilaError
from kafilad.proto import address
from kafilad.proto.natclass import NatClassifier, NatReport

Address = tuple[str, int]

#: Largest datagram read; STUN answers are far smaller (RFC 8489 §6.1).
RECV_BYTES = 2048
#: The default STUN port (RFC 8489), assumed when a server is named without one.
STUN_PORT = 3478


def parse_host_port(text: str, default_port: int = STUN_PORT) -> Address:
    """A STUN server address: :func:`kafilad.proto.address.parse_host_port` with the STUN port as default.

    Raises:
        AddressError (a KafilaError): not HOST:PORT, or a port outside 1-65535.
    """
    return address.parse_host_port(text, default_port)


async def resolve(servers: Sequence[tuple[str, int]], family: int) -> list[Address]:
    """Resolve server names to IP literals of ``family`` (first answer each).

    Raises:
        KafilaError: a name does not resolve to an address of that family.
    """
    out = []
    for host, port in servers:
        try:
            ipaddress.ip_address(host)
            out.append((host, int(port)))
            continue
        except ValueError:
            pass
        try:
            infos = await trio.socket.getaddrinfo(host, port, family=family, type=trio.socket.SOCK_DGRAM)
        except OSError as exc:
            raise KafilaError(f"The STUN server name '{host}' does not resolve ({exc}); check the rendezvous address.") from exc
        out.append((infos[0][4][0], infos[0][4][1]))
    return out


async def local_address_toward(sock: trio.socket.SocketType, server: Address) -> Address | None:
    """Our (ip, port) as seen on the route to ``server``: the socket's port and the source IP the
    kernel would pick (a throw-away connected UDP socket; no packet is sent)."""
    ip, port = sock.getsockname()[:2]
    if not ipaddress.ip_address(ip).is_unspecified:
        return (ip, port)
    probe = trio.socket.socket(sock.family, trio.socket.SOCK_DGRAM)
    try:
        await probe.connect(server)
        return (probe.getsockname()[0], port)
    except OSError:
        return None
    finally:
        probe.close()


async def classify_nat(
    sock: trio.socket.SocketType,
    stun_servers: Sequence[tuple[str, int]],
    *,
    timeout_s: float = 10.0,
    max_wait_s: float = 1.5,
    local_address: Address | None = None,
    contacted: Sequence[Address] = (),
) -> NatReport:
    """Classify this host's NAT with RFC 5780 probes from the bound UDP socket ``sock``.

    Args:
        sock: a bound trio UDP socket (the daemon's one socket, DESIGN §4).
        stun_servers: (host, port) of the rendezvous STUN addresses, primary first.
        timeout_s: overall bound; on expiry the report says what was learnt, with unknown
            mapping (class "unknown", and a reason). A normal run takes about ``max_wait_s``
            behind a filtering NAT.
        max_wait_s: per-transaction cap (proto_spec §4.4).
        local_address: our (ip, port) toward the servers, if known; found from the routing table
            otherwise (used to recognise "no NAT").
        contacted: server addresses an earlier run sent to recently (``NatReport.probed``), whose
            answers cannot prove a filtering behaviour (proto_spec §4.4).

    Returns:
        NatReport with ``nat_class`` "O" | "C" | "S" | "unknown" (``reason`` then says why) and
        ``rtt_ms`` to the first server.

    Raises:
        KafilaError: no server given, or a server name does not resolve.
    """
    if not stun_servers:
        raise KafilaError("No STUN server is configured; give the rendezvous STUN address (HOST:PORT).")
    servers = await resolve(stun_servers, sock.family)
    if local_address is None:
        local_address = await local_address_toward(sock, servers[0])
    machine = NatClassifier(servers, local_address=local_address, max_wait_s=max_wait_s, contacted=contacted)

    async def flush() -> None:
        for data, addr in machine.datagrams_to_send(trio.current_time()):
            try:
                await sock.sendto(data, addr)
            except OSError:
                pass  # unreachable right now: the same as a lost datagram; retransmission follows

    with trio.move_on_after(timeout_s):
        await flush()
        while not machine.done:
            timer = machine.get_timer()
            with trio.move_on_at(timer if timer is not None else trio.current_time() + timeout_s):
                try:
                    data, addr = await sock.recvfrom(RECV_BYTES)
                except OSError:
                    continue  # ICMP port unreachable surfaces here on some systems
                machine.receive_datagram(data, addr, trio.current_time())
            now = trio.current_time()
            if timer is not None and now >= timer:
                machine.handle_timer(now)
            await flush()
    if not machine.done:
        machine.abort(f"the classification did not finish within {timeout_s:g} s")
    return machine.report


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kafilad.net.stun_client",
                                     description="Classify this host's NAT (RFC 5780) and print a JSON report.")
    parser.add_argument("servers", nargs="+", help="STUN server HOST:PORT, primary first")
    parser.add_argument("--bind", default="0.0.0.0:0", help="local IP:PORT to bind (default 0.0.0.0:0)")
    parser.add_argument("--timeout", type=float, default=10.0, help="overall bound in seconds")
    args = parser.parse_args(argv)

    async def run() -> NatReport:
        bind_host, bind_port = address.parse_host_port(args.bind, 0, allow_any_port=True)
        family = trio.socket.AF_INET6 if ":" in bind_host else trio.socket.AF_INET
        with trio.socket.socket(family, trio.socket.SOCK_DGRAM) as sock:
            await sock.bind((bind_host, bind_port))
            return await classify_nat(sock, [parse_host_port(s) for s in args.servers], timeout_s=args.timeout)

    try:
        report = trio.run(run)
    except KafilaError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(report)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
