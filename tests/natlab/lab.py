"""Helpers for tests inside the NAT lab built by scripts/natlab.sh (DESIGN §9.3, ../shared/natlab.md).

- :func:`lab` brings the lab up with one NAT class per member ("@K": behind member K's NAT) and
  always tears it down.
- :class:`Lab` runs commands in its namespaces; members are named "m1", "m2", ...
- :func:`stun_server` / :func:`coturn` run a STUN server in kf-rdv for the length of a ``with``.

Addresses: rendezvous 172.16.0.10 and 172.16.0.11; member i 10.0.i.2 behind 172.16.0.(20+i).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "natlab.sh"
RDV_IPS = ("172.16.0.10", "172.16.0.11")
STUN_PORTS = (3478, 3479)
STUN_GRID = [(ip, port) for ip in RDV_IPS for port in STUN_PORTS]
IN_CI = os.environ.get("CI", "").lower() == "true"


def unavailable_reason(*extra_tools: str) -> str | None:
    """Why the lab cannot run here, or None when it can (root, Linux, ip, nft and ``extra_tools``)."""
    if sys.platform != "linux":
        return "the NAT lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the NAT lab needs root (network namespaces and nftables)"
    for tool in ("ip", "nft", *extra_tools):
        if shutil.which(tool) is None:
            return f"the NAT lab needs '{tool}' (apt-get install -y iproute2 nftables coturn)"
    return None


@dataclass(frozen=True)
class Lab:
    """A running lab: ``classes[i]`` is the NAT class of member ``f"m{i + 1}"``."""

    classes: tuple[str, ...]

    @property
    def members(self) -> list[str]:
        return [f"m{i + 1}" for i in range(len(self.classes))]

    def class_of(self, member: str) -> str:
        """The NAT class of ``member``; one behind another member's NAT ("@K") has that NAT's class."""
        cls = self.classes[int(member[1:]) - 1]
        return self.class_of(f"m{cls[1:]}") if cls.startswith("@") else cls

    def nat_of(self, member: str) -> str:
        """The namespace of the NAT ``member`` sits behind ("nat1", ...)."""
        cls = self.classes[int(member[1:]) - 1]
        return f"nat{cls[1:]}" if cls.startswith("@") else f"nat{member[1:]}"

    @staticmethod
    def argv(ns: str, *cmd: str) -> list[str]:
        """argv running ``cmd`` inside namespace ``ns`` ("rdv", "m1", "nat1", ...)."""
        return ["ip", "netns", "exec", ns if ns.startswith("kf-") else f"kf-{ns}", *cmd]

    def run(self, ns: str, *cmd: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(ns, *cmd), capture_output=True, text=True, timeout=timeout_s, cwd=REPO)

    def python(self, ns: str, *args: str) -> list[str]:
        """argv for this interpreter inside ``ns`` (the repo is importable: pip install -e)."""
        return self.argv(ns, sys.executable, *args)

    def run_all(self, argvs: dict[str, list[str]], timeout_s: float = 60.0) -> dict[str, subprocess.CompletedProcess]:
        """Run one command per key concurrently; results by key."""
        procs = {k: subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
                 for k, a in argvs.items()}
        out = {}
        for k, p in procs.items():
            stdout, stderr = p.communicate(timeout=timeout_s)
            out[k] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
        return out

    def wait_udp_listening(self, ns: str, addresses: Sequence[tuple[str, int]], timeout_s: float = 10.0) -> None:
        """Block until every (ip, port) is a bound UDP socket in ``ns`` (polls ``ss``)."""
        wanted = {f"{ip}:{port}" for ip, port in addresses}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            listing = self.run(ns, "ss", "-Hlun").stdout
            local = {line.split()[3] for line in listing.splitlines() if len(line.split()) > 3}
            if wanted <= local:
                return
            time.sleep(0.05)
        raise AssertionError(f"nothing listens on {sorted(wanted)} in {ns} after {timeout_s} s")


def _script(*args: str) -> None:
    result = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"scripts/natlab.sh {' '.join(args)} failed: {result.stderr.strip()}")


#: Held while a lab is up: the namespaces are machine-wide ("up" first kills what runs in any kf-*
#: namespace), so two test runs on one machine take turns instead of tearing down each other's lab.
LOCK_PATH = os.environ.get("NATLAB_LOCK", "/run/kafila-natlab.lock")


@contextlib.contextmanager
def lab(classes: Sequence[str]) -> Iterator[Lab]:
    """Bring the lab up with ``classes`` (each "O", "C", "S", "N" or "@K") and tear it down after.

    Waits for any other process's lab on this machine to be torn down first (``LOCK_PATH``).
    """
    with open(LOCK_PATH, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _script("up", *classes)
            try:
                yield Lab(tuple(classes))
            finally:
                _script("down")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def _background(lab_: Lab, argv: list[str], log: Path, listen: Sequence[tuple[str, int]]) -> Iterator[subprocess.Popen]:
    with open(log, "w") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            lab_.wait_udp_listening("rdv", listen)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def stun_server(lab_: Lab, log: Path, addresses: Sequence[tuple[str, int]] = STUN_GRID):
    """Our STUN responder (kafilad.rendezvous.stun_server) in kf-rdv on ``addresses``."""
    argv = lab_.python("rdv", "-m", "kafilad.rendezvous.stun_server", *(f"{ip}:{port}" for ip, port in addresses))
    return _background(lab_, argv, log, addresses)


def coturn(lab_: Lab, log: Path):
    """coturn's turnserver in kf-rdv as an RFC 5780 STUN server on the 2 x 2 grid (4.6.x flags)."""
    pidfile = log.with_suffix(".pid")
    argv = lab_.argv(
        "rdv", "turnserver", "-n", "--stun-only", "--no-cli", "--no-tcp", "--no-tls", "--no-dtls",
        "--listening-ip", RDV_IPS[0], "--listening-ip", RDV_IPS[1],
        "--listening-port", str(STUN_PORTS[0]), "--alt-listening-port", str(STUN_PORTS[1]),
        "--log-file", "stdout", "--simple-log", "--pidfile", str(pidfile))
    return _background(lab_, argv, log, STUN_GRID)
