"""Working memory of a stage at the declared context and concurrency (issue 12 item 3).

Admission (DESIGN §5.4) used to count weights + KV cache + head parts only; a prefill step also
allocates activations, attention scores and logits. A member short of that slack would be
admitted and then run out of memory in prefill. Every active member is charged, on top of its
resident bytes, the working bytes below (formula and its measurement in docs/planner.md
"Working memory"; the script is scripts/measure_working_memory.py).

Shapes (`ArchShape`, from config.json): D hidden, Hq/Hkv query/KV heads, hd head dim, F MLP
width, V vocabulary, a bytes per activation element. Declared context C, concurrency K, prefill
chunk P_c (the head splits prompts in chunks of 2048 tokens, kafilad/proto/scheduler.py).

```
 steps (T, N): T tokens in one step attending to N keys; a prompt of up to C tokens is split as
   mlx-lm splits it (prompt[:-1] in chunks of P_c, then the last token), so the largest steps are
   (P_c, q·P_c) the last full chunk, q = (C − 1) // P_c >= 1, and (r, C − 1) the partial one,
   r = (C − 1) % P_c > 0; then decode steps of K rows attending to C keys: (K, C)

 compute(T, N) = a·Hq·T·N                        attention scores of one block (one buffer: the
                                                 mask and the softmax write over it)
               + 2·T·N                           the causal mask (bool) and the comparison it is
                                                 built from
               + a·T·(2·D + 6·Hq·hd + 2·Hkv·hd)  one block's attention activations: norm, o_proj;
                                                 q projection, rope, scaled, output, transposed
                                                 copy, grouped-query reshape; k projection, rope
               + a·N·3·Hkv·hd                    the KV cache growing (old K and V while the new
                                                 ones are written) and the attended keys copied
               + a·T·(2·F + 3·D)                 one block's MLP: gate and up; norm, down, residual
 head(K)       = a·3·K·V                         the head's logits, log-sum-exp, log-probs, K rows
 wire          = a·(K + 2)·T_c·D                 outside MLX: the step's activation as wire bytes
                                                 in, and as a numpy copy and bytes out; each other
                                                 request's chunk queued here; T_c = min(P_c, C)
 working(member) = max over steps of compute + [head]·head(K) + wire
```

Only one block's temporaries are alive at a time (MLX frees a block's arrays once the next
consumes its output), so the compute term does not grow with the number of blocks; MLX's CPU
stream runs a few operations ahead of the frees, so a block's attention and MLP temporaries
are counted together. On Metal and CUDA the fused attention kernels do not materialise the
scores: the formula over-counts there (conservative).

Pure: no I/O, integers only.
"""

from __future__ import annotations

from typing import Mapping, Optional

from kafilad.planner.records import ArchShape

#: mlx-lm's generate_step prefill chunk; the head splits prompts by it (scheduler.PREFILL_STEP_TOKENS).
PREFILL_CHUNK_TOKENS = 2048


def arch_from_config(config: Mapping, act_bytes: int, *,
                     prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> Optional[ArchShape]:
    """The working-memory shapes of a Hugging Face config.json.

    Args:
        config: the parsed config.json (a multimodal config's `text_config` is used when present).
        act_bytes: bytes per activation element the executor computes in.
        prefill_chunk_tokens: the head's prefill chunk (tokens).
    Returns:
        the ArchShape, or None when the config lacks the hidden size or head count (then no
        working memory is counted and admission is as before).
    """
    c = dict(config.get("text_config") or {}) or dict(config)
    try:
        d = int(c["hidden_size"])
        hq = int(c["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    hkv = int(c.get("num_key_value_heads") or hq)
    hd = int(c.get("head_dim") or d // hq)
    f = int(c.get("intermediate_size") or 4 * d)
    experts = int(c.get("num_experts_per_tok") or 0)
    if experts and c.get("moe_intermediate_size"):
        f = max(f, experts * int(c["moe_intermediate_size"]))
    v = int(c.get("vocab_size") or 0)
    return ArchShape(hidden_size=d, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=hd,
                     intermediate_size=f, vocab_size=v, act_bytes=int(act_bytes),
                     prefill_chunk_tokens=int(prefill_chunk_tokens))


def steps(context: int, concurrency: int, chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> list[tuple[int, int]]:
    """The (T, N) steps whose working memory can be largest (module docstring): the last full
    prefill chunk, the partial one, and a decode step of `concurrency` rows."""
    c, k, p = int(context), int(concurrency), int(chunk_tokens)
    q, r = divmod(c - 1, p)
    out = []
    if q >= 1:
        out.append((p, q * p))
    if r > 0:
        out.append((r, c - 1))
    out.append((k, c))
    return out


def compute_terms(shape: ArchShape, tokens: int, keys: int) -> dict[str, int]:
    """The MLX-allocated terms of one step of `tokens` tokens attending to `keys` keys, bytes."""
    a, d, hq, hkv, hd = shape.act_bytes, shape.hidden_size, shape.num_attention_heads, \
        shape.num_key_value_heads, shape.head_dim
    t, n = int(tokens), int(keys)
    return {
        "scores": a * hq * t * n,
        "mask": 2 * t * n,
        "attention": a * t * (2 * d + 6 * hq * hd + 2 * hkv * hd),
        "kv_growth": a * n * 3 * hkv * hd,
        "mlp": a * t * (2 * shape.intermediate_size + 3 * d),
    }


def working_terms(shape: ArchShape, *, context: int, concurrency: int, head: bool) -> dict[str, int]:
    """The terms of the module docstring's formula at its largest step, bytes.

    Args:
        shape: the architecture's shapes.
        context: declared context C (tokens); concurrency: declared concurrency K.
        head: whether the member is the head (adds the logits term).
    Returns:
        {"tokens", "keys" (the step's T and N), "scores", "mask", "attention", "kv_growth", "mlp",
         "logits", "mlx" (what MLX allocates: the sum so far), "wire", "total"}.
    """
    k = int(concurrency)
    best: dict[str, int] = {}
    for t, n in steps(context, k, shape.prefill_chunk_tokens):
        terms = compute_terms(shape, t, n)
        if not best or sum(terms.values()) > best["mlx"]:
            best = {"tokens": t, "keys": n, **terms, "mlx": sum(terms.values())}
    best["logits"] = shape.act_bytes * 3 * k * shape.vocab_size if head else 0
    best["mlx"] += best["logits"]
    chunk = min(shape.prefill_chunk_tokens, int(context))
    best["wire"] = shape.act_bytes * (k + 2) * chunk * shape.hidden_size
    best["total"] = best["mlx"] + best["wire"]
    return best


def working_bytes(shape: Optional[ArchShape], *, context: int, concurrency: int, head: bool) -> int:
    """Working bytes a member needs beyond its resident weights and KV cache (0 without a shape)."""
    if shape is None:
        return 0
    return working_terms(shape, context=context, concurrency=concurrency, head=head)["total"]
