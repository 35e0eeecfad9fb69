"""The rendezvous STUN responder: one UDP socket per configured address (DESIGN §2, §3 step 3).

Logic: :class:`kafilad.proto.stun.StunResponder` (proto_spec §4.2-§4.3). With two IPs x two
ports (four addresses) it supports full RFC 5780 behaviour discovery; the answer to a
CHANGE-REQUEST leaves from the socket bound to the changed address.

Command line (the NAT lab runs it inside the rendezvous namespace)::

    python -m kafilad.rendezvous.stun_server 172.16.0.10:3478 172.16.0.10:3479 \\
        172.16.0.11:3478 172.16.0.11:3479

prints "ready IP:PORT ..." once every socket is bound, then serves until interrupted.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import trio

from kafilad.errors import KafilaError
from kafilad.net.stun_client import parse_host_port
from kafilad.proto.stun import StunResponder

Address = tuple[str, int]

#: Largest datagram read; anything longer than a STUN request is not one (RFC 8489 §6.1).
RECV_BYTES = 2048


async def serve_stun(addresses: Sequence[tuple[str, int]], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Bind one UDP socket per (ip, port) and answer STUN Binding requests until cancelled.

    Args:
        addresses: IP literals and ports; port 0 picks a free port (then the addresses no longer
            form a 2 x 2 grid, so use it for single-address tests only).
        task_status: ``started()`` is called with the list of bound (ip, port) addresses.

    Raises:
        KafilaError: an address cannot be bound (in use, or not an address of this host).
    """
    sockets: dict[Address, trio.socket.SocketType] = {}
    try:
        for host, port in addresses:
            family = trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET
            sock = trio.socket.socket(family, trio.socket.SOCK_DGRAM)
            try:
                await sock.bind((host, port))
            except OSError as exc:
                sock.close()
                raise KafilaError(
                    f"Cannot listen for STUN on {host}:{port} ({exc.strerror}); "
                    "check that the address belongs to this host and the port is free.") from exc
            ip, bound_port = sock.getsockname()[:2]
            sockets[(ip, bound_port)] = sock
        responder = StunResponder(list(sockets))

        async def serve_one(local: Address, sock: trio.socket.SocketType) -> None:
            while True:
                try:
                    data, remote = await sock.recvfrom(RECV_BYTES)
                except OSError:
                    continue  # e.g. ICMP errors reported on the socket: not ours to handle
                answer = responder.handle_datagram(data, local, remote)
                if answer is None:
                    continue
                response, origin = answer
                try:
                    await sockets[origin].sendto(response, remote[:2])
                except OSError:
                    pass  # the client is unreachable: it will retransmit or give up

        async with trio.open_nursery() as nursery:
            for local, sock in sockets.items():
                nursery.start_soon(serve_one, local, sock)
            task_status.started(list(sockets))
    finally:
        for sock in sockets.values():
            sock.close()


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m kafilad.rendezvous.stun_server IP:PORT [IP:PORT ...]")
        return 0 if argv else 2

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve_stun, [parse_host_port(a) for a in argv])
            print("ready " + " ".join(f"{ip}:{port}" for ip, port in bound), flush=True)

    try:
        trio.run(run)
    except KafilaError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
