"""Mixture-of-experts: the bytes a token reads (issue 21 item 4; DESIGN §5.1, §6 "MoE").

A MoE block holds every expert, but a token runs attention, the router, the shared experts and
`num_experts_per_tok` (k) of the block's `num_experts` (E) routed experts. At batch 1 a stage
reads, per token and block,

```
 read_bytes(block) = non-expert bytes + shared-expert bytes + routed-expert bytes · k / E
 resident(block)   = non-expert bytes + shared-expert bytes + routed-expert bytes
```
(Qwen3-30B-A3B: 623 M parameters per block held, 57 M read; a token reads 9% of its blocks).
k / E is exact for one token: it picks k distinct experts, each a 1/E slice of every stacked
expert tensor (or one of E per-expert tensors). Which experts it picks does not matter to the
count, only that they are k of E; the probe times blocks with tokens spread over experts as a
router spreads them (kafilad/executor/probe.py) so that its bytes/s applies to these bytes.

Routed-expert tensors are recognised by name, in the three layouts in use:
- mlx-lm's stacked experts: `...mlp.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}`
  (qwen3_moe, glm4_moe, deepseek_v3, mixtral's `block_sparse_moe.switch_mlp`, ...);
- stacked experts under `experts.`: `...mlp.experts.gate_up_proj[_blocks|_scales|_bias]`,
  `...mlp.experts.down_proj...` (gpt-oss on Hugging Face) and `...experts.{gate,up,down}_proj...`
  (gpt-oss after mlx-lm's sanitize);
- Hugging Face's per-expert tensors: `...mlp.experts.N.{gate,up,down}_proj.weight`
  (Qwen3-MoE, DeepSeek-V3, GLM-4.5; Mixtral's `block_sparse_moe.experts.N.w1`).
Shared experts (`shared_experts.`, `shared_expert.`, `shared_expert_gate`) and routers (`gate.`,
`router.`) are read by every token and are not routed experts.

E and k come from config.json, whose keys differ per family: E is `num_experts` (Qwen),
`num_local_experts` (Mixtral, gpt-oss) or `n_routed_experts` (DeepSeek, GLM, Kimi); k is
`num_experts_per_tok` (`experts_per_token` in gpt-oss's original config). Which blocks are MoE:
`first_k_dense_replace` and `moe_layer_freq` (DeepSeek, GLM: block i is MoE when
i >= first_k_dense_replace and i % moe_layer_freq == 0), `decoder_sparse_step` and
`mlp_only_layers` (Qwen: MoE when i is not in mlp_only_layers and (i + 1) % step == 0), as the
families' mlx-lm model files decide it. A block's byte count follows its tensors' names, so a
dense block (no routed-expert tensors) reads all of its bytes whatever the config says;
`is_moe_block` is what a writer of tensors (scripts/make_model_headers.py) and the probe use.

Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Optional

import attrs

#: a routed-expert tensor: stacked (`switch_mlp.`, `experts.<not a number>`) or per-expert
#: (`experts.N.`); `shared_experts.` is not matched (its `experts` follows an underscore).
_ROUTED_RE = re.compile(r"(?:^|\.)(?:switch_mlp\.|experts\.(?:\d+\.|[A-Za-z_]))")
#: config keys of E and of k, in the order they are tried.
NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
EXPERTS_PER_TOK_KEYS = ("num_experts_per_tok", "experts_per_token")


@attrs.frozen
class MoeSpec:
    """E and k of a mixture-of-experts model.

    Attributes:
        num_experts: E, routed experts per MoE block (>= 1).
        experts_per_tok: k, routed experts each token runs (1 <= k <= E).
    """

    num_experts: int
    experts_per_tok: int

    def routed_read_bytes(self, routed_bytes: int) -> int:
        """Bytes a token reads of `routed_bytes` bytes of one block's routed experts:
        routed_bytes · k / E, rounded down (exact for stacked tensors, whose size divides by E)."""
        return int(routed_bytes) * self.experts_per_tok // self.num_experts


def _text(config: Mapping) -> Mapping:
    """A multimodal config's `text_config`, else the config itself."""
    tc = config.get("text_config")
    return tc if isinstance(tc, Mapping) and tc else config


def _first_int(c: Mapping, keys: Iterable[str]) -> Optional[int]:
    for k in keys:
        v = c.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            return int(v)
    return None


def moe_spec(config: Mapping) -> Optional[MoeSpec]:
    """E and k from a Hugging Face or mlx-lm config.json (module docstring), or None for a dense
    model (no expert count, or one expert per token of one).

    Raises:
        ValueError: k > E (a config no router can follow).
    """
    c = _text(config)
    e = _first_int(c, NUM_EXPERTS_KEYS)
    k = _first_int(c, EXPERTS_PER_TOK_KEYS)
    if e is None or k is None:
        return None
    if k > e:
        raise ValueError(f"The config routes each token to {k} experts of {e}; it cannot be more than there are.")
    return MoeSpec(num_experts=e, experts_per_tok=k)


def is_moe_block(config: Mapping, block: int) -> bool:
    """Whether block `block` (0-based) of this config holds routed experts (module docstring:
    first_k_dense_replace, moe_layer_freq, decoder_sparse_step, mlp_only_layers)."""
    if moe_spec(config) is None:
        return False
    c = _text(config)
    i = int(block)
    if i < int(c.get("first_k_dense_replace") or 0):
        return False
    freq = int(c.get("moe_layer_freq") or 1)
    if freq > 1 and i % freq != 0:
        return False
    if i in set(c.get("mlp_only_layers") or ()):
        return False
    step = int(c.get("decoder_sparse_step") or 1)
    return (i + 1) % step == 0


def is_routed_expert(name: str) -> bool:
    """Whether tensor (or parameter) `name` belongs to the routed experts (module docstring)."""
    return _ROUTED_RE.search(name) is not None


def read_bytes(tensors: Iterable[tuple[str, int]], spec: Optional[MoeSpec]) -> int:
    """Bytes one token reads of one block's tensors.

    Args:
        tensors: (name, held bytes) of every tensor of the block.
        spec: the model's MoeSpec; None (a dense model) reads every byte.
    Returns:
        non-routed bytes + spec.routed_read_bytes(routed bytes).
    """
    dense = routed = 0
    for name, nbytes in tensors:
        if spec is not None and is_routed_expert(name):
            routed += int(nbytes)
        else:
            dense += int(nbytes)
    return dense + (spec.routed_read_bytes(routed) if spec is not None else 0)


def all_moe_config(config: Mapping) -> dict:
    """A copy of `config` whose every block is MoE (the keys `is_moe_block` reads set neutral): the
    probe builds its random blocks from it, so that it times the MoE blocks that make up most of
    a model whose first blocks are dense (DeepSeek-V3's first 3 of 61, GLM-4.5-Air's first 1 of 46).
    A dense model's config is returned unchanged (as a copy)."""
    out = dict(config)
    if moe_spec(config) is None:
        return out
    neutral = {"first_k_dense_replace": 0, "moe_layer_freq": 1, "decoder_sparse_step": 1, "mlp_only_layers": []}
    tc = config.get("text_config")
    if isinstance(tc, Mapping) and tc:
        out["text_config"] = {**tc, **{k: v for k, v in neutral.items() if k in tc}}
    out.update({k: v for k, v in neutral.items() if k in config})
    return out
