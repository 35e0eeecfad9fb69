"""Measured / predicted stage time of honest members (issue 22 item 5): the figure the bound of
kafilad/planner/trust.py ([1/2, 2], 2 ms slack) must leave room for on this machine.

Forms a loopback session of three daemons on a synthesised Llama (each probing itself; `--head
any`, so nothing is replanned), runs one greedy request, and prints each member's verdict from the
host's trace: ratio, measured and predicted ms per token. Loopback only, a few seconds per run.

    python scripts/report_check_ratios.py [--hidden 512] [--layers 6] [--tokens 40] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import trio

from kafila_ctl.demo import LoopbackCluster
from kafilad.executor.synth import synthesize_model


def one_run(model_dir: Path, root: Path, tokens: int) -> list[dict]:
    with LoopbackCluster(3, root=str(root)) as c:
        c.form(str(model_dir), context=512, strategy="kafila", head="any")  # every member holds blocks

        async def gen():
            async for _kind, _body in c.client(0).stream("generate", prompt="Once upon a time", max_tokens=tokens):
                pass
        trio.run(gen)
        return [r for r in c.call(0, "trace") if r["event"] == "report_checked"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = synthesize_model(Path(tmp) / "m", arch="llama", seed=3, num_hidden_layers=args.layers,
                                     hidden_size=args.hidden)
        ratios = []
        for i in range(args.runs):
            for r in one_run(model_dir, Path(tmp) / f"run{i}", args.tokens):
                ratios.append(r["ratio"])
                print(f"run {i}: {r['member']} x{r['ratio']:.2f} ({r['outcome']}): measured "
                      f"{r['measured_s'] * 1000:.2f} ms, predicted {r['predicted_s'] * 1000:.2f} ms per token")
        if ratios:
            print(f"median measured/predicted over {len(ratios)} member-runs: x{statistics.median(ratios):.2f} "
                  f"(min x{min(ratios):.2f}, max x{max(ratios):.2f})")


if __name__ == "__main__":
    main()
