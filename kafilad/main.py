"""`kafilad` command line: the daemon (foreground) and `kafilad rendezvous`.

    kafilad [--state-dir DIR] [--name NAME] [--rendezvous ws://HOST:PORT] [-v]
    kafilad rendezvous --listen HOST:PORT [--stun ADDR:PORT ...] [--record-relay FILE]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import trio

from kafilad.errors import find_kafila_error


def _hostport(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {s!r}")
    return host.strip("[]"), int(port)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kafilad", description="Kafila daemon (runs in the foreground).")
    p.add_argument("--state-dir", help="state directory (default: the platform's user state dir)")
    p.add_argument("--name", help="this member's name (default: the host name)")
    p.add_argument("--rendezvous", default=os.environ.get("KAFILA_RENDEZVOUS") or None,
                   help="default rendezvous URL, e.g. ws://rdv.example:7400 (env KAFILA_RENDEZVOUS)")
    p.add_argument("--http", default="127.0.0.1:8400",
                   help="serve the OpenAI-compatible API of a hosted session on HOST:PORT ('off' disables)")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command")
    r = sub.add_parser("rendezvous", help="run the rendezvous / relay / STUN service")
    r.add_argument("--listen", type=_hostport, required=True, help="WebSocket HOST:PORT")
    r.add_argument("--stun", type=_hostport, action="append", default=[],
                   help="STUN responder ADDR:PORT (repeat: 2 IPs x 2 ports enable RFC 5780 discovery)")
    r.add_argument("--record-relay", help="append every relayed payload to FILE (tests, audits)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        if args.command == "rendezvous":
            trio.run(_rendezvous, args)
        else:
            trio.run(_daemon, args)
    except KeyboardInterrupt:
        pass
    except Exception as e:  # startup errors are sentences, not tracebacks
        known = find_kafila_error(e)
        os_error = _find(e, OSError)
        if known is not None:
            print(f"kafilad: {known}", file=sys.stderr)
        elif os_error is not None:
            print(f"kafilad: {os_error.strerror or os_error} "
                  f"({getattr(os_error, 'filename', None) or 'check the address and port'}).", file=sys.stderr)
        else:
            raise
        return 1
    return 0


def _find(exc: BaseException, kind: type):
    if isinstance(exc, kind):
        return exc
    for inner in getattr(exc, "exceptions", ()) or ():
        found = _find(inner, kind)
        if found is not None:
            return found
    return None


async def _rendezvous(args) -> None:
    from kafilad.rendezvous.server import serve_rendezvous
    host, port = args.listen
    async with trio.open_nursery() as nursery:
        if args.stun:
            from kafilad.rendezvous.stun_server import serve_stun
            await nursery.start(serve_stun, args.stun)
        actual = await nursery.start(lambda task_status: serve_rendezvous(
            host, port, record_path=args.record_relay, stun_addresses=args.stun, task_status=task_status))
        print(f"rendezvous listening on ws://{host}:{actual}", flush=True)


async def _daemon(args) -> None:
    from kafilad.node.daemon import Node
    from kafilad.node.statedir import StateDir, default_name
    http = None if args.http in ("off", "none", "") else _hostport(args.http)
    node = Node(StateDir(args.state_dir), name=args.name or default_name(), rendezvous=args.rendezvous, http=http)
    await node.run()


if __name__ == "__main__":
    sys.exit(main())
