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


def head_dim_from_config(config) -> int:
    """transformers' attention for most families: `config.head_dim` where the config has
    one (a key of config.json, or the config class's default: 128 for Qwen3 and Qwen3-VL),
    else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def head_dim_from_hidden(config) -> int:
    """Qwen2.5-VL's text attention: hidden / heads, whatever head_dim config.json holds."""
    return config.hidden_size // config.num_attention_heads


def no_sliding_window(config) -> bool:
    return False


def sliding_window_layers(config) -> bool:
    """Qwen2, Qwen2.5-VL, Qwen3: the layers `layer_types` marks "sliding_attention" slide
    when the config keeps a `sliding_window` (its class drops it without use_sliding_window)."""
    return getattr(config, "sliding_window", None) is not None and "sliding_attention" in (
        getattr(config, "layer_types", None) or [])


def sliding_window_everywhere(config) -> bool:
    """Qwen3-MoE: every layer slides when the config keeps a `sliding_window`."""
    return getattr(config, "sliding_window", None) is not None


@dataclass(frozen=True)
class Family:
    """What sets a family apart, read off transformers' modeling code for it
    (transformers/models/<family>/modeling_<family>.py): the keys its model takes from a
    config and how; `transformer_config.read_hf_config` reads a config through it."""

    name: str
    qkv_bias: Callable[[dict], bool]
    qk_layernorm: bool
    moe: bool
    # The weight table for an HF config of this family.
    rules: Callable[[dict], list[Rule]] = field(repr=False)
    # The attention's head width, from transformers' config object of the language model.
    head_dim: Callable = head_dim_from_config
    # Whether the attention reads `attention_bias`: a bias on q, k, v *and* o_proj when true.
    attention_bias: bool = False
    # Whether the MLP reads `mlp_bias` (biases on gate, up and down when true).
    mlp_bias: bool = False
    # Whether the model attends through a sliding window, from transformers' config object.
    sliding_window: Callable = no_sliding_window
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
