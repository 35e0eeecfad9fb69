"""`kafila-ctl`: one small function per subcommand (STYLE.md "Daemon and CLI"; DESIGN §7)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import trio

from kafilad.errors import CONTEXT_LENGTH_EXCEEDED, KafilaError
from kafilad.planner.plan import DEFAULT_STRATEGY, STRATEGIES
from kafilad.proto import session_events as sm
from kafila_ctl.client import ControlClient, DaemonShutDown


def _client(args) -> ControlClient:
    from kafilad.node.session.statedir import StateDir
    return ControlClient(StateDir(args.state_dir).socket_path)


def _call(args, op: str, **kw):
    return trio.run(lambda: _client(args).call(op, **kw))


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=1, default=lambda o: o.hex() if isinstance(o, bytes) else str(o)))


def cmd_keys(args) -> int:
    r = _call(args, "keys")
    if args.json:
        _print_json(r)
    else:
        print(f"name        {r['name']}\npeer id     {r['peer_id']}\nfingerprint {r['fingerprint']}")
    return 0


def _model_ref(model: str) -> str:
    """`--model` as the daemon is to receive it: a repo id, an absolute path, or the directory of a
    model shipped with kafila named bare (`stories260K`); see kafila_ctl/demo.py `model_ref`."""
    from kafila_ctl.demo import model_ref
    return model_ref(model)


def cmd_host(args) -> int:
    r = _call(args, "host", model_dir=_model_ref(args.model), members=args.members, context=args.context,
              concurrency=args.concurrency, queue=args.queue, rendezvous=args.rendezvous, open=args.open,
              admit_timeout_s=args.admit_timeout, strategy=args.strategy, head=args.head,
              **({"draft_model": _model_ref(args.draft_model)} if args.draft_model else {}))
    if args.json:
        _print_json(r)
    else:
        print(r["code"])
    return 0


def cmd_join(args) -> int:
    """Join, then (unless --no-wait) follow the member to ready: a progress bar on a terminal, plain
    lines into a pipe or file (kafila_ctl/render.py join_*)."""
    async def run():
        client = _client(args)
        async for kind, body in client.stream("join", code=args.code, rendezvous=args.rendezvous):
            if kind == "event":
                print(body.get("msg", ""), file=sys.stderr, flush=True)
            else:
                print(f"admitted to session {body['session_id']} hosted by {body['host']}", flush=True)
        if not args.no_wait:
            await _follow_join(client, tty=sys.stdout.isatty())
    try:
        trio.run(run)
    except KeyboardInterrupt:
        print("stopped following; the daemon goes on joining (`kafila-ctl status --watch` shows it)",
              file=sys.stderr)
        return 130
    return 0


def join_failed_sentence(error) -> str:
    """What `join` exits with when the member failed: its error as it stands when that is a whole
    sentence ("The session failed on the host: ..."), else wrapped in one."""
    error = str(error or "the session failed")
    return error if error[:1].isupper() and error.endswith(".") else f"Joining failed: {error.rstrip('.')}."


async def _follow_join(client: ControlClient, *, tty: bool) -> None:
    """Follow `watch` snapshots until the member is ready.

    Raises:
        KafilaError: the session failed or closed before the member was ready.
    """
    from contextlib import aclosing, nullcontext
    from rich.console import Console
    from rich.live import Live
    from kafila_ctl.render import (RateMeter, join_outcome, join_progress_key, join_progress_line,
                                   join_progress_renderable)
    meter, last_key, outcome, snap = RateMeter(), None, None, {}
    live = Live(console=Console(), auto_refresh=False) if tty else None
    with live if live is not None else nullcontext():
        async with aclosing(client.stream("watch")) as events:
            async for kind, body in events:
                if kind != "event":
                    continue
                snap = body["snapshot"]
                load = snap.get("load") or {}
                rate = meter.update(time.monotonic(),
                                    load.get("done_bytes") if load.get("progress") == "fetching" else None)
                outcome = join_outcome(snap)
                if live is not None:
                    live.update(join_progress_renderable(snap, rate), refresh=True)
                elif join_progress_key(snap) != last_key:
                    print(f"{time.strftime('%H:%M:%S')} {join_progress_line(snap, rate)}", flush=True)
                    last_key = join_progress_key(snap)
                if outcome is not None:
                    break
    if outcome == "failed":
        raise KafilaError(join_failed_sentence(snap.get("error")))
    if outcome == "closed":
        raise KafilaError(f"The session closed before this member was ready{': ' + snap['error'] if snap.get('error') else ''}.")


def cmd_pending(args) -> int:
    r = _call(args, "pending")
    if args.json:
        _print_json(r)
    elif not r:
        print("no peers are waiting for admission")
    else:
        for p in r:
            print(f"{p['peer_id']}  {p['name']}  fingerprint {p['fingerprint']}")
    return 0


def cmd_admit(args) -> int:
    r = _call(args, "admit", peer=args.peer)
    print(f"admitted {r['name']} ({r['peer_id']})")
    return 0


def cmd_deny(args) -> int:
    r = _call(args, "deny", peer=args.peer)
    print(f"denied {r['name']} ({r['peer_id']})")
    return 0


def cmd_trust_list(args) -> int:
    r = _call(args, "trust_list")
    if args.json:
        _print_json(r)
    elif not r:
        print("no keys are trusted")
    else:
        for k in r:
            print(f"{k['peer_id']}  {k['name']}  fingerprint {k['fingerprint']}  ({k['scope']})")
    return 0


def cmd_trust_revoke(args) -> int:
    r = _call(args, "trust_revoke", peer=args.peer)
    print(f"revoked {r['name']} ({r['peer_id']}); it waits for `kafila-ctl admit` when it joins again")
    return 0


def status_line(snap: dict) -> str:
    """One line for `status --watch` into a pipe or file: state, members and their stages, the plan,
    the last generation's speed (a pure function of the snapshot)."""
    if not snap.get("session"):
        return f"{snap.get('name')}: not in a session"
    parts = [f"{snap.get('name')}: session {snap.get('session')} ({snap.get('role')}) {snap.get('state')}"]
    if snap.get("error"):
        parts.append(f"error: {snap['error']}")
    load = snap.get("load") or {}
    if load.get("progress") and snap.get("state") == "loading":
        parts.append(f"{load['progress']} {load.get('done_bytes', 0) / 1e6:.1f}/{load.get('total_bytes', 0) / 1e6:.1f} MB")
    members = []
    for m in snap.get("members") or []:
        b = m.get("blocks")
        if m.get("lost"):
            state = "left" if m.get("left") else "lost"
        elif m.get("ready") or m.get("standby") or m.get("progress"):
            state = "ready" if m.get("ready") else ("standby" if m.get("standby") else m["progress"])
        else:  # a member's own view lists its ring without each one's readiness (no "ready" key): no word
            state = "joining" if "ready" in m else ""
        members.append(f"{m.get('name')}{'*' if m.get('head') else ''}{f' [{b[0]},{b[1]})' if b else ''}"
                       f"{' ' + state if state else ''}")
    if members:
        parts.append("members " + ", ".join(members))
    plan = snap.get("plan") or {}
    if plan.get("bottleneck_s") is not None:
        parts.append(f"bottleneck {plan['bottleneck_s'] * 1e3:.2f} ms")
    lg = snap.get("last_generation") or {}
    if lg.get("decode_tokens_per_s"):
        parts.append(f"last {lg['decode_tokens_per_s']:.1f} tokens/s")
    if snap.get("pending"):
        parts.append("pending " + ", ".join(p.get("name", "?") for p in snap["pending"]))
    return "; ".join(parts)


def cmd_status(args) -> int:
    from rich.console import Console
    from rich.live import Live
    from kafila_ctl.render import status_json, status_renderable
    if args.watch and not sys.stdout.isatty():  # a pipe or a file: one timestamped line per change
        async def run_lines():
            last = None
            async for kind, body in _client(args).stream("watch"):
                if kind == "event":
                    line = status_line(body["snapshot"])
                    if line != last:
                        print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)
                        last = line
        try:
            trio.run(run_lines)
        except KeyboardInterrupt:
            pass
        except DaemonShutDown:  # the daemon was stopped: nothing more will change, which ends the watch
            print(f"{time.strftime('%H:%M:%S')} kafilad stopped", flush=True)
        return 0
    if args.watch:
        async def run():
            console = Console()
            with Live(console=console, auto_refresh=False) as live:
                async for kind, body in _client(args).stream("watch"):
                    if kind == "event":
                        live.update(status_renderable(body["snapshot"]), refresh=True)
        try:
            trio.run(run)
        except KeyboardInterrupt:
            pass
        except DaemonShutDown:
            print("kafilad stopped; nothing more to watch.")
        return 0
    snap = _call(args, "status")
    if args.json:
        _print_json(status_json(snap))
    else:
        Console().print(status_renderable(snap))
    return 0


def cmd_wait(args) -> int:
    snap = _call(args, "wait", states=args.state, timeout_s=args.timeout)
    print(snap["state"])
    return 0


def _stream_generation(args, **request) -> dict:
    """Stream one generation to stdout; return its result. A failure ends the partial line first."""
    printed = False

    async def run():
        nonlocal printed
        result = None
        async for kind, body in _client(args).stream("generate", max_tokens=args.max_tokens,
                                                     temperature=args.temperature, **request):
            if kind == "event" and not getattr(args, "json", False) and body.get("text"):
                print(body["text"], end="", flush=True)
                printed = True
            elif kind == "result":
                result = body
        return result

    try:
        return trio.run(run)
    except KafilaError:
        if printed:
            print(flush=True)
        raise


def cmd_generate(args) -> int:
    result = _stream_generation(args, prompt=args.prompt)
    if args.json:
        _print_json({"text": result["text"], "token_ids": result["token_ids"],
                     **{k: v for k, v in result.items() if k not in ("text", "token_ids")}})
    else:
        print()
    return 0


#: `kafila-ctl chat`'s commands: a line starting with "/" is one of these and never reaches the model
#: ("//" sends the rest of the line, starting with "/", as text).
CHAT_HELP = ("/help   this list\n"
             "/clear  forget the conversation so far (the system message stays)\n"
             "/exit   end the chat (also /quit, or end of input)\n"
             "//text  send \"/text\" to the model")


def chat_command(line: str) -> tuple[str, str]:
    """What one input line of `kafila-ctl chat` asks for: ("send", text), ("skip", ""), ("help", ""),
    ("clear", ""), ("exit", "") or ("unknown", the command). Pure; commands never reach the model."""
    text = line.strip()
    if not text:
        return "skip", ""
    if text.startswith("//"):
        return "send", text[1:]
    if not text.startswith("/"):
        return "send", line
    word = text.split()[0].lower()
    if word in ("/exit", "/quit"):
        return "exit", ""
    if word in ("/help", "/?"):
        return "help", ""
    if word in ("/clear", "/reset"):
        return "clear", ""
    return "unknown", word


def cmd_chat(args) -> int:
    """Chat through the host (the model's chat template is applied on the host). Interactive on a
    terminal ("you> " prompts); piped, each reply is followed by a blank line so replies stay apart."""
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            return 0
        action, text = chat_command(line)
        if action == "exit":
            return 0
        if action == "skip":
            continue
        if action == "help":
            print(CHAT_HELP, file=sys.stderr if not interactive else sys.stdout)
            continue
        if action == "clear":
            messages = list(system)
            print("(conversation cleared)", file=sys.stderr if not interactive else sys.stdout)
            continue
        if action == "unknown":
            print(f"kafila-ctl: unknown chat command {text}; /help lists them (start a line with // to send "
                  "one that begins with /)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        while True:
            try:
                result = _stream_generation(args, messages=messages)
                break
            except KafilaError as e:
                first = 1 if messages[0]["role"] == "system" else 0
                if e.code == CONTEXT_LENGTH_EXCEEDED and len(messages) - first > 1:
                    del messages[first:first + 2]  # forget the oldest exchange and try again
                    continue
                print(f"kafila-ctl: {e}", file=sys.stderr)
                messages.pop()
                result = None
                break
        if result is None:
            continue
        print("\n" if not interactive else "", flush=True)
        messages.append({"role": "assistant", "content": result["text"]})


def cmd_trace(args) -> int:
    for rec in _call(args, "trace"):
        print(json.dumps(rec))
    return 0


def cmd_leave(args) -> int:
    r = _call(args, "leave")
    print(f"left session {r['left']}")
    return 0


def schedule_line(result: dict, typed: str | None = None) -> str:
    """`kafila-ctl schedule`'s line: the mode as the user typed it (lockstep, auto, per-request or N),
    else as the daemon reports it ("auto", "per-request" or a pinned N; lockstep is N = 1), then the
    micro-batches in flight now (a pure function of the `schedule` result)."""
    mode = typed.strip() if typed is not None else result["mode"]
    if isinstance(mode, str) and mode.lstrip("+").isdigit():
        mode = int(mode)
    if mode == "per-request":
        return "decode schedule: per-request (every request decodes in its own passes)"
    now = result.get("micro_batches")
    in_flight = f" ({now} micro-batch{'es' if now != 1 else ''} in flight now)" if now is not None else ""
    if mode == 1 and typed is None:
        mode = "lockstep"  # the daemon's pinned 1 (kafilad/node/serving/schedule_settings.py apply_schedule)
    if isinstance(mode, int):
        return f"decode schedule: {mode} micro-batch{'es' if mode != 1 else ''} pinned{in_flight}"
    return f"decode schedule: {mode}{in_flight}"


def cmd_schedule(args) -> int:
    r = _call(args, "schedule", mode=args.mode)
    print(schedule_line(r, args.mode))
    return 0


def cmd_speculate(args) -> int:
    r = _call(args, "speculate", mode=args.mode)
    why = f" ({r['why']})" if r.get("why") else ""
    print(f"speculative decoding: {'on' if r.get('on') else 'off'}{why}, k {r.get('k')}; "
          f"{r.get('accepted', 0)} of {r.get('drafted', 0)} drafts accepted in {r.get('passes', 0)} passes")
    return 0


def cmd_stop(args) -> int:
    _call(args, "stop")
    print("kafilad is stopping")
    return 0


def cmd_demo(args) -> int:
    from kafila_ctl.demo import run_demo
    return run_demo(model=args.model, members=args.members, prompt=args.prompt, max_tokens=args.max_tokens,
                    synth=args.synth)


def cmd_service_install(args) -> int:
    """Write the service file. The daemon's settings from this shell's environment (KAFILA_STATE_DIR,
    KAFILA_RENDEZVOUS) are carried into its command line, since a service manager's environment lacks
    them; --http and --rendezvous are checked with the daemon's own parsers (kafilad/main.py), so a
    unit never restarts forever on a daemon that refuses its arguments."""
    from kafila_ctl import service
    from kafila_ctl.client import UsageError
    from kafilad.main import RENDEZVOUS_ENV, rendezvous_url
    kind = args.manager or service.default_kind()
    state_dir = args.state_dir or os.environ.get("KAFILA_STATE_DIR") or None
    rendezvous = args.rendezvous
    if rendezvous is None and os.environ.get(RENDEZVOUS_ENV, "").strip():
        try:
            rendezvous = rendezvous_url(os.environ[RENDEZVOUS_ENV])
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"{RENDEZVOUS_ENV} (carried into the service as --rendezvous): {e} Pass "
                             "--rendezvous URL, or unset it.") from None
    environment = _service_api_keys(args)
    argv = service.daemon_argv(state_dir=state_dir and str(Path(state_dir).expanduser().resolve()),
                               name=args.name, rendezvous=rendezvous, http=args.http, http_insecure=args.http_insecure)
    path = Path(args.path).expanduser() if args.path else None
    if args.print:
        print(service.render(kind, argv, path=path, environment=environment), end="")
        return 0
    path = service.install(kind, argv, path=path, force=args.force, environment=environment)
    print(f"wrote {path}\nExecStart: {' '.join(argv)}\nenable and start it with:")
    commands = service.enable_commands(kind, path)
    for c in commands:
        print(f"  {c}")
    if kind == "systemd" and commands[0].startswith("systemctl --user link"):
        print(f"(the link points at {path}: keep the file there, or copy it into "
              f"{service.default_path(kind).parent}/ instead of linking it)")
    return 0


def _service_api_keys(args) -> dict[str, str]:
    """The service's environment for the HTTP API's keys: KAFILA_API_KEYS carried from this shell
    (checked as the daemon checks it) when set; a non-loopback --http without keys is refused, as the
    daemon would refuse it (kafilad/control/auth.py check_binding), unless --http-insecure.

    Raises:
        UsageError: a key the daemon would refuse, or keys missing for a non-loopback --http.
    """
    from kafila_ctl.client import UsageError
    from kafilad.control.auth import KEYS_ENV, check_binding, keys_from
    from kafilad.main import DEFAULT_HTTP, http_address
    try:
        keys = keys_from([])
        http = http_address(args.http) if args.http else DEFAULT_HTTP
        if http is not None:
            check_binding(http[0], keys, args.http_insecure)
    except KafilaError as e:
        raise UsageError(f"{e} (For the service: export {KEYS_ENV} in this shell before `service install`, which "
                         "writes it into the service file, mode 0600.)") from None
    return {KEYS_ENV: os.environ[KEYS_ENV].strip()} if keys else {}


def _daemon_checked(check):
    """An argparse `type` passing a value to one of the daemon's own parsers (kafilad/main.py), so
    kafila-ctl refuses what kafilad would; the value is kept as written."""
    def parse(text: str) -> str:
        check(text)
        return text.strip()
    return parse


#: every state `wait --state` accepts (kafilad/daemon.py WAIT_STATES)
WAIT_STATES = sorted({s.value for s in sm.HostState} | {s.value for s in sm.MemberState}
                     | {"idle", "reconnecting", "restoring"})  # the last two: kafilad/proto/comeback.py


#: the largest --max-tokens the control API carries (a 32-bit count; a session's context is far smaller)
MAX_TOKENS_ARG = 2**31 - 1


def _max_tokens(text: str) -> int:
    """argparse type of --max-tokens: an integer from 1 to MAX_TOKENS_ARG, else a sentence."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-tokens takes a whole number of tokens, not {text!r}") from None
    if not 1 <= n <= MAX_TOKENS_ARG:
        raise argparse.ArgumentTypeError(f"--max-tokens must be between 1 and {MAX_TOKENS_ARG} (got {n}); the "
                                         "session's context bounds it further")
    return n


def _version() -> str:
    from kafilad.main import package_version
    return f"kafila-ctl {package_version()}"


STATE_DIR_HELP = ("the daemon's state directory (default: $KAFILA_STATE_DIR, else the platform's user state dir, "
                  "e.g. ~/.local/state/kafila)")


class _Parser(argparse.ArgumentParser):
    """Subcommand parsers that also take the global options after the subcommand
    (`kafila-ctl status --state-dir D` as well as `kafila-ctl --state-dir D status`)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        if kw.get("prog", "").startswith("kafila-ctl "):
            self.add_argument("--state-dir", default=argparse.SUPPRESS, help=STATE_DIR_HELP)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kafila-ctl", description="Control a local kafilad.")
    p.add_argument("--version", action="version", version=_version())
    p.add_argument("--state-dir", help=STATE_DIR_HELP)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("keys", help="this daemon's peer id and key fingerprint")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_keys)

    s = sub.add_parser("host", help="open a session and print its code")
    s.add_argument("--model", required=True,
                   help="model directory (config.json + *.safetensors + tokenizer), the name of a model "
                        "shipped with kafila (stories260K), or a Hugging Face repo id ORG/NAME[@REVISION]: the "
                        "daemon takes it from its Hugging Face cache, else downloads only the files it needs")
    s.add_argument("--members", type=int, required=True, help="machines in the session, the host included")
    s.add_argument("--context", type=int, default=None,
                   help="tokens of context to admit (default 4096, capped at the model's max_position_embeddings)")
    s.add_argument("--concurrency", type=int, default=1, help="concurrent requests to admit (default 1)")
    s.add_argument("--queue", type=int, default=None,
                   help="requests that may wait for a turn beyond --concurrency (default 4 x --concurrency); "
                        "past it requests are refused as busy (HTTP 429)")
    s.add_argument("--rendezvous", help="rendezvous URL (default: the daemon's)")
    s.add_argument("--open", action="store_true", help="admit any holder of the code without approval")
    s.add_argument("--admit-timeout", type=float, default=120.0, help="seconds a pending key waits (default 120)")
    s.add_argument("--strategy", choices=STRATEGIES, default=DEFAULT_STRATEGY,
                   help="division to serve with (as `plan` has): load (most tokens/s at --concurrency; members "
                        "may stand by), kafila (the paper's exact partition, least bottleneck, every member "
                        f"holds blocks), uniform or memory (the baselines of DESIGN §5.5; default {DEFAULT_STRATEGY})")
    s.add_argument("--head", choices=("auto", "self", "any"), default="auto",
                   help="self: this host is the head of every plan, so only it sees prompts and samples tokens "
                        "(a faster member never takes the head); auto: the planner chooses among this host and "
                        "the members whose reported speed their measured stage times confirmed, and replans around a "
                        "report they find off (default); any: trusts the members' reports (a group whose machines "
                        "are all its own): any member may head, a report found off is shown, not acted on")
    s.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="a small model with the same tokenizer that proposes speculative decoding's drafts "
                        "(instead of looking them up in the prompt and output); it runs on the ring's head (a "
                        "member head fetches it from this host), and the planner counts its weights in the head's share")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_host)

    s = sub.add_parser("join", help="join a session by its code")
    s.add_argument("code")
    s.add_argument("--rendezvous", help="rendezvous URL (default: the daemon's)")
    s.add_argument("--no-wait", action="store_true",
                   help="return once admitted, without following the fetch and load until ready")
    s.set_defaults(func=cmd_join)

    s = sub.add_parser("pending", help="keys waiting for admission")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_pending)
    for name, fn in (("admit", cmd_admit), ("deny", cmd_deny)):
        s = sub.add_parser(name, help=f"{name} a pending peer (peer id or name)")
        s.add_argument("peer")
        s.set_defaults(func=fn)

    s = sub.add_parser("trust", help="the host's trusted keys: list, or revoke one")
    trust = s.add_subparsers(dest="trust_command", required=True)
    t = trust.add_parser("list", help="trusted keys (the roster, and this session's own admissions)")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=cmd_trust_list)
    t = trust.add_parser("revoke", help="forget a trusted key (peer id or name)")
    t.add_argument("peer")
    t.set_defaults(func=cmd_trust_revoke)

    s = sub.add_parser("status", help="the session: members, blocks, stage times")
    s.add_argument("--json", action="store_true")
    s.add_argument("--watch", action="store_true",
                   help="live view pushed by the daemon; into a pipe or file, one timestamped line per change")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("wait", help="wait until the session reaches a state (default: ready; a member on standby "
                                    "counts as ready)")
    s.add_argument("--state", action="append", default=None, choices=WAIT_STATES, metavar="STATE",
                   help=f"a state to wait for, repeatable (default ready); one of {', '.join(WAIT_STATES)}")
    s.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds to wait before giving up (default 300)")
    s.set_defaults(func=cmd_wait)

    s = sub.add_parser("generate", help="generate from a prompt (host only)")
    s.add_argument("prompt")
    s.add_argument("--max-tokens", type=_max_tokens, default=64, help="tokens to generate at most (default 64)")
    s.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default 0)")
    s.add_argument("--json", action="store_true", help="print {text, token_ids, ...} as JSON at the end")
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("chat", help="chat with the served model (host only); /help lists its commands, /exit or EOF ends")
    s.add_argument("--system", help="a system message")
    s.add_argument("--max-tokens", type=_max_tokens, default=256, help="tokens per reply at most (default 256)")
    s.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default 0)")
    s.set_defaults(func=cmd_chat)

    s = sub.add_parser("trace", help="print the session trace (JSONL)")
    s.set_defaults(func=cmd_trace)
    s = sub.add_parser("leave", help="leave or close the current session")
    s.set_defaults(func=cmd_leave)
    s = sub.add_parser("stop", help="stop the daemon")
    s.set_defaults(func=cmd_stop)
    s = sub.add_parser("schedule", help="show or set the head's decode schedule (on the host or the member that heads the ring)")
    s.add_argument("mode", nargs="?", default=None,
                   help="auto (micro-batches from measured stage times, the default), lockstep, per-request, "
                        "or a number of micro-batches in flight")
    s.set_defaults(func=cmd_schedule)
    s = sub.add_parser("speculate", help="show or set the head's speculative decoding (host as head)")
    s.add_argument("mode", nargs="?", default=None,
                   help="auto (drafts per pass from measured acceptance and pass cost, the default), off, or k=N")
    s.set_defaults(func=cmd_speculate)

    s = sub.add_parser("demo", help="rendezvous + daemons on loopback: form a session, generate, stop")
    which = s.add_mutually_exclusive_group()
    which.add_argument("--model", help="model directory or the name of a model shipped with kafila "
                                       "(default: stories260K, a tiny English model shipped with kafila)")
    which.add_argument("--synth", action="store_true",
                       help="serve a synthesised random-weight model instead (its text is noise; for shapes)")
    s.add_argument("--members", type=int, default=3, help="daemons on the ring (default 3)")
    s.add_argument("--prompt", default="Once upon a time", help="the prompt (default: %(default)r)")
    s.add_argument("--max-tokens", type=_max_tokens, default=32, help="tokens to generate (default 32)")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("service", help="run kafilad as a user service (systemd or launchd)")
    svc = s.add_subparsers(dest="service_command", required=True, parser_class=_Parser)
    t = svc.add_parser("install", help="write a systemd user unit (Linux) or launchd agent (macOS) that runs "
                                       "kafilad with this Python (sys.executable -m kafilad.main)")
    from kafilad.main import http_address, rendezvous_url
    t.add_argument("--rendezvous", type=_daemon_checked(rendezvous_url),
                   help="the daemon's default rendezvous URL, ws://HOST:PORT (default: $KAFILA_RENDEZVOUS)")
    t.add_argument("--name", help="this member's name (default: the host name)")
    t.add_argument("--http", type=_daemon_checked(http_address),
                   help="the daemon's --http: HOST:PORT, PORT or off (default 127.0.0.1:8400); an address "
                        "other machines reach needs KAFILA_API_KEYS in this shell (carried into the service file) "
                        "or --http-insecure")
    t.add_argument("--http-insecure", action="store_true",
                   help="the daemon's --http-insecure: serve the API beyond loopback without a key")
    t.add_argument("--manager", choices=("systemd", "launchd"),
                   help="service manager (default: launchd on macOS, systemd elsewhere)")
    t.add_argument("--path", help="file to write (default ~/.config/systemd/user/kafilad.service or "
                                  "~/Library/LaunchAgents/org.kafila.kafilad.plist)")
    t.add_argument("--force", action="store_true", help="replace a different existing file")
    t.add_argument("--print", action="store_true", help="print the file instead of writing it")
    t.set_defaults(func=cmd_service_install)

    try:
        from kafila_ctl import plan_cmd
        plan_cmd.add_parser(sub)
    except ImportError:  # pragma: no cover - the planner CLI is part of the package
        pass
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kafila_ctl.client import UsageError
    try:
        return args.func(args) or 0
    except UsageError as e:
        print(f"kafila-ctl: {e}", file=sys.stderr)
        return 2
    except KafilaError as e:
        print(f"kafila-ctl: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `kafila-ctl status --json | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0


if __name__ == "__main__":
    sys.exit(main())
