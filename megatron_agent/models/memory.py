"""Parameter counts of an HF model and its training memory per GPU under a parallel layout:
the arithmetic behind the memory figures in configs/model/*.yaml (tests/unit/test_presets.py
checks the files against it).

    counts = parameter_counts(read_hf_config("/ckpt/Qwen3-VL-30B-A3B"))
    memory = training_memory(hf, ParallelConfig(tp=4, ep=8, sequence_parallel=True), 16,
                             micro_batch_tokens=8192, image_token_fraction=0.25, kl_reference=True)

What the trainer keeps (megatron_agent/training/actor.py, schedule.py), in bytes per
parameter held by the GPU: bf16 weights 2, fp32 gradient buffers 4 (DDP
grad_reduce_in_fp32), Adam's fp32 main parameters, m and v 12 divided over the data-parallel
group (the distributed optimizer; experts over the expert-data-parallel group), and with the
KL loss a frozen bf16 reference copy 2.

Activations are an estimate: bf16 tensors each layer keeps for its backward pass, no
recomputation, flash attention (no [s, s] scores), sequence parallel dividing every
per-token tensor by TP, routing spread evenly over the experts; the vision tower is
replicated on every TP rank and sees all of a micro-batch's images. The per-token widths
are in `ACTIVATION_WIDTHS`' docstring. Allocator fragmentation, the CUDA context and NCCL
buffers are not in the totals: `RESERVE_GIB` is kept for them when checking a fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_agent.models.families import UnsupportedModelError, family_of
from megatron_agent.platform.parallel import ParallelConfig

GIB = 2**30
# Memory nvidia-smi reports for the parts the presets are written for.
GPU_MEMORY_GIB = {"H100-80GB": 81559 / 1024, "H200-141GB": 143771 / 1024}
RESERVE_GIB = 8.0  # CUDA context, NCCL buffers, allocator fragmentation
QWEN3_VL_TOWERS = ("qwen3_vl", "qwen3_vl_moe")


@dataclass(frozen=True)
class ParameterCounts:
    embedding: int
    lm_head: int  # 0 when tied to the embedding
    attention: int  # every layer's q, k, v, o (biases, q/k norms)
    dense_mlp: int  # every layer's SwiGLU MLP (dense models)
    experts: int  # every layer's routed experts
    router: int
    norms: int  # the layers' two RMSNorms and the final one
    vision: int  # the vision tower with its mergers

    @property
    def total(self) -> int:
        return (self.embedding + self.lm_head + self.attention + self.dense_mlp + self.experts + self.router
                + self.norms + self.vision)


def vision_parameters(hf: dict) -> int:
    """Qwen3-VL's tower: patch conv (with bias), learned position table, blocks of LayerNorm +
    fused-qkv attention + GELU MLP (all with biases), a 2x2 merger and one per DeepStack tap."""
    v = hf.get("vision_config")
    if not v:
        return 0
    if family_of(hf).name not in QWEN3_VL_TOWERS:
        raise UnsupportedModelError(f"vision parameter count: only the Qwen3-VL tower, not {family_of(hf).name}")
    h, inner = v["hidden_size"], v["intermediate_size"]
    patch = v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2 * h + h
    positions = v["num_position_embeddings"] * h
    block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * inner + inner) + (inner * h + h)
    merged = h * v["spatial_merge_size"] ** 2
    merger_mlp = (merged * merged + merged) + (merged * v["out_hidden_size"] + v["out_hidden_size"])
    main_merger = 2 * h + merger_mlp  # LayerNorm before the 2x2 shuffle
    deepstack_merger = 2 * merged + merger_mlp  # LayerNorm after it
    taps = len(v.get("deepstack_visual_indexes") or [])
    return patch + positions + v["depth"] * block + main_merger + taps * deepstack_merger


def parameter_counts(hf: dict) -> ParameterCounts:
    """`hf` as `read_hf_config` gives it (a VLM's text_config lifted, vision_config kept)."""
    family = family_of(hf)
    d, layers = hf["hidden_size"], hf["num_hidden_layers"]
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    q, kv = heads * head_dim, (hf.get("num_key_value_heads") or heads) * head_dim
    attention = 2 * d * q + 2 * d * kv
    if family.qkv_bias(hf):
        attention += q + 2 * kv
    if family.qk_layernorm:
        attention += 2 * head_dim
    experts = router = dense = 0
    if family.moe:
        e = hf.get("num_experts") or hf["num_local_experts"]
        experts, router = layers * e * 3 * d * hf["moe_intermediate_size"], layers * e * d
    else:
        dense = layers * 3 * d * hf["intermediate_size"]
    embedding = hf["vocab_size"] * d
    return ParameterCounts(
        embedding=embedding, lm_head=0 if hf.get("tie_word_embeddings") else embedding,
        attention=layers * attention, dense_mlp=dense, experts=experts, router=router,
        norms=layers * 2 * d + d, vision=vision_parameters(hf),
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the most loaded GPU (the first pipeline stage)."""

    dense_parameters: int  # parameters of this GPU reduced over the data-parallel group
    expert_parameters: int  # over the expert-data-parallel group
    weights: int
    gradients: int
    optimizer: int
    reference: int
    activations: int

    @property
    def parameters(self) -> int:
        return self.dense_parameters + self.expert_parameters

    @property
    def static(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.reference

    @property
    def total(self) -> int:
        return self.static + self.activations

    def gib(self, name: str) -> float:
        return getattr(self, name) / GIB

    def fits(self, gpu: str) -> bool:
        return self.total / GIB + RESERVE_GIB <= GPU_MEMORY_GIB[gpu]


def activation_widths(hf: dict, tp: int) -> tuple[float, float, float]:
    """Per-token bf16 values kept for backward: (per decoder layer / TP, head and loss / TP,
    per image patch for the whole vision tower).

    Attention: the norm's input and the qkv input (2d), the qkv output, the q/k-normed and
    the rotated q and k, the attention output (4q + 4kv). Dense MLP: the norm's and fc1's
    inputs (2d), gate and up (2I), the SwiGLU output (I). MoE: the same two inputs (2d),
    fp32 router logits and probabilities (4E in bf16 units), and per routed copy (top-k of
    them) the expert's input and output (2d), gate and up (2f) and the SwiGLU output (f).
    Head: the final norm's input (d), logits in bf16 and fp32 (3V). Vision, per patch and
    block: the two LayerNorms' and the two linears' inputs (4h), qkv (3h), the attention
    output (h), fc1's output and the GELU output (2I).
    """
    d = hf["hidden_size"]
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    q, kv = heads * head_dim, (hf.get("num_key_value_heads") or heads) * head_dim
    layer = 2 * d + 4 * q + 4 * kv
    if family_of(hf).moe:
        e, k, f = hf.get("num_experts") or hf["num_local_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]
        layer += 2 * d + 4 * e + k * (2 * d + 3 * f)
    else:
        layer += 2 * d + 3 * hf["intermediate_size"]
    taps = len((hf.get("vision_config") or {}).get("deepstack_visual_indexes") or [])
    head = d + 3 * hf["vocab_size"] + (1 + taps) * d  # + the embedding output and the DeepStack addends
    v = hf.get("vision_config")
    patch = v["depth"] * (8 * v["hidden_size"] + 2 * v["intermediate_size"]) if v else 0
    return layer / tp, head / tp, patch


def training_memory(hf: dict, parallel: ParallelConfig, world_size: int, *, micro_batch_tokens: int,
                    image_token_fraction: float = 0.0, kl_reference: bool = True) -> MemoryEstimate:
    """Memory of the first pipeline stage's GPU training `hf` on `world_size` ranks.

    `image_token_fraction`: the share of a micro-batch's tokens that are image tokens (each
    one merged from spatial_merge_size**2 patches). With pipeline parallelism the first
    stage holds pp micro-batches in flight (1F1B) of its layers / pp: the same activation
    bytes as one micro-batch through every layer.
    """
    dp = parallel.validate(world_size)
    edp = parallel.expert_data_parallel_size(world_size)
    c = parameter_counts(hf)
    tp, pp = parallel.tp, parallel.pp
    per_stage = 1 / pp
    first_stage_dense = ((c.embedding + c.attention + c.dense_mlp) * per_stage / tp
                         + (c.router + c.norms) * per_stage + c.vision)
    last_stage_extra = c.lm_head / tp if pp == 1 else 0  # with pp > 1 the head is on the last stage
    dense = round(first_stage_dense + last_stage_extra)
    experts = round(c.experts * per_stage / (parallel.ep * parallel.expert_tp))
    held = dense + experts
    layer, head, patch = activation_widths(hf, tp)
    merge = (hf.get("vision_config") or {}).get("spatial_merge_size", 1) ** 2
    patches = image_token_fraction * micro_batch_tokens * merge
    activation_values = micro_batch_tokens * (hf["num_hidden_layers"] * layer + head) + patches * patch
    return MemoryEstimate(
        dense_parameters=dense, expert_parameters=experts,
        weights=2 * held, gradients=4 * held, optimizer=round(12 * (dense / dp + experts / edp)),
        reference=2 * held if kl_reference else 0, activations=round(2 * activation_values),
    )
