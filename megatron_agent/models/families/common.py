"""The pieces every family table is made of.

A `Rule` maps one Megatron parameter (a name template in the local layer spec's naming,
`{L}` the global layer index, `{E}` the global expert index) to the HF tensors it is
made of, with:
- `fuse`: how the HF tensors become the full (unsharded) Megatron tensor and back;
- `split`: how the full tensor is cut over tensor-parallel ranks (expert-TP for experts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


class UnsupportedModelError(ValueError):
    """An HF config this project cannot build (family or feature)."""


# How HF tensors become one full Megatron tensor.
IDENTITY = "identity"  # one HF tensor, same layout
QKV = "qkv"  # q, k, v fused, interleaved per query group: [q_g, k_g, v_g] for each group g
GATE_UP = "gate_up"  # gate and up stacked: [gate; up]
VOCAB = "vocab"  # rows padded to Megatron's vocabulary size (a multiple of TP)
# One HF tensor holds every expert of a layer stacked, [E, ...]; the Megatron tensor of
# expert e is row e in Megatron's own layout (read from either layout, written in the hub's).
FUSED_EXPERTS = "fused_experts"

# How the full tensor is split over TP ranks.
REPLICATED = "replicated"
ROWS = "rows"  # dim 0 (column-parallel linear, vocab-parallel embedding)
COLS = "cols"  # dim 1 (row-parallel linear)
GATE_UP_ROWS = "gate_up_rows"  # each rank holds [gate_r; up_r]


@dataclass(frozen=True)
class Rule:
    mcore: str
    hf: tuple[str, ...]
    fuse: str = IDENTITY
    split: str = REPLICATED
    export: bool = True  # False: a copy of another parameter (tied output layer)


# A rule whose Megatron name ends in this maps every parameter under that prefix 1:1 to
# the same rest of the name under the HF prefix (a vision tower kept as the HF module).
PREFIX = ".*"


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: Callable[[dict], bool]
    qk_layernorm: bool
    moe: bool
    # The weight table for an HF config of this family.
    rules: Callable[[dict], list[Rule]] = field(repr=False)
    # Vision-language families: the transformers class of the vision tower, which the
    # Megatron model runs as is ("module.path.ClassName").
    vision_tower: str | None = None
    # Multimodal RoPE's frequencies cycle over (t, h, w) (Qwen3-VL) instead of in chunks.
    mrope_interleaved: bool = False
    # Top-k router weights renormalised whatever config.json says (None: its norm_topk_prob).
    norm_topk_prob: bool | None = None


def attention(*, qkv_bias: bool, qk_norm: bool, prefix: str = "model") -> list[Rule]:
    """`prefix`: where the checkpoint keeps the language model ("model.language_model" in Qwen3-VL)."""
    hf = f"{prefix}.layers.{{L}}.self_attn"
    mc = "decoder.layers.{L}.self_attention"
    rules = [
        Rule("decoder.layers.{L}.input_layernorm.weight", (f"{prefix}.layers.{{L}}.input_layernorm.weight",)),
        Rule(f"{mc}.linear_qkv.weight", tuple(f"{hf}.{p}_proj.weight" for p in "qkv"), QKV, ROWS),
        Rule(f"{mc}.linear_proj.weight", (f"{hf}.o_proj.weight",), IDENTITY, COLS),
    ]
    if qkv_bias:
        rules.append(Rule(f"{mc}.linear_qkv.bias", tuple(f"{hf}.{p}_proj.bias" for p in "qkv"), QKV, ROWS))
    if qk_norm:
        rules += [Rule(f"{mc}.q_layernorm.weight", (f"{hf}.q_norm.weight",)),
                  Rule(f"{mc}.k_layernorm.weight", (f"{hf}.k_norm.weight",))]
    return rules


def dense_mlp(prefix: str = "model") -> list[Rule]:
    hf = f"{prefix}.layers.{{L}}.mlp"
    return [
        Rule("decoder.layers.{L}.pre_mlp_layernorm.weight",
             (f"{prefix}.layers.{{L}}.post_attention_layernorm.weight",)),
        Rule("decoder.layers.{L}.mlp.linear_fc1.weight", (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"),
             GATE_UP, GATE_UP_ROWS),
        Rule("decoder.layers.{L}.mlp.linear_fc2.weight", (f"{hf}.down_proj.weight",), IDENTITY, COLS),
    ]


def moe_mlp(*, router: str = "gate", expert_bias: str | None = None) -> list[Rule]:
    """Routed experts; `expert_bias` names the HF router bias for families that have one."""
    hf = "model.layers.{L}.mlp"
    mc = "decoder.layers.{L}.mlp"
    rules = [
        Rule("decoder.layers.{L}.pre_mlp_layernorm.weight", ("model.layers.{L}.post_attention_layernorm.weight",)),
        Rule(f"{mc}.router.weight", (f"{hf}.{router}.weight",)),
        Rule(f"{mc}.experts.local_experts.{{E}}.linear_fc1.weight",
             (f"{hf}.experts.{{E}}.gate_proj.weight", f"{hf}.experts.{{E}}.up_proj.weight"), GATE_UP, GATE_UP_ROWS),
        Rule(f"{mc}.experts.local_experts.{{E}}.linear_fc2.weight", (f"{hf}.experts.{{E}}.down_proj.weight",),
             IDENTITY, COLS),
    ]
    if expert_bias:
        rules.append(Rule(f"{mc}.router.expert_bias", (f"{hf}.{expert_bias}",)))
    return rules


def fused_moe_mlp(prefix: str) -> list[Rule]:
    """Routed experts stored fused per layer: `experts.gate_up_proj` ([gate; up] per expert)
    and `experts.down_proj` (Qwen3-VL-MoE)."""
    hf = f"{prefix}.layers.{{L}}.mlp"
    mc = "decoder.layers.{L}.mlp"
    return [
        Rule("decoder.layers.{L}.pre_mlp_layernorm.weight",
             (f"{prefix}.layers.{{L}}.post_attention_layernorm.weight",)),
        Rule(f"{mc}.router.weight", (f"{hf}.gate.weight",)),
        Rule(f"{mc}.experts.local_experts.{{E}}.linear_fc1.weight", (f"{hf}.experts.gate_up_proj",), FUSED_EXPERTS,
             GATE_UP_ROWS),
        Rule(f"{mc}.experts.local_experts.{{E}}.linear_fc2.weight", (f"{hf}.experts.down_proj",), FUSED_EXPERTS, COLS),
    ]


def embeddings_and_head(hf: dict, prefix: str = "model") -> list[Rule]:
    tied = bool(hf.get("tie_word_embeddings", False))
    embed = f"{prefix}.embed_tokens.weight"
    return [
        Rule("embedding.word_embeddings.weight", (embed,), VOCAB, ROWS),
        Rule("decoder.final_layernorm.weight", (f"{prefix}.norm.weight",)),
        # Tied: the last stage's output layer (PP > 1) is a copy of the embedding.
        Rule("output_layer.weight", (embed,) if tied else ("lm_head.weight",), VOCAB, ROWS, export=not tied),
    ]


def vision_tower(hf_prefix: str) -> list[Rule]:
    """The HF vision module, replicated over TP: its tensors keep their HF names under `hf_prefix`."""
    return [Rule("vision" + PREFIX, (hf_prefix + PREFIX,))]
