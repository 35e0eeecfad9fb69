"""`kafila-ctl demo` and the loopback cluster used by tests and benchmarks.

Starts a rendezvous and N daemons as separate processes with separate state directories on
loopback, forms a session (the first daemon hosts), and drives it through the same control API
that `kafila-ctl` uses.
"""

from __future__ import annotations

import os
import re
import socket
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import trio

from kafilad.errors import KafilaError
from kafila_ctl.client import ControlClient, DaemonNotRunning

START_TIMEOUT_S = 30.0

#: the division `LoopbackCluster.form` asks for unless told: the paper's, every member holds blocks.
#: Under the host's default ("load", members stand by when that is predicted faster) some equal
#: daemons of one machine may stand by, as their probes' noise says; a loopback cluster exists to
#: run a ring.
RING_STRATEGY = "kafila"

#: Under the host's default head ("auto") the host moves the head to a member once that member's
#: report is confirmed and promises >= 25% (kafilad.node.session.host REHEAD_GAIN): between equal
#: daemons of one machine that promise is the noise of their probes, and the move re-forms the ring
#: after the first request (a CI run saw a session "recovering" right after one). The host heads.
RING_HEAD = "self"


#: the context `LoopbackCluster.form` (and so `kafila-ctl demo`) asks the host for, in tokens
DEMO_CONTEXT = 512


#: prompts of the concurrent load `LoopbackCluster.aggregate_tps` sends (different prompts, short)
LOAD_PROMPTS = ("Once upon a time", "The caravan left at dawn", "Kafila serves a model", "A ring of machines",
                "In the beginning", "Tokens travel round", "Seven camels", "Under the desert sky")


class LoopbackCluster:
    """A rendezvous plus `n` kafilad processes on 127.0.0.1, each with its own state dir.

    Use as a context manager; every process is stopped (SIGTERM, then SIGKILL) on exit.
    Attributes:
        root: temporary directory holding state dirs (`m0`, `m1`, ...) and logs.
        rdv_url: ws://127.0.0.1:PORT of the rendezvous.
        record_path: file receiving every payload the rendezvous relayed (when `record_relay`).
    """

    def __init__(self, n: int, *, root: Optional[str] = None, record_relay: bool = False,
                 names: Optional[list[str]] = None, env: Optional[dict] = None,
                 hop_delay_ms: Optional[float] = None, hop_mbps: Optional[float] = None):
        self.n = n
        #: an emulated WAN hop in front of every daemon (kafila_ctl/wan_hops.py): each direct ring edge
        #: is delayed `hop_delay_ms` each way and capped at `hop_mbps`; None: plain loopback
        self.hop_delay_ms, self.hop_mbps = hop_delay_ms, hop_mbps
        self.hops: list[tuple[subprocess.Popen, str, str]] = []  # (forwarder, its address, the daemon's UDP address)
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="kafila-demo-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.record_path = self.root / "relay.rec" if record_relay else None
        self.names = names or [f"m{i}" for i in range(n)]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.rdv: Optional[subprocess.Popen] = None
        self.daemons: list[Optional[subprocess.Popen]] = []
        self.rdv_url = ""
        self.stun: list[tuple[str, int]] = []  # STUN addresses the rendezvous also serves

    def state_dir(self, i: int) -> Path:
        return self.root / self.names[i]

    def client(self, i: int) -> ControlClient:
        return ControlClient(self.state_dir(i) / "kafilad.sock")

    def __enter__(self) -> "LoopbackCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def rendezvous_argv(self, listen: str = "127.0.0.1:0") -> list[str]:
        """The rendezvous command; it prints `rendezvous listening on ws://IP:PORT` when bound."""
        cmd = [sys.executable, "-m", "kafilad.main", "rendezvous", "--listen", listen]
        for host, port in self.stun:
            cmd += ["--stun", f"{host}:{port}"]
        if self.record_path:
            cmd += ["--record-relay", str(self.record_path)]
        return cmd

    def daemon_argv(self, i: int) -> list[str]:
        return [sys.executable, "-m", "kafilad.main", "--state-dir", str(self.state_dir(i)), "--name", self.names[i],
                "--rendezvous", self.rdv_url, "--http", "127.0.0.1:0"]

    def daemon_env(self, i: int) -> dict:
        if not self.hops:
            return self.env
        _proc, advertised, bind = self.hops[i]
        return {**self.env, "KAFILA_UDP_BIND": bind, "KAFILA_TEST_ADVERTISE": advertised}

    def start_hops(self) -> None:
        """One WAN hop forwarder per daemon (`python -m kafila_ctl.wan_hops`), in front of a UDP port
        chosen for the daemon; its address is the daemon's only candidate (KAFILA_TEST_ADVERTISE)."""
        for i in range(self.n):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.bind(("127.0.0.1", 0))
                bind = f"127.0.0.1:{s.getsockname()[1]}"
            cmd = [sys.executable, "-m", "kafila_ctl.wan_hops", "--listen", "127.0.0.1:0", "--upstream", bind,
                   "--hop-delay-ms", str(self.hop_delay_ms)] + (["--hop-mbps", str(self.hop_mbps)] if self.hop_mbps else [])
            log = open(self.root / f"hop-{self.names[i]}.log", "ab")
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=self.env)
            self.hops.append((proc, "", bind))
            line = proc.stdout.readline().decode()
            m = re.search(r"listening on ([\d.]+:\d+)", line)
            if not m:
                raise KafilaError(f"The WAN hop forwarder did not start: {line!r}; see {self.root / f'hop-{self.names[i]}.log'}.")
            self.hops[-1] = (proc, m.group(1), bind)

    def start(self) -> None:
        if self.hop_delay_ms is not None:
            self.start_hops()
        self.start_rendezvous()
        for i in range(self.n):
            self.daemons.append(self.start_daemon(i))
        for i in range(self.n):
            self.wait_daemon(i)

    def start_rendezvous(self, listen: str = "127.0.0.1:0") -> None:
        """Start the rendezvous (again, on the same address when `listen` names it: a restart)."""
        log = open(self.root / "rendezvous.log", "ab")
        self.rdv = subprocess.Popen(self.rendezvous_argv(listen), stdout=subprocess.PIPE, stderr=log, env=self.env)
        line = self.rdv.stdout.readline().decode()
        m = re.search(r"ws://([\d.]+):(\d+)", line)
        if not m:
            raise KafilaError(f"The rendezvous did not start: {line!r}; see {self.root / 'rendezvous.log'}.")
        self.rdv_url = f"ws://{m.group(1)}:{m.group(2)}"

    def restart_rendezvous(self) -> None:
        """Kill the rendezvous and start a new one on the same address (its state is gone)."""
        if self.rdv is not None and self.rdv.poll() is None:
            self.rdv.kill()
            self.rdv.wait(timeout=10)
        if self.rdv is not None and self.rdv.stdout:
            self.rdv.stdout.close()
        self.start_rendezvous(self.rdv_url.removeprefix("ws://"))

    def start_daemon(self, i: int) -> subprocess.Popen:
        self.state_dir(i).mkdir(parents=True, exist_ok=True)
        log = open(self.root / f"{self.names[i]}.log", "ab")
        return subprocess.Popen(self.daemon_argv(i), stdout=log, stderr=log, env=self.daemon_env(i))

    def wait_daemon(self, i: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                trio.run(self.client(i).call, "keys")
                return
            except DaemonNotRunning:
                if self.daemons[i].poll() is not None or time.monotonic() > deadline:
                    raise KafilaError(f"kafilad {self.names[i]} did not start; see {self.root / (self.names[i] + '.log')}.")
                time.sleep(0.1)

    def call(self, i: int, op: str, **args):
        return trio.run(lambda: self.client(i).call(op, **args))

    def form(self, model_dir: str, *, members: Optional[int] = None, context: int = DEMO_CONTEXT, concurrency: int = 1,
             timeout_s: float = 120.0, rendezvous: Optional[str] = None,
             strategy: Optional[str] = RING_STRATEGY, head: Optional[str] = RING_HEAD) -> dict:
        """Host on daemon 0 (open session), join with the others, wait until ready; return timings.

        Args:
            rendezvous: URL for host and joins instead of the daemons' default (e.g. a test proxy).
            strategy: the host's division strategy (kafila-ctl host --strategy); default RING_STRATEGY,
                None for the host's own default (kafilad.planner.DEFAULT_STRATEGY).
            head: `host --head` ("auto", "self", "any"); default RING_HEAD, None for the host's own
                default ("auto").
        """
        members = members or self.n
        t0 = time.perf_counter()
        code = self.call(0, "host", model_dir=model_ref(str(model_dir)), members=members, context=context,
                         concurrency=concurrency, open=True, rendezvous=rendezvous,
                         **({"strategy": strategy} if strategy else {}), **({"head": head} if head else {}))["code"]

        async def join_all():
            async with trio.open_nursery() as nursery:
                for i in range(1, members):
                    nursery.start_soon(lambda i=i: self.client(i).call("join", code=code, rendezvous=rendezvous))
        trio.run(join_all)
        snap = self.call(0, "wait", states=["ready"], timeout_s=timeout_s)
        return {"code": code, "form_s": time.perf_counter() - t0, "status": snap}

    def aggregate_tps(self, k: int, tokens: int, prompts=LOAD_PROMPTS) -> float:
        """Run `k` greedy requests of `tokens` tokens at once through the host's control socket
        (prompts[i % len(prompts)]); return all generated tokens / wall seconds (prefill included).
        The load of scripts/bench_batching.py and scripts/bench_fleet.py."""
        counts = []

        async def one(prompt):
            r = await self.client(0).call("generate", prompt=prompt, max_tokens=tokens)
            counts.append(len(r["token_ids"]))

        async def main():
            async with trio.open_nursery() as nursery:
                for i in range(k):
                    nursery.start_soon(one, prompts[i % len(prompts)])
        t0 = time.perf_counter()
        trio.run(main)
        return sum(counts) / (time.perf_counter() - t0)

    def generate(self, prompt: str, max_tokens: int, temperature: float = 0.0) -> dict:
        return self.call(0, "generate", prompt=prompt, max_tokens=max_tokens, temperature=temperature)

    def stop(self) -> None:
        procs = [p for p in self.daemons if p is not None] + ([self.rdv] if self.rdv else []) + [h[0] for h in self.hops]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.rdv and self.rdv.stdout:
            self.rdv.stdout.close()
        for proc, _, _ in self.hops:
            if proc.stdout:
                proc.stdout.close()
        if self._own_root and not os.environ.get("KAFILA_KEEP_DEMO"):
            shutil.rmtree(self.root, ignore_errors=True)


#: the model `kafila-ctl demo` serves by default: karpathy's stories260K, shipped in the package
#: (kafila_ctl/models/stories260K: MIT licence, README and LICENSE beside the weights)
DEMO_MODEL = "stories260K"


def packaged_model_dir(name: str = DEMO_MODEL) -> Path:
    """The directory of a model shipped inside the kafila_ctl package.

    Raises:
        KafilaError: the package was installed without its model files.
    """
    from importlib.resources import files
    path = Path(str(files("kafila_ctl") / "models" / name))
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise KafilaError(f"The packaged model {name} is missing from {path}; reinstall kafila "
                          "(its package data holds the model) or pass --model DIR or --synth.")
    return path


def shipped_models() -> list[str]:
    """Names of the models shipped inside the kafila_ctl package (kafila_ctl/models/NAME)."""
    from importlib.resources import files
    root = Path(str(files("kafila_ctl") / "models"))
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file()) if root.is_dir() else []


def model_ref(model: str) -> str:
    """What `--model` names, as the daemon is to receive it (`kafila-ctl host`, `kafila-ctl demo`).

    In this order: a Hugging Face repo id (ORG/NAME[@REV]) or an Ollama model (ollama:NAME[:TAG]) as
    given, for the daemon to resolve (kafilad/modelref.py); a path that exists, made absolute (the daemon's working directory
    differs); a bare name of a model shipped with kafila (`stories260K`), its directory in the
    package; any other path made absolute (the daemon says what it lacks).

    Raises:
        KafilaError: a bare name (no '/') that is none of these, naming each place looked at.
    """
    from kafilad.modelref import OLLAMA_PREFIX, parse_repo_id
    if parse_repo_id(model) is not None or model.startswith(OLLAMA_PREFIX):
        return model  # the daemon resolves it (kafilad/modelref.py)
    path = Path(model).expanduser().resolve()
    if path.exists() or not model or "/" in model or os.sep in model or model[0] in "~.":
        return str(path)
    shipped = shipped_models()
    for name in shipped:
        if name.lower() == model.lower():
            return str(packaged_model_dir(name))
    raise KafilaError(f"There is no model {model!r}: it is not a directory here ({path}), not one of the models "
                      f"shipped with kafila ({', '.join(shipped) or 'none are installed'}), and not a Hugging Face "
                      "repo id (ORG/NAME). Pass a model directory, a shipped model's name, or a repo id.")


def printable(text: str) -> str:
    """`text` with control characters other than newline and tab shown as escapes."""
    return "".join(c if c.isprintable() or c in "\n\t" else ascii(c)[1:-1] for c in text)


#: token ids of a random-weight model's generation the demo shows (the rest are counted)
SHOWN_NOISE_IDS = 16


def generation_markup(prompt: str, result: dict, *, synth: bool) -> str:
    """The demo's line for one generation (rich markup): the prompt in bold, then the text.

    A random-weight model (`synth`) emits arbitrary bytes, which decode to replacement characters
    and control codes (a new user read them as raw bytes): its line shows the generated token ids
    instead of that text.

    Args:
        result: the `generate` result ("text", "token_ids").
    """
    from rich.markup import escape
    head = f"[bold]{escape(printable(prompt))}[/bold]"
    if not synth:
        return head + escape(printable(result["text"]))
    ids = [str(i) for i in result["token_ids"]]
    more = f" ... ({len(ids) - SHOWN_NOISE_IDS} more)" if len(ids) > SHOWN_NOISE_IDS else ""
    return (f"{head} -> token ids {' '.join(ids[:SHOWN_NOISE_IDS])}{more} (random weights: the text they decode "
            "to is noise, not shown)")


def ring_note(status: dict) -> str:
    """What the demo says of its ring after the plan line, from the host's status: that every member
    holds blocks only when each does (a trial's `demo --model` said so while two members, lost after
    their stages failed, held none); else who holds none, and why when status says it.

    Args:
        status: the host's `status` snapshot ("members": [{"name", "blocks", "lost"?, "standby"?}]).
    """
    members = status.get("members") or []
    idle = [m for m in members if not m.get("blocks")]
    if members and not idle:
        return "the demo's ring: every member holds blocks"
    parts = []
    for m in idle:
        why = "lost: " + str(m["lost"]).rstrip(".") if m.get("lost") else "on standby" if m.get("standby") else \
            "no blocks"
        parts.append(f"{m.get('name')} ({why})")
    return "holding no blocks: " + "; ".join(parts) if parts else "no member holds blocks"


def check_demo_args(model: str, members: int, context: int = DEMO_CONTEXT) -> None:
    """Refuse what the demo's host would refuse, before any process starts: `members` outside 1 to
    the model's blocks or a `context` past the model's (the host's own check, kafila_ctl/checks.py),
    and a model directory the daemon could not read (kafilad.modelinfo's sentence). A Hugging Face
    repo id is read by the daemon.

    Args:
        model: what `model_ref` made of --model (a directory, or a repo id).
        context: the context `LoopbackCluster.form` asks the host for.
    Raises:
        UsageError: any of these refusals.
    """
    from kafila_ctl.checks import host_refusal
    from kafila_ctl.client import UsageError
    from kafilad.modelinfo import read_model_info
    from kafilad.modelref import parse_repo_id
    if parse_repo_id(model) is not None:
        if members < 1:
            raise UsageError(f"--members counts the daemons on the demo's ring, each holding at least one block: "
                             f"give 1 or more (got {members}).")
        return
    try:
        info = read_model_info(model)
    except KafilaError as e:
        raise UsageError(str(e)) from None
    refusal = host_refusal(info, members=members, context=context)
    if refusal is not None:
        raise UsageError(refusal)


def run_demo(*, model: Optional[str], members: int, prompt: str, max_tokens: int, synth: bool = False) -> int:
    """The `kafila-ctl demo` command: serve `model` (default: the packaged stories260K; `synth`:
    the synthesised random-weight model) on a loopback ring and print a generation. Every argument
    is checked before anything starts (`check_demo_args`).

    Raises:
        UsageError: a model or --members the host would refuse (exit status 2).
        KafilaError: a model name that matches nothing (`model_ref`), or a process that did not start.
    """
    from rich.console import Console
    from rich.markup import escape
    from kafila_ctl.render import members_table
    console = Console()
    if synth:
        from kafilad.executor.synth import default_synth_model_dir
        model = str(default_synth_model_dir())
        said = (f"model: synthesised at {escape(model)}: random weights and a byte-level tokenizer, so its text is "
                "noise; it shows the ring's shapes and timings (`kafila-ctl demo` alone serves a real tiny model)")
    elif model is not None:
        model = model_ref(model)  # before any daemon starts: a name that matches nothing is a sentence
        said = None
    else:
        model = str(packaged_model_dir())
        said = (f"model: {DEMO_MODEL}, Andrej Karpathy's 260K-parameter TinyStories Llama (MIT licence), "
                f"shipped with kafila at {escape(model)}")
    check_demo_args(model, members)
    if said:
        console.print(said)
    with LoopbackCluster(members) as cluster:
        console.print(f"rendezvous {cluster.rdv_url}; {members} daemons started")
        formed = cluster.form(model, members=members)
        console.print(f"session {formed['code']} formed in {formed['form_s']:.2f} s")
        console.print(members_table(formed["status"]))
        plan = formed["status"].get("plan") or {}
        console.print(f"plan: bottleneck {plan.get('bottleneck_s', 0) * 1e3:.3f} ms, "
                      f"utilisation {plan.get('utilization', 0):.0%}, tier {plan.get('tier')}, strategy "
                      f"{plan.get('strategy')} ({escape(ring_note(formed['status']))})")
        result = cluster.generate(prompt, max_tokens)
        console.print(generation_markup(prompt, result, synth=synth))
        tps = result.get("decode_tokens_per_s")
        console.print(f"{len(result['token_ids'])} tokens; decode {tps:.1f} tokens/s" if tps else
                      f"{len(result['token_ids'])} tokens")
    return 0
