"""Run the architecture matrix (issue 21 item 2) and print its table for docs/architectures.md.

Every architecture in kafilad/executor/archs.py, in every precision, divided 1 way, 2 ways and
3 ways (two boundary sets), 32 greedy tokens after a 5- and a 40-token prompt (prefill chunk 16),
alone and batched, against single-process mlx-lm. The same checks as
tests/executor/test_arch_matrix.py, written as a table:

    python scripts/arch_matrix.py > /tmp/table.md      # about 3 minutes on a 2-core VM
"""

from __future__ import annotations

import sys
import tempfile
import time

import kafilad.executor  # noqa: F401 - the project's BLAS, as the daemons load it
import mlx.core as mx
import mlx_lm

from kafilad.executor import archs

SHORT = [(i * 37 + 11) % 500 for i in range(5)]
LONG = [(i * 53 + 7) % 500 for i in range(40)]
DIVISIONS = ([(0, 6)], [(0, 2), (2, 6)], [(0, 4), (4, 6)], [(0, 1), (1, 4), (4, 6)], [(0, 3), (3, 5), (5, 6)])


def cell(arch: str, precision: str) -> str:
    if precision not in archs.precisions_for(arch):
        return "–"
    if precision == "bfloat16" and arch in archs.GATHER_MM_ARCHS and mx.default_device() == mx.cpu:
        return "n/a on CPU¹"
    d = archs.synthesize_arch(tempfile.mkdtemp(), arch, precision, seed=archs.seed_for(arch))
    refs = [archs.reference_tokens(d, p, 32, prefill_step_size=16) for p in (SHORT, LONG)]
    bad = [f"{len(b)}-way {b}" for b in DIVISIONS for p, r in zip((SHORT, LONG), refs)
           if archs.ring_tokens(d, b, p, 32, prefill_step_size=16) != r]
    if archs.ring_batch_tokens(d, DIVISIONS[3], [SHORT, LONG], 32, prefill_step_size=16) != refs:
        bad.append("batched")
    return "identical" if not bad else "DIFFERS: " + ", ".join(sorted(set(bad)))


def main() -> int:
    t0 = time.perf_counter()
    print(f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, device {mx.default_device()}\n")
    print("| architecture | float32 | bfloat16 | 4-bit | 8-bit | mxfp4 |")
    print("|---|---|---|---|---|---|")
    failed = 0
    for arch in archs.ARCHS:
        cells = [cell(arch, p) for p in ("float32", "bfloat16", "q4", "q8", "mxfp4")]
        failed += sum(c.startswith("DIFFERS") for c in cells)
        print(f"| {arch} | " + " | ".join(cells) + " |", flush=True)
    for variant in archs.UNSPLITTABLE:
        d = archs.synthesize_arch(tempfile.mkdtemp(), variant, config=archs.UNSPLITTABLE[variant])
        same = archs.ring_tokens(d, [(0, 6)], LONG, 32, prefill_step_size=16) == \
            archs.reference_tokens(d, LONG, 32, prefill_step_size=16)
        print(f"| {variant} | {'identical whole, 1 member' if same else 'DIFFERS'}; divided: refused² | | | | |")
        failed += not same
    print(f"\n{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
