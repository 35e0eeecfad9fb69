#!/usr/bin/env python3
"""Benchmark: a 3-daemon relayed ring vs single-process mlx-lm, in one run (DESIGN §8).

Prints the time to form the session, decode tokens/s of the ring and of single-process mlx-lm on
the same model (median of 4 generations after one discarded cold one), their ratio, and the bytes
the rendezvous relayed per generated token.

With `--api`, the ring's rate is taken as a client sees it: one streamed `/v1/completions`
request at a time, (completion tokens - 1) / (last chunk - first chunk). `--synth H,L` serves a
synthesised Llama of hidden size H and L blocks (f32; 512,8 is the 100 MB model of issue 12).
`--timeline` (with --api) runs the daemons with KAFILA_STEP_TIMELINE (kafilad/step_timeline.py)
and prints where one decode step's milliseconds go: the median over the decode steps of every
measured request of each segment between consecutive marks of the head (h), the members in ring
order (m1, m2, ...) and the client (cl).

`--pin` gives each daemon a CPU of its own as far as the machine's go (daemon i on CPU i mod N,
`taskset`) and runs single-process mlx-lm on CPU 0: with `--members` at most the CPU count, each
member computes on its own core, as on separate machines, instead of the daemons sharing them all.

    python scripts/bench_ring.py [--model DIR | --synth 512,8] [--members 3] [--tokens 64]
        [--api] [--runs 4] [--modes relayed,direct] [--timeline] [--strategy uniform|kafila|...] [--pin]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import kafilad.executor  # noqa: F401 - loads the optimised BLAS before mlx (DESIGN §6)
from kafila_ctl.demo import LoopbackCluster
from api_client import api_decode  # noqa: E402 - scripts/ is on sys.path when run
from kafilad.proto.rendezvous import parse_relay_record


class PinnedCluster(LoopbackCluster):
    """A loopback cluster whose daemon i runs on CPU i mod N only (`taskset -c`)."""

    def daemon_argv(self, i: int) -> list[str]:
        cpus = sorted(os.sched_getaffinity(0))
        return ["taskset", "-c", str(cpus[i % len(cpus)])] + super().daemon_argv(i)


def single_process_tps(model_dir: str, prompt: str, tokens: int, runs: int = 4) -> float:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    model, tok = load(model_dir)
    ids = mx.array(tok.encode(prompt))
    rates = []
    for run in range(runs + 1):
        t_first = None
        n = 0
        for (t, _), _ in zip(generate_step(ids, model, max_tokens=tokens), range(tokens)):
            mx.eval(t)
            n += 1
            if t_first is None:
                t_first = time.perf_counter()
        rate = (n - 1) / (time.perf_counter() - t_first)
        if run:
            rates.append(rate)
    return statistics.median(rates)


def timeline_breakdown(marks: list[tuple[float, str, str]]) -> list[tuple[str, float]]:
    """Median ms of each segment of one decode step, in step order.

    Args:
        marks: (t_s, kind, who) in time order, who "h" (head), "m1".. (members in ring order),
            "cl" (client); one request in flight. A step runs from a decode act's return to the
            head (`h:rx`) to the next one's. Segments: each process's consecutive marks (the
            head's MLX calls named `sample` and `embed+run`, or `sample+embed+run` when fused), and each hop from a sender's
            `tx` to the receiver's `rx`; the HTTP layer's `sse` and the client's `chunk` are
            measured from the step's `emit`.
    Returns:
        [(segment name, median ms)]: the segments, then "emit → sse", "emit → client", "token interval".
    """
    whos = sorted({w for _, _, w in marks if w.startswith("m")}, key=lambda w: int(w[1:]))
    ring = ["h"] + whos
    rx = [t for t, k, w in marks if w == "h" and k == "rx"]
    seg: dict[str, list[float]] = defaultdict(list)
    order: list[str] = []

    def add(name: str, ms: float) -> None:
        if name not in seg:
            order.append(name)
        seg[name].append(ms)
    for a, b in zip(rx, rx[1:]):
        step = [(t, k, w) for t, k, w in marks if a <= t < b]
        head = [(t, k) for t, k, w in step if w == "h" and k not in ("sse",)]
        kinds = [k for _, k in head]
        if b - a > 1.0 or kinds.count("c0") not in (1, 2) or "emit" not in kinds or "tx" not in kinds:
            continue  # between requests, the prefill or the end of a request
        calls = iter(("sample", "embed+run") if kinds.count("c0") == 2 else ("sample+embed+run",))
        for (t0, k0), (t1, k1) in zip(head, head[1:]):
            name = f"h:{k0} → h:{k1}"
            if k0 == "c0":
                name = f"h: MLX {next(calls)}"
            add(name, (t1 - t0) * 1e3)
        for i, w in enumerate(ring):
            nxt = ring[(i + 1) % len(ring)]
            t_tx = [t for t, k, ww in step if ww == w and k == "tx"]
            t_rx = [t for t, k, ww in step if ww == nxt and k == "rx" and (not t_tx or t > t_tx[0])]
            if nxt == "h":
                t_rx = [b]
            if t_tx and t_rx:
                add(f"hop {w} → {nxt} (tx → rx)", (t_rx[0] - t_tx[0]) * 1e3)
            if w == "h":
                continue
            own = [(t, k) for t, k, ww in step if ww == w]
            own = own[next((i for i, (_, k) in enumerate(own) if k == "rx"), len(own)):]  # from its step's arrival
            for (t0, k0), (t1, k1) in zip(own, own[1:]):
                add(f"{w}: MLX {w} blocks" if k0 == "c0" else f"{w}:{k0} → {w}:{k1}", (t1 - t0) * 1e3)
        t_emit = next(t for t, k in head if k == "emit")
        for kind, w in (("sse", "h"), ("chunk", "cl")):
            after = [t for t, k, ww in step if ww == w and k == kind and t >= t_emit]
            if after:
                add(f"emit → {kind}", (after[0] - t_emit) * 1e3)
        add("token interval", (b - a) * 1e3)
    return [(n, statistics.median(seg[n])) for n in order]


def ring_timeline(tl_dir: Path, client: list[float]) -> list[tuple[str, float]]:
    """Merge the daemons' timeline files and the client's chunk times; name each process (the head
    is the one that emits tokens; the others by the order in which a decode step reaches them)."""
    from kafilad.step_timeline import read_timeline
    raw = read_timeline(tl_dir)
    head = next(pid for _, k, pid in raw if k == "emit")
    t_emit = next(t for t, k, pid in raw if k == "emit")
    who = {head: "h"}
    for _, k, pid in (m for m in raw if m[0] > t_emit):
        if k == "rx" and pid not in who:
            who[pid] = f"m{len(who)}"
    marks = [(t, k, who.get(pid, str(pid))) for t, k, pid in raw] + [(t, "chunk", "cl") for t in client]
    marks.sort()
    return timeline_breakdown(marks)


def api_rates(c, args, formed: dict, mode: str) -> float:
    """Median decode tokens/s through the API over --runs requests after one discarded; print the timeline."""
    http = c.call(0, "status").get("http")
    rates, client_times = [], []
    for run in range(args.runs + 1):
        tps, times = api_decode(http, args.prompt, args.tokens)
        if run:
            rates.append(tps)
            client_times += times
    print(f"[{mode}] through the API: {[round(r, 1) for r in rates]} tokens/s")
    if args.timeline:
        c.generate(args.prompt, 2)  # its end flushes the head's last marks of the measured requests
        print(f"[{mode}] one decode step (median ms over the measured requests' steps):")
        for name, ms in ring_timeline(Path(c.env["KAFILA_STEP_TIMELINE"]), client_times):
            print(f"    {ms:7.3f}  {name}")
    return statistics.median(rates)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K"
    ap.add_argument("--model", default=str(default) if default.exists() else None)
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--synth", default=None, help="H,L: a synthesised Llama of hidden size H and L blocks")
    ap.add_argument("--api", action="store_true", help="measure the ring through the OpenAI API (streamed)")
    ap.add_argument("--runs", type=int, default=4, help="measured generations (after one discarded)")
    ap.add_argument("--modes", default="relayed,direct")
    ap.add_argument("--timeline", action="store_true", help="with --api: where a decode step's time goes")
    ap.add_argument("--pin", action="store_true", help="a CPU per daemon (taskset), mlx-lm on CPU 0")
    ap.add_argument("--strategy", default="uniform", help="the host's division (kafila-ctl host --strategy); "
                    "default uniform: a ring over every member with the same stages from run to run "
                    "(the host's own default, load, may leave some daemons of one machine standing by)")
    ap.add_argument("--hop-delay-ms", type=float, default=None,
                    help="one-way delay of every direct ring hop (a WAN forwarder per daemon, kafila_ctl/wan_hops.py)")
    ap.add_argument("--hop-mbps", type=float, default=None, help="rate cap of every direct ring hop, Mbit/s")
    args = ap.parse_args()
    model = args.model
    if args.synth:
        from kafilad.executor.synth import default_synth_model_dir
        hidden, layers = (int(x) for x in args.synth.split(","))
        model = str(default_synth_model_dir(hidden_size=hidden, num_hidden_layers=layers))
    if model is None:
        from kafilad.executor.synth import default_synth_model_dir
        model = str(default_synth_model_dir())
    print(f"model {model}, {args.members} daemons on loopback, {args.tokens} tokens per generation")
    results = {}
    for mode in args.modes.split(","):
        env = {"KAFILA_DIRECT": "0" if mode == "relayed" else "1"}
        if args.timeline:
            env["KAFILA_STEP_TIMELINE"] = tempfile.mkdtemp(prefix="kafila-timeline-")
        hops = {"hop_delay_ms": args.hop_delay_ms, "hop_mbps": args.hop_mbps} if mode == "direct" else {}
        with (PinnedCluster if args.pin else LoopbackCluster)(args.members, record_relay=True, env=env, **hops) as c:
            formed = c.form(model, strategy=args.strategy)
            edges = [e["path"] for e in formed["status"].get("edges", [])]
            print(f"[{mode}] time to form the session: {formed['form_s']:.2f} s "
                  f"(blocks {formed['status']['plan']['blocks']}, head {formed['status']['plan']['head']}, edges {edges})")
            if hops and args.hop_delay_ms is not None:  # the hops' probe: each edge's check round trip
                rtts = ", ".join(f"{e.get('rtt_ms') or 0:.1f}" for e in formed["status"].get("edges", []))
                print(f"[{mode}] WAN hops of {args.hop_delay_ms:g} ms one way: edge check RTTs {rtts} ms "
                      f"(expected >= {2 * args.hop_delay_ms:g}; the relayed mode bypasses the hops)")
            if args.api:
                results[mode] = api_rates(c, args, formed, mode)
                continue
            rates, tokens_total = [], 0
            relayed_before = sum(len(p) for _, p in parse_relay_record(c.record_path.read_bytes()))
            for run in range(args.runs + 1):
                r = c.generate(args.prompt, args.tokens)
                tokens_total += len(r["token_ids"])
                if run and r.get("decode_tokens_per_s"):
                    rates.append(r["decode_tokens_per_s"])
            relayed = sum(len(p) for _, p in parse_relay_record(c.record_path.read_bytes())) - relayed_before
            results[mode] = statistics.median(rates)
            print(f"[{mode}] relayed through the rendezvous during generation: {relayed} bytes for {tokens_total} "
                  f"tokens = {relayed / tokens_total:.0f} bytes per generated token (prefill included)")
    every_cpu = os.sched_getaffinity(0)
    if args.pin:  # one CPU, one BLAS thread (this process loaded OpenBLAS for all of them)
        os.sched_setaffinity(0, {min(every_cpu)})
        from kafilad.executor import blas
        if blas._loaded:
            ctypes.CDLL(blas._loaded).openblas_set_num_threads(1)
    single_tps = single_process_tps(model, args.prompt, args.tokens, args.runs)
    os.sched_setaffinity(0, every_cpu)
    print(f"single-process mlx-lm: {single_tps:.1f} tokens/s")
    for mode, tps in results.items():
        print(f"ring ({mode} edges): {tps:.1f} tokens/s; ratio ring/single = {tps / single_tps:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
