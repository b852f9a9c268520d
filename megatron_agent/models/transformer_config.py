"""HF `config.json` -> Megatron-Core `TransformerConfig` and `GPTModel` arguments, and the
checks of a parallel layout against the model (`validate_layout_for_model`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_agent.models.families import FAMILIES, UnsupportedModelError, family_of
from megatron_agent.platform.parallel import ParallelConfig

FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def read_hf_config(source: str | Path | dict) -> dict:
    """An HF config as a dict, from a model directory, a config.json, or a dict, read the
    way transformers' model of its family reads it (`transformers_reading`).

    A vision-language config's `text_config` is lifted to the top level (transformers 5
    nests it, published checkpoints mostly do not), so the language model's fields are
    read alike for every family; `vision_config` stays as it is.
    """
    if isinstance(source, dict):
        raw = dict(source)
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no HF config at {path}")
        raw = json.loads(path.read_text())
    rest = {k: v for k, v in raw.items() if k != "text_config"}
    hf = {**raw["text_config"], **rest} if raw.get("text_config") else rest
    if hf.get("model_type") not in FAMILIES:
        return hf  # transformer_config_from_hf names the family as unsupported
    return {**hf, **transformers_reading(raw)}


def transformers_config(hf: dict):
    """transformers' own config object for `hf` (as config.json holds it, or with its
    text_config lifted): its defaults for missing keys, its conversions of older keys."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    fields = {k: v for k, v in hf.items() if k != "model_type"}
    if FAMILIES[hf["model_type"]].vision_tower and "text_config" not in fields:
        text = {k: v for k, v in fields.items() if k != "vision_config"}
        fields = {"text_config": text, "vision_config": fields.get("vision_config"),
                  **{k: fields[k] for k in ("tie_word_embeddings",) if k in fields}}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # defaults it checks against this config (token ids past a tiny vocabulary)
    try:
        return AutoConfig.for_model(hf["model_type"], **fields)
    except (StrictDataclassError, TypeError, ValueError, KeyError) as err:
        raise UnsupportedModelError(f"transformers cannot read this {hf['model_type']} config: {err}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def transformers_reading(hf: dict) -> dict:
    """The values transformers' model of this family takes from `hf`, for every key this
    project reads: the config class's defaults where config.json has no such key (Qwen3's
    head_dim is 128, not hidden / heads; Qwen2.5-VL's rope_theta 1e6, rms_norm_eps 1e-5),
    and no value from a key the family's model does not read (Qwen2.5-VL's attention takes
    hidden / heads whatever head_dim says; Llama has no sliding window). What each family
    reads: models/families/ and docs/models.md."""
    family = FAMILIES[hf["model_type"]]
    config = transformers_config(hf)
    text = config.get_text_config()
    heads = text.num_attention_heads
    values = {
        "num_hidden_layers": text.num_hidden_layers,
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": text.num_key_value_heads or heads,
        "head_dim": family.head_dim(text),
        "vocab_size": text.vocab_size,
        "rms_norm_eps": text.rms_norm_eps,
        "hidden_act": text.hidden_act,
        "max_position_embeddings": text.max_position_embeddings,
        "initializer_range": text.initializer_range,
        "tie_word_embeddings": bool(config.tie_word_embeddings),  # what the top-level model ties on
        "rope_parameters": dict(text.rope_parameters),
        "attention_bias": bool(family.attention_bias and text.attention_bias),
        "mlp_bias": bool(family.mlp_bias and text.mlp_bias),
        "use_sliding_window": bool(family.sliding_window(text)),
    }
    if family.moe:
        values.update(
            num_experts=text.num_experts,
            num_experts_per_tok=text.num_experts_per_tok,
            moe_intermediate_size=text.moe_intermediate_size,
            decoder_sparse_step=text.decoder_sparse_step,
            mlp_only_layers=list(text.mlp_only_layers or []),
            norm_topk_prob=bool(getattr(text, "norm_topk_prob", False)),
        )
    return values


@dataclass(frozen=True)
class RopeSettings:
    base: float
    llama3_scaling_factor: float | None = None  # Megatron's fixed llama3 recipe
    linear_factor: float | None = None


def rope_settings(hf: dict) -> RopeSettings:
    """Read the rope base and scaling from either config generation.

    transformers < 5 writes `rope_theta` and `rope_scaling`; 5.x writes `rope_parameters`.
    """
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    base = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    spec = params if params.get("rope_type") else scaling
    if kind in ("default", "mrope"):  # "mrope": older Qwen2-VL / 2.5-VL configs
        return RopeSettings(base=float(base))
    if kind == "linear":
        return RopeSettings(base=float(base), linear_factor=float(spec["factor"]))
    if kind == "llama3":
        # Megatron's RotaryEmbedding applies llama3 scaling with low/high frequency
        # factors 1 and 4 over an original context of 8192 (Llama 3.1's values).
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, want in fixed.items():
            if float(spec.get(key, want)) != want:
                raise UnsupportedModelError(
                    f"llama3 rope scaling with {key}={spec[key]} is not supported (Megatron uses {want})"
                )
        return RopeSettings(base=float(base), llama3_scaling_factor=float(spec["factor"]))
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported")


def mrope_section(hf: dict) -> list[int] | None:
    """The rotary channels given to the (temporal, height, width) positions; None: 1-D RoPE."""
    for spec in (hf.get("rope_parameters"), hf.get("rope_scaling")):
        if spec and spec.get("mrope_section"):
            return list(spec["mrope_section"])
    return None


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Vocabulary padded to a multiple of TP, no more (padding rows are masked out)."""
    return math.ceil(vocab_size / tp) * tp


def num_experts(hf: dict) -> int | None:
    return hf.get("num_experts") or hf.get("num_local_experts")


def moe_layer_pattern(hf: dict) -> int | list[int]:
    """Megatron's moe_layer_freq from Qwen-MoE's decoder_sparse_step and mlp_only_layers."""
    n = hf["num_hidden_layers"]
    step = hf.get("decoder_sparse_step", 1) or 1
    dense = set(hf.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(n)]
    return 1 if all(pattern) else pattern


def validate_layout_for_model(hf: dict, parallel: ParallelConfig, *, training: bool = True) -> None:
    heads = hf["num_attention_heads"]
    parallel.validate_model(
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        num_experts=num_experts(hf),
        moe_ffn_hidden_size=hf.get("moe_intermediate_size"),
        ffn_hidden_size=hf.get("intermediate_size") if not num_experts(hf) else None,
        training=training,
    )
    # DeepStack adds the tower's i-th feature map after LM layer i: layers 0..n-1 must be in
    # the first model chunk, the one that runs the vision tower (vision_language.py).
    taps = len((hf.get("vision_config") or {}).get("deepstack_visual_indexes") or [])
    first_chunk = hf["num_hidden_layers"] // (parallel.pp * (parallel.vpp or 1))
    if taps and first_chunk < taps:
        raise UnsupportedModelError(
            f"deepstack adds visual features after language-model layers 0-{taps - 1}, which must sit on the first "
            f"pipeline stage with the vision tower; pp={parallel.pp} x vpp={parallel.vpp or 1} gives its first chunk "
            f"{first_chunk} of the {hf['num_hidden_layers']} layers: use fewer pipeline stages or virtual chunks")


def swiglu_fusion_default() -> bool:
    """Megatron's fused SwiGLU (TransformerConfig.bias_activation_fusion; fusions/
    fused_bias_swiglu.py) on a GPU: its autograd function keeps only the MLP's fc1 output
    for backward, where the unfused silu(gate) * (up + 0) also keeps silu(gate), up + 0 and
    their product (5 x the MLP width per token with fc2's input instead of 3; models/memory.py).
    Its forward is the same arithmetic; its backward rounds in another order, so the CPU
    keeps the unfused path and the numbers its tests compare. On a GPU the kernel is
    torch.compile'd (megatron/core/jit.py); on the CPU it would run eagerly."""
    return torch.cuda.is_available()


def transformer_config_from_hf(
    hf: dict,
    parallel: ParallelConfig,
    *,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool | None = None,
    fp8_recipe: str | None = None,
    moe_grouped_gemm: bool = False,
    moe_token_dispatcher: str = "alltoall",
    training: bool = True,
    init_weights: bool = True,
    fused_swiglu: bool | None = None,
    routing_replay: bool = False,
):
    """The Megatron TransformerConfig that computes what the HF model computes.
    `fused_swiglu`: None takes `swiglu_fusion_default()`. `routing_replay`: the MoE routers
    can route by given expert ids (training/routing_replay.py)."""
    from megatron.core.transformer import TransformerConfig

    family = family_of(hf)
    validate_layout_for_model(hf, parallel, training=training)
    hf = read_hf_config(hf)
    if hf["attention_bias"]:
        raise UnsupportedModelError(
            f"attention_bias=true: transformers' {family.name} then has a bias on o_proj as well as on q, k and v, "
            "and Megatron-Core has no attention output bias without a bias on every linear layer")
    if hf["mlp_bias"]:
        raise UnsupportedModelError(f"mlp_bias=true ({family.name}: biases on gate, up and down) is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is supported")
    if hf.get("use_sliding_window"):
        raise UnsupportedModelError("sliding-window attention is not supported")
    if fp8_recipe is not None and fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_recipe={fp8_recipe!r}; choose one of {FP8_RECIPES} or None")
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()

    heads = hf["num_attention_heads"]
    kwargs = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf["head_dim"],
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias(hf),
        qk_layernorm=family.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=hf.get("initializer_range", 0.02),
        bias_activation_fusion=swiglu_fusion_default() if fused_swiglu is None else fused_swiglu,
        # Fusions below need apex or Transformer Engine kernels; the unfused paths are exact.
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=init_weights,
        # Batches are packed by a token budget, so sequence lengths vary between steps.
        variable_seq_lengths=True,
        moe_token_dispatcher_type=moe_token_dispatcher,  # checked against the above even when dense
        cuda_graph_scope=[],  # the whole layer; Megatron's default "full" is deprecated and warns
    )
    if family.vision_tower:
        kwargs.update(mrope_section=mrope_section(hf))
    if parallel.vpp:
        # Megatron-LM's own defaults for the interleaved schedule. Its dataclass default,
        # batched p2p, posts both directions to the same peer in one batch; with pp=2 the
        # peer is the same rank both ways and gloo can match an activation with a gradient.
        kwargs.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if fp8_recipe is not None:
        kwargs.update(fp8="e4m3" if fp8_recipe in ("blockwise", "mxfp8") else "hybrid", fp8_recipe=fp8_recipe)
    if family.moe:
        kwargs.update(
            num_moe_experts=num_experts(hf),
            moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            moe_layer_freq=moe_layer_pattern(hf),
            # Qwen's norm_topk_prob renormalises the top-k softmax weights, which is the
            # same as a softmax over the top-k logits (Megatron's pre_softmax=False).
            moe_router_pre_softmax=not (family.norm_topk_prob if family.norm_topk_prob is not None
                                        else hf.get("norm_topk_prob", False)),
            moe_router_score_function="softmax",
            # No auxiliary load-balancing loss by default for RL fine-tuning.
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_router_dtype="fp32",
            moe_grouped_gemm=moe_grouped_gemm,
            moe_permute_fusion=False,
            # Replay takes the router's unfused top-k (the fused TE kernel never consults it)
            # and no capacity factor (it would drop replayed tokens; the engines drop none):
            # both are this config's defaults.
            moe_enable_routing_replay=routing_replay,
        )
    elif routing_replay:
        raise ValueError(f"routing replay needs an MoE model; {hf['model_type']} has no router")
    return TransformerConfig(**kwargs)


def gpt_model_kwargs(hf: dict, parallel: ParallelConfig) -> dict:
    hf = read_hf_config(hf)
    rope = rope_settings(hf)
    return dict(
        vocab_size=padded_vocab_size(hf["vocab_size"], parallel.tp),
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        position_embedding_type="mrope" if family_of(hf).vision_tower else "rope",
        rotary_base=rope.base,
        rope_scaling=rope.llama3_scaling_factor is not None,
        rope_scaling_factor=rope.llama3_scaling_factor or 8.0,
        seq_len_interpolation_factor=rope.linear_factor,
        parallel_output=True,
    )
