"""scripts/bench_fleet.py part 2, the peers (no cgroups, the same model): mlx-lm's own pipeline
(`mlx.launch --backend ring -n 3` on localhost, mlx_lm.utils.sharded_load with a pipeline group,
stream_generate on every rank), a Kafila ring of unthrottled daemons serving one request through
its OpenAI API (`/v1/completions`, streamed; decode tokens/s as the client sees it = (completion
tokens - 1) / (last chunk - first chunk)), and single-process mlx-lm (scripts/bench_ring.py
`single_process_tps`: generate_step in-process, the first token excluded)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from api_client import api_decode
from fleet_harness import REPO, form, rounds

PROMPTS = ["Once upon a time"]  # the peers' prompt (the load's are kafila_ctl.demo.LOAD_PROMPTS)
#: the script mlx.launch runs on every rank (its --mlx-pipeline-rank calls `mlx_pipeline_rank`)
BENCH_SCRIPT = Path(__file__).resolve().with_name("bench_fleet.py")


def mlx_pipeline_rank(model_dir: str, tokens: int, runs: int) -> int:
    """One rank of mlx-lm's own pipeline (run by mlx.launch); rank 0 prints `MLXPIPE {json}`."""
    import kafilad.executor  # noqa: F401 - the same BLAS as the daemons, loaded before mlx
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.utils import sharded_load
    group = mx.distributed.init(strict=True, backend="ring")
    model, tok = sharded_load(model_dir, pipeline_group=group)
    rates, n = [], 0
    for run in range(runs + 1):
        last = None
        for last in stream_generate(model, tok, PROMPTS[0], max_tokens=tokens):
            pass
        n = last.generation_tokens
        print(f"rank {group.rank()} run {run}: {n} tokens, {last.generation_tps:.2f} tokens/s", file=sys.stderr,
              flush=True)
        if run:
            rates.append(last.generation_tps)
    # a barrier: a rank that exits while another still runs the last generation's speculative step
    # (generate_step evaluates step n+1 before yielding n) breaks the ring under it
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))
    time.sleep(1.0)
    if group.rank() == 0:
        print("MLXPIPE " + json.dumps({"tps": statistics.median(rates), "samples": rates, "tokens": n,
                                       "layers": [model.model.start_idx, model.model.end_idx]}), flush=True)
    return 0


def mlx_pipeline_tps(model_dir: Path, ranks: int, tokens: int, runs: int, procs: list) -> dict:
    """mlx-lm's pipeline over `ranks` processes (mlx.launch --backend ring on localhost)."""
    launch = Path(sys.executable).with_name("mlx.launch")
    cmd = [str(launch), "--backend", "ring", "-n", str(ranks), "--", sys.executable, str(BENCH_SCRIPT),
           "--mlx-pipeline-rank", str(model_dir), str(tokens), str(runs)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    procs.append(p)
    out, _ = p.communicate(timeout=900)
    for line in out.splitlines():
        if line.startswith("MLXPIPE "):
            return json.loads(line[len("MLXPIPE "):])
    raise RuntimeError(f"mlx-lm pipeline run gave no result (exit {p.returncode}):\n{out[-3000:]}")


def ring_api_tps(args, model_dir: Path, log) -> dict:
    """A Kafila ring of --ranks unthrottled daemons, one request at a time through the OpenAI API."""
    from kafila_ctl.demo import LoopbackCluster
    with LoopbackCluster(args.ranks, env={"OPENBLAS_NUM_THREADS": "1"}) as c:
        snap = form(c, model_dir, strategy="kafila", concurrency=1, context=args.context)
        http = c.call(0, "status").get("http")
        if not http:
            raise RuntimeError("the host daemon reports no HTTP address")
        tps, samples = rounds(lambda: api_decode(http, PROMPTS[0], args.peer_tokens)[0], args.runs)
        log(f"[ring api] blocks {snap['plan']['blocks']}: {tps:.2f} tokens/s as the client sees it "
            f"(rounds {[round(s, 2) for s in samples]})")
        return {"tps": tps, "samples": samples, "blocks": snap["plan"]["blocks"]}


def mlx_single_tps(model_dir: Path, tokens: int) -> float:
    """scripts/bench_ring.py's single_process_tps (in a child process, so this one never imports mlx)."""
    code = ("import sys, runpy\nsys.path.insert(0, sys.argv[1])\nfrom bench_ring import single_process_tps\n"
            "print(single_process_tps(sys.argv[2], 'Once upon a time', int(sys.argv[3])))")
    out = subprocess.run([sys.executable, "-c", code, str(REPO / "scripts"), str(model_dir), str(tokens)],
                         capture_output=True, text=True, check=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    return float(out.stdout.strip().splitlines()[-1])
