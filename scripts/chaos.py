"""Chaos run (issue 8): a stream of requests while members and the rendezvous fail and come back.

A rendezvous and N daemons on loopback (real processes) serve stories260K (or `--model DIR`).
One thread sends greedy requests back to back; the main thread injects a fault every
`--interval` seconds, chosen at random:

- `kill`: SIGKILL a non-host member, restart it (same state dir) after 2 s;
- `freeze`: SIGSTOP a non-host member for 12 s, then SIGCONT;
- `rendezvous`: kill the rendezvous, start a new one on the same address after 2 s;
- `host`: SIGTERM the host daemon and start it again (it re-hosts the session).

After each fault it waits for the session to be `ready` with every member planned again and
records that recovery time (fault to full recovery). Every request must either return the
reference tokens or fail with a sentence (a KafilaError without "Internal error"); no daemon
may exit except those the script killed. A request a loss paused runs again and its stream goes on
(issue 25 item 4): it counts as ok once its tokens are the reference's (`requests_resumed` counts
those); failures are counted by the fault injected last (`failed_after_fault`). Prints a JSON report; exit status 1 on any violation.

    python scripts/chaos.py --minutes 5               # the full run (docs/healing.md)
    python scripts/chaos.py --seconds 45 --faults kill,rendezvous   # a short run (tests/scripts)
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

from kafila_ctl.demo import LoopbackCluster
from kafilad.errors import KafilaError

PROMPT = "Once upon a time"
MAX_TOKENS = 16
RECOVERY_LIMIT_S = 30.0


def reference(model_dir: Path) -> list[int]:
    """Greedy tokens of single-process mlx-lm for PROMPT (the token-identity oracle)."""
    import kafilad.executor  # noqa: F401 - the same BLAS as the daemons, loaded before mlx
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    model, tok = load(str(model_dir))
    ids = mx.array(tok.encode(PROMPT))
    out = []
    for token, _ in generate_step(ids, model, max_tokens=MAX_TOKENS):
        token = int(token)
        if token in tok.eos_token_ids:
            break
        out.append(token)
    return out


def default_model() -> Path:
    import kafila_ctl
    return Path(kafila_ctl.__file__).parent / "models" / "stories260K"


class Requests(threading.Thread):
    """Greedy requests back to back; each outcome is checked and counted."""

    def __init__(self, cluster: LoopbackCluster, ref: list[int]):
        super().__init__(daemon=True)
        self.cluster, self.ref = cluster, ref
        self.stop = threading.Event()
        self.ok = self.failed = 0
        #: requests that a loss paused and that went on to the reference tokens (a `retried_after` record)
        self.resumed = 0
        #: the fault injected last (failures are counted by it, `failed_after`)
        self.fault = "none"
        self.failed_after: dict[str, int] = {}
        self.violations: list[str] = []
        self.errors: dict[str, int] = {}

    def _failed(self, key: str) -> None:
        self.failed += 1
        self.errors[key] = self.errors.get(key, 0) + 1
        self.failed_after[self.fault] = self.failed_after.get(self.fault, 0) + 1

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                result = self.cluster.generate(PROMPT, MAX_TOKENS)
            except KafilaError as e:
                msg = str(e)
                if not msg or "Internal error" in msg or "internal error" in msg:
                    self.violations.append(f"a request failed without a sentence: {msg!r}")
                self._failed(msg.split(":")[0][:80])
                time.sleep(0.3)
                continue
            except Exception as e:  # noqa: BLE001 - the host daemon itself may be restarting
                self._failed(type(e).__name__)
                time.sleep(0.3)
                continue
            if result["token_ids"] != self.ref:
                self.violations.append(f"tokens differ from the reference: {result['token_ids']}")
            else:
                self.ok += 1
                self.resumed += bool(result.get("retried_after"))


def full(cluster: LoopbackCluster) -> bool:
    try:
        st = cluster.call(0, "status")
    except Exception:  # noqa: BLE001 - the host may be restarting
        return False
    return st["state"] == "ready" and sum(1 for m in st["members"] if m["blocks"]) == cluster.n


def wait_full(cluster: LoopbackCluster, since: float, limit_s: float) -> float | None:
    while time.monotonic() - since < limit_s:
        if full(cluster):
            return time.monotonic() - since
        time.sleep(0.25)
    return None


def inject(cluster: LoopbackCluster, fault: str, rng: random.Random) -> None:
    if fault == "kill":
        i = rng.randrange(1, cluster.n)
        cluster.daemons[i].send_signal(signal.SIGKILL)
        cluster.daemons[i].wait()
        time.sleep(2)
        cluster.daemons[i] = cluster.start_daemon(i)
        cluster.wait_daemon(i)
    elif fault == "freeze":
        i = rng.randrange(1, cluster.n)
        cluster.daemons[i].send_signal(signal.SIGSTOP)
        time.sleep(12)
        cluster.daemons[i].send_signal(signal.SIGCONT)
    elif fault == "rendezvous":
        cluster.rdv.kill()
        cluster.rdv.wait()
        time.sleep(2)
        cluster.restart_rendezvous()
    elif fault == "host":
        cluster.daemons[0].send_signal(signal.SIGTERM)
        cluster.daemons[0].wait(timeout=10)
        cluster.daemons[0] = cluster.start_daemon(0)
        cluster.wait_daemon(0)
    else:
        raise SystemExit(f"unknown fault {fault!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--interval", type=float, default=8.0, help="seconds between a recovery and the next fault")
    ap.add_argument("--faults", default="kill,freeze,rendezvous,host")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--root", default=None, help="keep the cluster's logs here")
    args = ap.parse_args(argv)
    duration_s = args.minutes * 60 if args.minutes else args.seconds
    faults = [f for f in args.faults.split(",") if f]
    rng = random.Random(args.seed)
    model = args.model or default_model()
    ref = reference(model)
    report: dict = {"model": str(model), "duration_s": duration_s, "faults": [], "violations": []}
    with LoopbackCluster(args.members, root=args.root) as cluster:
        cluster.form(str(model), members=args.members)
        requests = Requests(cluster, ref)
        requests.start()
        t_end = time.monotonic() + duration_s
        while time.monotonic() < t_end:
            time.sleep(min(args.interval, max(0.0, t_end - time.monotonic())))
            if time.monotonic() >= t_end:
                break
            fault = rng.choice(faults)
            t0 = time.monotonic()
            requests.fault = fault
            inject(cluster, fault, rng)
            recovered = wait_full(cluster, t0, RECOVERY_LIMIT_S + 15)
            report["faults"].append({"fault": fault, "recovery_s": recovered})
            print(f"{fault}: recovered in {recovered if recovered is None else round(recovered, 1)} s", flush=True)
            if recovered is None:
                report["violations"].append(f"no full recovery within {RECOVERY_LIMIT_S + 15:g} s after {fault}")
        requests.stop.set()
        requests.join(timeout=60)
        for i, p in enumerate(cluster.daemons):
            if p.poll() is not None:
                report["violations"].append(f"daemon {cluster.names[i]} exited with {p.returncode}")
    times = [f["recovery_s"] for f in report["faults"] if f["recovery_s"] is not None]
    report.update(requests_ok=requests.ok, requests_failed=requests.failed, failure_kinds=requests.errors,
                  requests_resumed=requests.resumed, failed_after_fault=requests.failed_after,
                  recovery_median_s=statistics.median(times) if times else None,
                  recovery_max_s=max(times) if times else None)
    report["violations"] += requests.violations
    slow = [f for f in report["faults"] if f["recovery_s"] is not None and f["recovery_s"] > RECOVERY_LIMIT_S]
    report["over_30_s"] = slow
    print(json.dumps(report, indent=1))
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
