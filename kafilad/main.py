"""`kafilad` command line: the daemon (foreground) and `kafilad rendezvous`.

    kafilad [--version] [--state-dir DIR] [--name NAME] [--rendezvous ws://HOST:PORT] [--http HOST:PORT|PORT|off]
            [--api-key KEY ...] [--http-insecure] [-v]
    kafilad rendezvous --listen HOST:PORT [--stun ADDR:PORT ...] [--record-relay FILE] [--register-timeout S]
                       [--max-sessions N] [--max-connections-per-address N] [--max-sessions-per-address N]
                       [--max-sessions-per-key N] [--max-circuits-per-address N]
                       [--joins-per-second-per-address R] [--relay-mib-per-second-per-address R]

`--http` takes HOST:PORT, a bare PORT (meaning 127.0.0.1:PORT, the API stays local), or `off`.
A port outside 0..65535 is refused by the parser, and a port given with `--http` that cannot be
bound (in use, not a local address) refuses the start with a sentence: the daemon never runs
without the API it was asked to serve. Without `--http`, the default 127.0.0.1:8400 is only a
default: when it is taken (a second daemon on one machine) the daemon logs a warning naming the
port and `--http`, and runs without the API; kafila-ctl needs only the control socket. Without
`--state-dir`, `KAFILA_STATE_DIR` names the state directory (as for kafila-ctl); before anything
starts, the daemon checks that its control socket there fits a Unix socket address and that the
directory can be created, and says what to change when not. `--rendezvous` (or
`KAFILA_RENDEZVOUS`) is checked at startup too: a ws:// or wss:// URL with a host. `--api-key`
(repeatable) and `KAFILA_API_KEYS` (comma-separated) are the HTTP API's keys
(kafilad/control/auth.py); an `--http` address other than loopback without a key refuses the
start with a sentence unless `--http-insecure` is given.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import trio

from kafilad.errors import find_kafila_error
from kafilad.proto.address import AddressError, parse_host_port
from kafilad.proto.rendezvous import RendezvousLimits


#: file handles the daemon asks for (the soft limit is raised up to this, never past the hard limit)
WANT_OPEN_FILES = 8192

#: the HTTP API's address when `--http` is not given (`args.http is DEFAULT_HTTP` tells the two apart)
DEFAULT_HTTP = ("127.0.0.1", 8400)

#: the daemon's log file (STATE_DIR/kafilad.log) rotates at this size ...
LOG_FILE_BYTES = 5 * 1024 * 1024
#: ... keeping this many older files (kafilad.log.1 .. .3)
LOG_FILE_BACKUPS = 3
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def _hostport(s: str) -> tuple[str, int]:
    """HOST:PORT of a listen address (port 0: any free port); one parser for the project (proto/address.py)."""
    return parse_host_port(s, allow_any_port=True)


def _count(s: str) -> int:
    """A positive whole number (a limit of `kafilad rendezvous`)."""
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a whole number.") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{s!r} must be at least 1.")
    return n


def _rate(s: str) -> float:
    """A positive finite number (a rate limit of `kafilad rendezvous`)."""
    try:
        x = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number.") from None
    if not (x > 0 and x != float("inf")):
        raise argparse.ArgumentTypeError(f"{s!r} must be a positive number.")
    return x


def _seconds(s: str) -> float:
    try:
        value = float(s)
    except ValueError:
        value = float("nan")
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {s!r}")
    return value


def http_address(s: str) -> tuple[str, int] | None:
    """`--http`: HOST:PORT, a bare PORT (127.0.0.1:PORT), or off/none (no API).

    Also the check of `kafila-ctl service install --http`, so the two cannot disagree.

    Raises:
        AddressError: (an argparse.ArgumentTypeError) a port outside 0..65535 or no HOST:PORT, a sentence.
    """
    s = s.strip()
    if s.lower() in ("off", "none", ""):
        return None
    if s.isascii() and s.isdigit():
        if int(s) > 65535:
            raise AddressError(f"{s} is not a port: a port is a number from 0 to 65535 (0: any free port).")
        return parse_host_port(f"127.0.0.1:{s}", allow_any_port=True)
    return _hostport(s)


def rendezvous_url(s: str) -> str:
    """`--rendezvous` (and KAFILA_RENDEZVOUS): a WebSocket URL, ws://HOST[:PORT] or wss://HOST[:PORT], as
    the daemon's rendezvous client connects to it (trio_websocket's URL rules, kafilad/node/session/rdv_client.py;
    without a port: 80 for ws, 443 for wss). Checked at startup, as --http is, rather than at `host`;
    also the check of `kafila-ctl service install --rendezvous`.

    Returns:
        The URL as given (surrounding white space removed).
    Raises:
        argparse.ArgumentTypeError: not such a URL, with a sentence.
    """
    from urllib.parse import urlsplit
    url = s.strip()
    looks = "it must look like ws://HOST:PORT or wss://HOST:PORT, e.g. ws://rdv.example.org:7400"
    try:
        parts = urlsplit(url)
        port = parts.port  # a port that is no number 0..65535 raises ValueError
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"The rendezvous URL {url!r} is not a WebSocket URL ({e}); {looks}.") from None
    if parts.scheme not in ("ws", "wss"):
        raise argparse.ArgumentTypeError(f"The rendezvous URL {url!r} is not a WebSocket URL: "
                                         f"{'it has no scheme' if not parts.scheme else repr(parts.scheme + '://') + ' is not ws:// or wss://'}; {looks}.")
    if not parts.hostname:
        raise argparse.ArgumentTypeError(f"The rendezvous URL {url!r} names no host; {looks}.")
    if port == 0:
        raise argparse.ArgumentTypeError(f"The rendezvous URL {url!r} names port 0, which nothing listens on; {looks}.")
    return url


#: environment variable of the default rendezvous URL when --rendezvous is not given
RENDEZVOUS_ENV = "KAFILA_RENDEZVOUS"

#: longest Unix socket path the OS takes, in bytes: sun_path of sockaddr_un less its NUL
#: (108 - 1 on Linux, 104 - 1 on macOS and the BSDs)
MAX_UNIX_SOCKET_PATH_BYTES = 107 if sys.platform.startswith("linux") else 103


def prepare_state_dir(state_dir: str | None):
    """The daemon's state directory, created (kafilad/node/session/statedir.py StateDir.ensure), after checking
    that its control socket path fits a Unix socket address.

    Args:
        state_dir: --state-dir, or None for $KAFILA_STATE_DIR or the platform's default.
    Returns:
        The StateDir.
    Raises:
        KafilaError: the socket path is too long, a file stands where the directory (or one above it)
            should be, or the directory cannot be created; each a sentence naming what to change.
    """
    from kafilad.errors import KafilaError
    from kafilad.node.session.statedir import STATE_DIR_ENV, StateDir
    state = StateDir(state_dir)
    path = state.path
    origin = "" if state_dir is not None or not os.environ.get(STATE_DIR_ENV, "").strip() else f" (from {STATE_DIR_ENV})"
    named = f"{path}{origin}"
    fix = "start kafilad with --state-dir naming a directory you can write to (it is created when missing)"
    sock_bytes = len(os.fsencode(str(state.socket_path)))
    if sock_bytes > MAX_UNIX_SOCKET_PATH_BYTES:
        raise KafilaError(f"The control socket in the state directory {named}, {state.socket_path}, is a path of "
                          f"{sock_bytes} bytes, longer than the {MAX_UNIX_SOCKET_PATH_BYTES} bytes this OS allows for "
                          f"a Unix socket path; start kafilad with a shorter --state-dir (e.g. ~/.kafila).")
    try:
        return state.ensure()
    except OSError as e:
        for above in (path, *path.parents):
            if above.exists() and not above.is_dir():
                if above == path:
                    raise KafilaError(f"The state directory {named} is a file, not a directory; {fix}.") from None
                raise KafilaError(f"The state directory {named} cannot be created: {above} is a file, not a "
                                  f"directory; {fix}.") from None
        why = e.strerror or str(e)
        if isinstance(e, FileNotFoundError):
            parent = next((a for a in path.parents if a.is_dir()), None)
            if parent is not None:
                why = f"{parent} does not take new directories ({e.strerror})"
        elif e.filename and str(e.filename) != str(path):
            why = f"{why} ({e.filename})"
        raise KafilaError(f"The state directory {named} cannot be created: {why}; {fix}.") from None


def _raise_open_files_limit(want: int = WANT_OPEN_FILES) -> None:
    """Raise the soft RLIMIT_NOFILE toward `want` (macOS starts at 256, Linux at 1024)."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):
        pass


def package_version() -> str:
    """The installed kafila distribution's version (both tools print it for --version)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kafila")
    except PackageNotFoundError:
        return "unknown (kafila is not installed; running from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kafilad", description="Kafila daemon (runs in the foreground).")
    p.add_argument("--version", action="version", version=f"kafilad {package_version()}")
    p.add_argument("--state-dir", help="state directory (default: $KAFILA_STATE_DIR, else the platform's user "
                                       "state dir, e.g. ~/.local/state/kafila)")
    p.add_argument("--name", help="this member's name (default: the host name)")
    p.add_argument("--rendezvous", type=rendezvous_url, default=None,
                   help="default rendezvous URL, e.g. ws://rdv.example:7400 (env KAFILA_RENDEZVOUS)")
    p.add_argument("--http", type=http_address, default=DEFAULT_HTTP,
                   help="serve the OpenAI-compatible API of a hosted session on HOST:PORT, or on "
                        "127.0.0.1:PORT for a bare PORT ('off' disables; default 127.0.0.1:8400, skipped with "
                        "a warning when another program, e.g. a second kafilad, holds it)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="a key the HTTP API asks for (Authorization: Bearer KEY or x-api-key: KEY); repeat for "
                        "more; also KAFILA_API_KEYS=KEY1,KEY2, which other users cannot read in the process list")
    p.add_argument("--http-insecure", action="store_true",
                   help="serve the HTTP API on an address other machines reach without an API key")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command")
    r = sub.add_parser("rendezvous", help="run the rendezvous / relay / STUN service")
    r.add_argument("--listen", type=_hostport, required=True, help="WebSocket HOST:PORT")
    r.add_argument("--stun", type=_hostport, action="append", default=[],
                   help="STUN responder ADDR:PORT (repeat: 2 IPs x 2 ports enable RFC 5780 discovery)")
    r.add_argument("--record-relay", help="append every relayed payload to FILE (tests, audits)")
    r.add_argument("--register-timeout", type=_seconds, default=None, metavar="S",
                   help="close a WebSocket that has not registered or joined a session within S seconds "
                        "(default 10)")
    d = RendezvousLimits()  # the defaults
    r.add_argument("--max-sessions", type=_count, default=d.max_sessions, metavar="N",
                   help=f"sessions this rendezvous holds at once (default {d.max_sessions})")
    r.add_argument("--max-connections-per-address", type=_count, default=d.max_connections_per_source, metavar="N",
                   help=f"WebSockets one address may hold open (default {d.max_connections_per_source})")
    r.add_argument("--max-sessions-per-address", type=_count, default=d.max_sessions_per_source, metavar="N",
                   help=f"sessions one address may host (default {d.max_sessions_per_source})")
    r.add_argument("--max-sessions-per-key", type=_count, default=d.max_sessions_per_key, metavar="N",
                   help=f"sessions one host key may host (default {d.max_sessions_per_key})")
    r.add_argument("--max-circuits-per-address", type=_count, default=d.max_circuits_per_source, metavar="N",
                   help=f"relay circuits one address may open (default {d.max_circuits_per_source})")
    r.add_argument("--joins-per-second-per-address", type=_rate, default=d.joins_per_source_per_s, metavar="R",
                   help=f"joins one address may make a second (default {d.joins_per_source_per_s:g}, "
                        f"burst {d.joins_burst_per_source:g})")
    r.add_argument("--relay-mib-per-second-per-address", type=_rate,
                   default=d.relay_rate_per_source_Bps / (1 << 20), metavar="R",
                   help=f"relay MiB/s one address may send (default {d.relay_rate_per_source_Bps / (1 << 20):g})")
    return p


def main(argv: list[str] | None = None) -> int:
    """The `kafilad` command. Exits the process itself once a daemon has run (see :func:`_exit_now`)."""
    code = _main(argv)
    if "mlx.core" in sys.modules:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process with `code` without running C++ static destructors.

    MLX used from a worker thread (kafilad/node/serving/ring.py run_on_mlx_thread) can abort at process
    teardown with "terminate called without an active exception" (exit 134; cf. ml-explore/mlx
    issue #3126), turning a clean stop into a crash. By the time this runs, the trio run is over:
    sessions told their peers, sockets closed, the MLX thread drained; logs and stdio are flushed
    here, then the process exits with the code the daemon chose.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "rendezvous":
        from kafilad.errors import KafilaError
        if args.rendezvous is None and os.environ.get(RENDEZVOUS_ENV, "").strip():
            try:
                args.rendezvous = rendezvous_url(os.environ[RENDEZVOUS_ENV])
            except argparse.ArgumentTypeError as e:
                print(f"kafilad: {RENDEZVOUS_ENV}: {e}", file=sys.stderr)
                return 2
        from kafilad.control.auth import check_binding, keys_from
        try:
            args.api_keys = keys_from(args.api_key)
            if args.http is not None:
                check_binding(args.http[0], args.api_keys, args.http_insecure)
        except KafilaError as e:
            print(f"kafilad: {e}", file=sys.stderr)
            return 2
        from kafilad.node.serving.schedule_settings import daemon_switch_interval_s, pinned_micro_batches
        try:  # every switch is checked before the state directory is made: a bad one leaves nothing behind
            pinned_micro_batches()
            switch_s = daemon_switch_interval_s()
        except ValueError as e:
            print(f"kafilad: {e}", file=sys.stderr)
            return 2
        try:
            args.state = prepare_state_dir(args.state_dir)
        except KafilaError as e:
            print(f"kafilad: {e}", file=sys.stderr)
            return 1
        if switch_s is not None:
            sys.setswitchinterval(switch_s)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format=LOG_FORMAT, stream=sys.stderr)
    try:
        if args.command == "rendezvous":
            trio.run(_rendezvous, args)
        else:
            trio.run(_daemon, args)
    except KeyboardInterrupt:
        pass
    except BaseException as e:  # startup errors are sentences, not tracebacks
        if isinstance(e, BaseExceptionGroup) and e.split((KeyboardInterrupt, trio.Cancelled))[1] is None:
            return 0  # Ctrl-C inside a nursery arrives wrapped in a group (trio's strict groups)
        if not isinstance(e, Exception):
            raise
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
        extra = {} if args.register_timeout is None else {"register_timeout_s": args.register_timeout}
        limits = RendezvousLimits(
            max_sessions=args.max_sessions, max_connections_per_source=args.max_connections_per_address,
            max_sessions_per_source=args.max_sessions_per_address, max_sessions_per_key=args.max_sessions_per_key,
            max_circuits_per_source=args.max_circuits_per_address,
            joins_per_source_per_s=args.joins_per_second_per_address,
            relay_rate_per_source_Bps=args.relay_mib_per_second_per_address * (1 << 20))
        actual = await nursery.start(lambda task_status: serve_rendezvous(
            host, port, record_path=args.record_relay, stun_addresses=args.stun, task_status=task_status,
            limits=limits, **extra))
        print(f"rendezvous listening on ws://{host}:{actual}", flush=True)


def _log_to_file(path, max_bytes: int = LOG_FILE_BYTES, backups: int = LOG_FILE_BACKUPS) -> logging.Handler:
    """Also send the root logger's records to `path`, rotated at `max_bytes` keeping `backups` old files
    (stderr logging stays as it is); the file is created private to the user (mode 0600).

    Args:
        path: the log file, STATE_DIR/kafilad.log (kafilad/node/session/statedir.py).
        max_bytes: size at which the file is rotated to path.1.
        backups: how many rotated files are kept.

    Returns:
        The handler added to the root logger.
    """
    import logging.handlers
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.close(fd)
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups,
                                                   encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)
    return handler


async def _default_http_or_none(http: tuple[str, int]) -> list | None:
    """The listeners of `http` (the default address), opened now and kept for the daemon's API, else
    None after a warning that names the port and `--http`: a second daemon on one machine still
    starts, without the API. Kept, not closed and bound again later: daemons started at the same
    moment each found the port free, and two of three then failed to bind it (issue 25 item 6).
    An address given with `--http` is not checked here; the daemon refuses to start without it."""
    from kafilad.control.http_server import open_listeners
    try:
        return await open_listeners(*http)
    except OSError as e:
        logging.getLogger("kafilad").warning(
            "The HTTP API's default address %s:%d is taken (%s), likely by another kafilad on this machine; this "
            "daemon runs without the HTTP API (kafila-ctl works as usual). Start it with --http PORT (e.g. "
            "--http %d) to serve the API there, or --http off to run without it and without this warning.",
            http[0], http[1], e.strerror or e, http[1] + 1)
        return None


async def _daemon(args) -> None:
    from kafilad.daemon import Node
    from kafilad.node.session.statedir import StateDir, default_name
    _raise_open_files_limit()
    state = getattr(args, "state", None) or StateDir(args.state_dir).ensure()
    _log_to_file(state.log_path)
    http, listeners = args.http, None
    if args.http is DEFAULT_HTTP:
        listeners = await _default_http_or_none(args.http)
        http = args.http if listeners is not None else None
    node = Node(state, name=args.name or default_name(), rendezvous=args.rendezvous, http=http,
                http_listeners=listeners, api_keys=getattr(args, "api_keys", None))
    await node.run()


if __name__ == "__main__":
    sys.exit(main())
