"""Time to first token of a conversation's second turn, with and without the prompt cache (issue 23 item 3).

Two sessions of 3 daemons on loopback serve the 100 MB synthesised Llama (hidden 512, 8 blocks,
f32; bench_ring.py's model), one with the prompt cache and one with KAFILA_PROMPT_CACHE=0. Each
serves a conversation: turn 1 is a history of HISTORY tokens (byte tokens), then turn 2 repeats it
with the answer and a new question. Each round times turn 2's time to first token (the head's
`ttft_s`) on both sessions, interleaved; it prints every round and the median ratio
without / with, and checks that turn 2's tokens are the same on both.

    python scripts/bench_prompt_cache.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

from kafila_ctl.demo import LoopbackCluster
from kafilad.executor.synth import default_synth_model_dir

QUESTION = " Tell me what happened next, in one sentence."


def history(n_tokens: int, round_no: int) -> str:
    words = "the keeper of the light counted ships and wrote their names in a book by the lamp".split()
    text = f"Round {round_no}. "
    i = 0
    while len(text.encode()) < n_tokens:
        text += words[i % len(words)] + " "
        i += 1
    return text[:n_tokens]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--history", type=int, default=1500, help="turn 1's prompt, tokens (bytes)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    model = str(default_synth_model_dir(hidden_size=a.hidden, num_hidden_layers=a.layers))
    root = tempfile.mkdtemp(prefix="bench-pc-")
    with LoopbackCluster(3, root=f"{root}/on") as on, \
            LoopbackCluster(3, root=f"{root}/off", env={"KAFILA_PROMPT_CACHE": "0"}) as off:
        for c in (on, off):
            c.form(model, context=4096)
        ratios = []
        for r in range(a.rounds):
            ttft = {}
            tokens = {}
            for name, c in (("on", on), ("off", off)):
                turn1 = history(a.history, r)
                first = c.generate(turn1, 16)
                second = c.generate(turn1 + first["text"] + QUESTION, 16)
                ttft[name], tokens[name] = second["ttft_s"], second["token_ids"]
                if name == "on":
                    cached = second.get("cached_tokens")
            same = tokens["on"] == tokens["off"]
            ratios.append(ttft["off"] / ttft["on"])
            print(f"round {r}: turn 2 ttft with the cache {ttft['on'] * 1e3:.0f} ms ({cached} tokens reused), "
                  f"without {ttft['off'] * 1e3:.0f} ms: {ratios[-1]:.2f}x; tokens identical: {same}", flush=True)
            if not same:
                return 1
    print(f"median without / with: {statistics.median(ratios):.2f}x over {a.rounds} rounds "
          f"(history {a.history} tokens, hidden {a.hidden}, {a.layers} blocks, 3 daemons)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
