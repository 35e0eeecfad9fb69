#!/usr/bin/env python3
"""Benchmark: a stage's per-token decode as the ring calls it vs the same blocks in mlx-lm's own
overlapped loop (issue 24 item 4; DESIGN §8: ratios measured in one run).

One process, no network. A model is cut into `--stages` stages (equal block counts). Per decode
token it times:

1. `mlx-lm`: the whole model in mlx_lm.generate's `generate_step` (greedy), which builds step n+1's
   graph and hands it to `mx.async_eval` while step n computes (its cross-step overlap);
2. `ring`: the same model as `--stages` StageRunners called as the ring calls them
   (kafilad/node/serving/ring.py for one request: the head's fused `head_sample_and_run`, then
   each member's `run`; no wire encoding): each stage evaluates its step only when its input has
   arrived, as a ring member does (the tokens are checked equal to mlx-lm's);
3. for each stage's blocks alone (a middle stage's `run_blocks`), fed its own previous output:
   `sync` = build the step's graph, then evaluate it (StageRunner.run: the graph is built only
   once the input is there) vs `overlapped` = build step n+1's graph and `mx.async_eval` it before
   waiting for step n (the bound a stage could reach if its graph were built before its input
   arrived), and `build` = the Python time spent building one step's graph, which is what a ring
   member pays on top of the compute and mlx-lm hides.

Prints each as ms/token and the ratios `mlx-lm / ring` and `overlapped / sync`, medians over
`--runs` runs of `--tokens` tokens. Other processes on the machine slow everything; only the ratios
measured within this run mean anything.

    python scripts/bench_stage_step.py [--model DIR | --synth 512,8] [--stages 3] [--tokens 64] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import kafilad.executor  # noqa: F401 - loads the optimised BLAS before mlx (DESIGN §6)


def mlx_lm_decode(model, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """(seconds per decode token, the greedy tokens) of mlx-lm's generate_step; the first token
    (the prefill's) is excluded from the time."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    t0, out = None, []
    for i, (tok, _) in zip(range(tokens + 1), generate_step(mx.array(prompt), model, max_tokens=tokens + 1)):
        out.append(int(tok))
        if i == 0:
            t0 = time.perf_counter()
    return (time.perf_counter() - t0) / tokens, out


def ring_decode(runners, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """(seconds per decode token, the greedy tokens) of the stages called as ring.py calls them for
    one request (no wire encoding): the head's `head_sample_and_run` (sampling and the next step's
    head blocks in one MLX call) when its caches allow it, else `head_sample` then
    `head_embed_and_run`; then each other stage's `run`, which evaluates only once its input
    is there. The first token (the prefill's) is excluded from the time."""
    from kafilad.executor.runner import prefill_chunks

    head, rid = runners[0], "bench"

    def rest(h):
        for r in runners[1:]:
            h = r.run(rid, h)
        return h

    try:
        h = None
        for chunk in prefill_chunks(prompt):
            h = rest(head.head_embed_and_run(rid, chunk))
        out, t0 = [], None
        while True:
            if len(out) == tokens:
                out.append(head.head_sample(rid, h))
                break
            tok, nxt = head.head_sample_and_run(rid, h)
            out.append(tok)
            if t0 is None:
                t0 = time.perf_counter()
            h = rest(nxt if nxt is not None else head.head_embed_and_run(rid, [tok]))
        return (time.perf_counter() - t0) / tokens, out
    finally:
        for r in runners:
            r.drop(rid)


def stage_step_s(stage, tokens: int) -> tuple[float, float, float]:
    """(sync, overlapped, build) seconds per step of `stage.run_blocks` on a (1, 1, D) input fed
    its own previous output, from a 16-token prefilled cache."""
    import mlx.core as mx

    d = stage.hidden_size
    h0 = mx.random.normal((1, 16, d)).astype(stage.dtype) * 0.1
    x0 = mx.random.normal((1, 1, d)).astype(stage.dtype) * 0.1
    mx.eval(h0, x0)

    cache = stage.make_cache()
    mx.eval(stage.run_blocks(h0, cache))
    x = x0
    t = time.perf_counter()
    for _ in range(tokens):
        x = stage.run_blocks(x, cache)
        mx.eval(x)
    sync = (time.perf_counter() - t) / tokens

    cache = stage.make_cache()
    mx.eval(stage.run_blocks(h0, cache))
    x = stage.run_blocks(x0, cache)
    mx.async_eval(x)
    t = time.perf_counter()
    for _ in range(tokens):
        nxt = stage.run_blocks(x, cache)
        mx.async_eval(nxt)
        mx.eval(x)
        x = nxt
    mx.eval(x)
    overlapped = (time.perf_counter() - t) / tokens

    cache = stage.make_cache()
    mx.eval(stage.run_blocks(h0, cache))
    build = 0.0
    x = x0
    for _ in range(tokens):
        t = time.perf_counter()
        y = stage.run_blocks(x, cache)
        build += time.perf_counter() - t
        mx.eval(y)
        x = y
    return sync, overlapped, build / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir (default: the synthetic demo model)")
    ap.add_argument("--synth", default=None, help="H,L: a synthesised Llama of hidden size H and L blocks")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    import mlx_lm

    from kafilad.executor.runner import StageRunner
    from kafilad.executor.stage import load_stage_from_dir
    from kafilad.executor.synth import default_synth_model_dir
    from kafilad.modelinfo import read_model_info

    if args.model:
        model_dir = args.model
    elif args.synth:
        hidden, layers = (int(v) for v in args.synth.split(","))
        model_dir = str(default_synth_model_dir(hidden_size=hidden, num_hidden_layers=layers))
    else:
        model_dir = str(default_synth_model_dir())
    n_layers = read_model_info(model_dir).num_hidden_layers
    k = max(1, min(args.stages, n_layers))
    cuts = [round(i * n_layers / k) for i in range(k + 1)]
    stages = [load_stage_from_dir(model_dir, a, b, head=(i == 0)) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    runners = [StageRunner(s) for s in stages]
    model, tok = mlx_lm.load(model_dir)
    prompt = tok.encode("Once upon a time there was a little")

    mlx_lm_decode(model, prompt, 8)  # warm-up
    ring_decode(runners, prompt, 8)
    single, ring = [], []
    for _ in range(args.runs):
        (t_single, want), (t_ring, got) = mlx_lm_decode(model, prompt, args.tokens), ring_decode(runners, prompt, args.tokens)
        if got != want:
            raise SystemExit(f"the ring's greedy tokens differ from mlx-lm's: {got} vs {want}")
        single.append(t_single)
        ring.append(t_ring)
    ms, mr = statistics.median(single), statistics.median(ring)
    print(f"model {model_dir}, blocks {cuts}, {args.tokens} tokens x {args.runs} runs (medians)")
    print(f"whole model: mlx-lm generate_step {ms * 1e3:.3f} ms/token, in-process ring of {k} stages "
          f"{mr * 1e3:.3f} ms/token, mlx-lm / ring {ms / mr:.3f} (gap {(mr - ms) * 1e3:.3f} ms/token)")
    mid = stages[min(1, k - 1)]
    stage_step_s(mid, 8)  # warm-up
    rows = [stage_step_s(mid, args.tokens) for _ in range(args.runs)]
    sync, over, build = (statistics.median(r[i] for r in rows) for i in range(3))
    print(f"stage [{mid.start}, {mid.end}) run_blocks: sync {sync * 1e3:.3f} ms/step, overlapped {over * 1e3:.3f} "
          f"ms/step, overlapped / sync {over / sync:.3f}; graph build {build * 1e3:.3f} ms/step "
          f"({build / sync:.0%} of a sync step, per-block async_eval hand-offs included)")


if __name__ == "__main__":
    main()
