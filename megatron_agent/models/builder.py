"""Build Megatron-Core GPT models from an HF config, on the layer spec this machine runs."""

from __future__ import annotations

import contextlib
import logging

import torch

from megatron_agent.models.families import family_of
from megatron_agent.models.transformer_config import (
    gpt_model_kwargs,
    num_experts,
    read_hf_config,
    transformer_config_from_hf,
)
from megatron_agent.platform.cpu_support import cpu_support_enabled
from megatron_agent.platform.device import detect_platform
from megatron_agent.platform.parallel import ParallelConfig

log = logging.getLogger(__name__)


def choose_layer_spec(requested: str | None = None) -> str:
    """"transformer_engine" when TE imports and a GPU is present, else "local"."""
    available = detect_platform().layer_spec
    if requested in (None, "auto"):
        return available
    if requested == "transformer_engine" and available != "transformer_engine":
        raise RuntimeError(
            "layer_spec='transformer_engine' needs a GPU and an importable transformer_engine; "
            "run `megatron-agent doctor` to see what is missing"
        )
    if requested not in ("local", "transformer_engine"):
        raise ValueError(f"layer_spec={requested!r}; choose auto, local or transformer_engine")
    return requested


def layer_spec_for(hf: dict, spec: str):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    family = family_of(hf)
    experts = num_experts(hf) if family.moe else None
    if spec == "transformer_engine":
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=bool(experts), qk_layernorm=family.qk_layernorm
        )
    return get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, qk_layernorm=family.qk_layernorm,
        normalization="RMSNorm",
    )


def build_model(
    hf_config,
    parallel: ParallelConfig,
    *,
    params_dtype: torch.dtype = torch.float32,
    layer_spec: str | None = None,
    fp8_recipe: str | None = None,
    training: bool = True,
    init_weights: bool = True,
    meta: bool = False,
    routing_replay: bool = False,
) -> list:
    """One GPTModel chunk per virtual pipeline stage of this rank (one without VPP).

    Megatron's parallel groups must be initialised (platform.init_distributed). Weights
    are randomly initialised; the bridge loads real ones. `training=False` admits
    layouts that only inference supports (MoE with tp > 1 and no sequence parallelism).
    `init_weights=False` skips the random initialisation when weights are loaded next.
    `meta=True` puts the parameters on the meta device: shapes, names and the sharded
    state dict without memory (what a checkpoint converter lays files out from).
    `routing_replay`: MoE routers that route by given expert ids (training/routing_replay.py).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    hf = read_hf_config(hf_config)
    spec_name = choose_layer_spec(layer_spec)
    if parallel.sequence_parallel and spec_name != "transformer_engine" and not cpu_support_enabled():
        # Megatron's torch-norm fallback refuses it: its norm weights are not marked for
        # the TP all-reduce that sequence-parallel gradients need. The CPU support layer
        # tags them (platform/cpu_support.py); a GPU without TE has no such layer.
        raise RuntimeError("sequence parallelism with the local layer spec runs on CPU only; "
                           "on a GPU it needs the Transformer Engine layer spec")
    if fp8_recipe is not None and spec_name != "transformer_engine":
        raise RuntimeError(f"fp8_recipe={fp8_recipe!r} needs the Transformer Engine layer spec")
    config = transformer_config_from_hf(
        hf, parallel, params_dtype=params_dtype, fp8_recipe=fp8_recipe,
        moe_grouped_gemm=spec_name == "transformer_engine", training=training,
        init_weights=init_weights and not meta, use_cpu_initialization=True if meta else None,
        routing_replay=routing_replay,
    )
    spec = layer_spec_for(hf, spec_name)
    log.info(
        "building %s (%d layers, hidden %d) with the %s layer spec%s",
        hf["model_type"], hf["num_hidden_layers"], hf["hidden_size"], spec_name,
        f", fp8 {fp8_recipe}" if fp8_recipe else "",
    )
    kwargs = gpt_model_kwargs(hf, parallel)
    model_class = GPTModel
    if family_of(hf).vision_tower:
        from megatron_agent.models.vision_language import VisionLanguageModel

        model_class, kwargs = VisionLanguageModel, dict(kwargs, hf=hf)
    chunks = []
    for vp_stage in range(parallel.vpp or 1):
        vp = vp_stage if parallel.vpp else None
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = model_class(
                config=config,
                transformer_layer_spec=spec,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                vp_stage=vp,
                **kwargs,
            )
        if not init_weights:
            mark_tensor_parallel_weights(model)
        norms_to_params_dtype(model, params_dtype)
        if model.post_process:
            mask_padded_vocab(model, hf["vocab_size"])
        if torch.cuda.is_available() and not meta:
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def norms_to_params_dtype(model, params_dtype: torch.dtype) -> None:
    """Give torch norm modules the model's parameter dtype.

    The local layer spec builds its norms as torch modules (transformer/torch_norm.py) in
    torch's default dtype, fp32, whatever `params_dtype` says; Megatron-LM casts the whole
    model afterwards (Float16Module), which this project does not use. Left alone, a bf16
    model trains fp32 norm weights that a bf16 engine rounds, so the weight sync's
    checksum check fails on every norm after the first update. Transformer Engine's norms
    take `params_dtype` already.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm | torch.nn.LayerNorm):
            module.to(params_dtype)


def mark_tensor_parallel_weights(model) -> None:
    """Tag TP-split weights as Megatron's initialisation would have.

    Megatron sets `tensor_model_parallel` / `partition_dim` on a weight inside its
    initialisation (tensor_parallel/layers.py, _initialize_affine_weight_cpu/_gpu), so
    with perform_initialization=False the tags are missing and the optimizer counts each
    TP shard as a duplicate: the gradient norm (and so clipping) comes out wrong.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)


# Logit for padded vocabulary entries: exp() of it is exactly 0 in fp32/bf16, and unlike
# -inf it keeps entropy (p * log p) finite.
PADDED_VOCAB_LOGIT = -1.0e4


def mask_padded_vocab(model, vocab_size: int) -> None:
    """Padded vocabulary rows (to a multiple of TP) must not take probability mass.

    Megatron pads the output layer to split it over TP ranks; left alone, the extra
    logits enter every softmax, and probabilities differ from the HF model's.
    """
    from megatron.core import parallel_state

    padded = model.vocab_size
    if padded == vocab_size:
        return
    per_rank = padded // parallel_state.get_tensor_model_parallel_world_size()
    first = parallel_state.get_tensor_model_parallel_rank() * per_rank
    local_pad_start = max(0, vocab_size - first)
    if local_pad_start >= per_rank:
        return

    def hook(module, args, output):
        logits, bias = output
        pad = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        pad[local_pad_start:] = True
        return logits.masked_fill(pad, PADDED_VOCAB_LOGIT), bias

    model.output_layer.register_forward_hook(hook)
