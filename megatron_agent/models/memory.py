"""Parameter counts of an HF model and its training memory per GPU under a parallel layout:
the arithmetic behind the memory figures in configs/model/*.yaml (tests/unit/test_presets.py
checks the files against it).

    counts = parameter_counts(read_hf_config("/ckpt/Qwen3-VL-30B-A3B"))
    memory = training_memory(hf, ParallelConfig(tp=4, ep=16, etp=1, sequence_parallel=True), 16,
                             micro_batch_tokens=8192, image_token_fraction=0.25, kl_reference=True)

What the trainer keeps (megatron_agent/training/actor.py, schedule.py), in bytes per
parameter held by the GPU: bf16 weights 2, fp32 gradient buffers 4 (DDP
grad_reduce_in_fp32), Adam's fp32 main parameters, m and v 12 divided over the data-parallel
group (the distributed optimizer; experts over the expert-data-parallel group), with the
KL loss a frozen bf16 reference copy 2, and with FP8 training Transformer Engine's FP8 copies
of its linear layers' weights. The weight-sync source (rank 0) keeps its two bucket buffers
(weight_sync/buckets.py BucketBuffers) from one sync to the next.

Activations are what autograd keeps for backward, tensor by tensor (`activation_bytes`):
no recomputation, routing spread evenly over the experts, the vision tower replicated on
every TP rank and seeing all of a micro-batch's images. `ActivationPath` says which code a
layer runs: the GPU path (Transformer Engine layer spec, fused SwiGLU, flash attention) or
the CPU one (Megatron's local spec, the unfused MLP, attention with [s, s] scores).
tests/multirank/test_activation_memory.py measures the CPU path's bytes with saved-tensor
hooks on tiny dense, MoE and vision-language models (bf16, TP 1 and TP 2 with sequence
parallelism) and holds them to `activation_bytes` within 10 %; the GPU path differs in the
terms `activation_bytes` names, read from Transformer Engine 2.11 and Megatron-Core 0.16.1.

On top of the activations, the logits' gradients exist for a moment at the start of
backward (`logits_transient`, read from the code, not measured). Allocator
fragmentation, the CUDA context and NCCL buffers are not in the totals: `SPARE_GIB` is
kept free for them when checking a fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_agent.models.families import UnsupportedModelError, family_of
from megatron_agent.platform.parallel import ParallelConfig

GIB = 2**30
# Memory nvidia-smi reports for the parts the presets are written for.
GPU_MEMORY_GIB = {"H100-80GB": 81559 / 1024, "H200-141GB": 143771 / 1024}
SPARE_GIB = 8.0  # left free: CUDA context, NCCL buffers, allocator fragmentation
QWEN3_VL_TOWERS = ("qwen3_vl", "qwen3_vl_moe")
BF16, FP32, INT64, BOOL = 2, 4, 8, 1
# weight_sync.WeightSyncConfig.bucket_bytes (models sit below weight_sync; test_presets.py
# checks the two agree). The source keeps two buffers, each grown to the largest bucket
# copied into it: a tensor larger than a bucket goes alone.
WEIGHT_SYNC_BUCKET_BYTES = 512 * 2**20
# training/logprobs.py CHUNK_ELEMENTS: fp32 values of one chunk of logits; its forward and
# backward hold up to this many chunk-sized fp32 temporaries at once.
LOSS_CHUNK_ELEMENTS = 2**24
LOSS_CHUNK_BUFFERS = 4
# Per token, what the loss keeps besides the logits (token ids, three fp32 sums per call,
# the policy loss's per-token terms): the largest measured, KL + entropy + clipping.
LOSS_TOKEN_BYTES = 96
# actor.py `_loss` takes both from token_logprobs_and_entropy: one bf16 gradient of the
# logits at the start of backward (two if it called token_logprobs and token_entropy apart).
LOGIT_GRADIENT_BUFFERS = 1


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
    _check_qwen3_vl_tower(hf, "vision parameter count")
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


def _check_qwen3_vl_tower(hf: dict, what: str) -> None:
    if family_of(hf).name not in QWEN3_VL_TOWERS:
        raise UnsupportedModelError(f"{what}: only the Qwen3-VL tower, not {family_of(hf).name}")


def parameter_counts(hf: dict) -> ParameterCounts:
    """`hf` as `read_hf_config` gives it (a VLM's text_config lifted, vision_config kept)."""
    family = family_of(hf)
    d, layers = hf["hidden_size"], hf["num_hidden_layers"]
    q, kv, head_dim = attention_widths(hf)
    attention = 2 * d * q + 2 * d * kv
    if family.qkv_bias(hf):
        attention += q + 2 * kv
    if family.qk_layernorm:
        attention += 2 * head_dim
    experts = router = dense = 0
    if family.moe:
        e = _num_experts(hf)
        experts, router = layers * e * 3 * d * hf["moe_intermediate_size"], layers * e * d
    else:
        dense = layers * 3 * d * hf["intermediate_size"]
    embedding = hf["vocab_size"] * d
    return ParameterCounts(
        embedding=embedding, lm_head=0 if hf.get("tie_word_embeddings") else embedding,
        attention=layers * attention, dense_mlp=dense, experts=experts, router=router,
        norms=layers * 2 * d + d, vision=vision_parameters(hf),
    )


def attention_widths(hf: dict) -> tuple[int, int, int]:
    """(query width, key/value width, head dim)."""
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return heads * head_dim, (hf.get("num_key_value_heads") or heads) * head_dim, head_dim


def _num_experts(hf: dict) -> int:
    return hf.get("num_experts") or hf["num_local_experts"]


# Megatron's linears LoRA targets (models/lora.py): (column-parallel: output rows split over
# TP, A whole; row-parallel: input columns split, B whole), their widths by `linear_widths`.
_COLUMN_LINEARS = ("linear_qkv", "linear_fc1")
_EXPERT_LINEARS = ("linear_fc1", "linear_fc2")


def linear_widths(hf: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each decoder linear LoRA may target (an expert's for an MoE model)."""
    d = hf["hidden_size"]
    q, kv, _ = attention_widths(hf)
    ffn = hf["moe_intermediate_size"] if family_of(hf).moe else hf["intermediate_size"]
    return {"linear_qkv": (d, q + 2 * kv), "linear_proj": (q, d), "linear_fc1": (d, 2 * ffn), "linear_fc2": (ffn, d)}


def lora_parameters(hf: dict, lora, parallel: ParallelConfig | None = None) -> tuple[int, int]:
    """(dense, expert) adapter parameters one GPU of the first pipeline stage holds, `lora`
    a models/lora.py LoraConfig (rank, targets, experts); without `parallel`, the whole
    model's. A column-parallel linear keeps A [r, in] whole and splits B's rows, a
    row-parallel one splits A's columns and keeps B [out, r] whole; experts split over EP."""
    parallel = parallel or ParallelConfig()
    moe = family_of(hf).moe
    layers = hf["num_hidden_layers"] // parallel.pp
    dense = expert = 0
    for target in lora.targets:
        n_in, n_out = linear_widths(hf)[target]
        is_expert = moe and target in _EXPERT_LINEARS
        tp = parallel.expert_tp if is_expert else parallel.tp
        per_linear = lora.rank * (n_in + n_out // tp if target in _COLUMN_LINEARS else n_in // tp + n_out)
        if not is_expert:
            dense += layers * per_linear
        elif lora.experts:
            expert += layers * _num_experts(hf) // parallel.ep * per_linear
    return dense, expert


def lora_activation_bytes(hf: dict, parallel: ParallelConfig, lora, tokens: int) -> int:
    """What the adapters keep for backward beyond the base's tensors (models/lora.py): each
    one's r-wide intermediate (per routed copy for an expert); under sequence parallelism a
    column adapter's input, which it gathers itself, whole on every TP rank."""
    moe = family_of(hf).moe
    gathered = parallel.sequence_parallel and parallel.tp > 1
    per_layer = 0
    for target in lora.targets:
        if moe and target in _EXPERT_LINEARS:
            if lora.experts:
                per_layer += tokens // (parallel.tp if parallel.sequence_parallel else 1) * \
                    hf["num_experts_per_tok"] * parallel.expert_tp * lora.rank * BF16
            continue
        per_layer += tokens * lora.rank * BF16
        if gathered and target in _COLUMN_LINEARS:
            per_layer += tokens * hf["hidden_size"] * BF16
    return hf["num_hidden_layers"] // parallel.pp * per_layer


# ---- activations --------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationPath:
    """The code a micro-batch's forward runs, which decides what autograd keeps.

    layer_spec: "transformer_engine" (the GPU's: TE's norm fused into the next linear,
    flash attention) or "local" (Megatron's torch modules, what the CPU runs).
    fused_swiglu: Megatron's SwiGLUFunction (TransformerConfig.bias_activation_fusion),
    which keeps only its input, or the unfused silu(a) * (b + 0), which keeps four tensors.
    """

    layer_spec: str = "transformer_engine"
    fused_swiglu: bool = True


GPU_PATH = ActivationPath()
CPU_PATH = ActivationPath(layer_spec="local", fused_swiglu=False)


@dataclass(frozen=True)
class MicroBatchShape:
    """A micro-batch as the model sees it: `sequences` rows padded to `width` tokens, and the
    patches of its images (before the 2x2 merge)."""

    sequences: int
    width: int
    image_patches: int = 0

    @property
    def tokens(self) -> int:
        return self.sequences * self.width


def activation_bytes(hf: dict, parallel: ParallelConfig, shape: MicroBatchShape,
                     path: ActivationPath = GPU_PATH) -> dict[str, int]:
    """Bytes autograd keeps for backward on one GPU running every layer (the first stage
    with pp > 1: it holds pp micro-batches of its layers / pp, the same bytes), by part:
    "layers" (the decoder layers), "head" (embedding, final norm, output layer), "loss"
    (training/logprobs.py and the policy loss), "vision" (the tower, every TP rank).

    Per layer, tokens T = sequences x width, Ts = T / TP under sequence parallelism (the
    norms and the linears' inputs outside the TP region), widths inside it divided by TP:

    attention  GPU: the norm's input, its output (both bf16 d, kept by TE's LayerNormLinear
               for the weight gradient; Ts) and 1/rms (fp32); the q/k norms' inputs (TE's
               RMSNorm makes the strided views of the qkv output contiguous and keeps them)
               and 1/rms per head; RoPE's cos and sin for q and for k (bf16, per position:
               [s, 1, 1, head_dim], [s, b, 1, head_dim] for multimodal RoPE); q and k after
               RoPE, v made contiguous by TE's layout check, the output (which linear_proj
               keeps as its input too) and the softmax statistics (fp32 per head).
               CPU: the torch norms keep an fp32 copy of their input, the fp32 normalised
               input and 1/rms (q/k norms too), the qkv linear its bf16 input;
               DotProductAttention keeps q, k and v repeated to every
               query head, the [b, heads, s, s] probabilities in fp32 and bf16 and the causal
               mask; linear_proj its input.
    dense MLP  the norm's input (fp32 copy on the CPU) and output, fc1's output (2I) kept by
               SwiGLUFunction and fc2's input (I); unfused, silu(gate), up + 0 and their
               product too (5I).
    MoE        the norm's input and output (the router's and the dispatcher's input), the
               routing probabilities and map [E, t] (fp32, bool), the top-k probabilities
               and indices; per routed copy (top-k per token, x expert TP) the expert's
               input (d), its weight (fp32), fc1's output, fc2's input (3f fused; unfused
               silu, up + 0, their product and its product with the weight: 6f).
    head       the final norm's input (and output), the token ids.
    loss       the bf16 logits [b, s, V/TP] (logprobs.py keeps them and recomputes each
               chunk's softmax in backward) and LOSS_TOKEN_BYTES per token.
    vision     per patch: the pixels, the position weights, RoPE's fp32 cos and sin; per
               block the LayerNorms' inputs (and statistics), qkv's input and output, q and
               k after RoPE, the attention's output per image and again concatenated (proj's
               input), the softmax statistics, fc1's input and output, GELU's output; the
               mergers' LayerNorm output, fc1 output and GELU output.
    """
    d = hf["hidden_size"]
    q, kv, head_dim = attention_widths(hf)
    tp = parallel.tp
    heads, kv_heads = q // head_dim // tp, max(1, kv // head_dim // tp)
    q_l, kv_l = q // tp, kv_heads * head_dim
    b, s = shape.sequences, shape.width
    t = shape.tokens
    ts = t // tp if parallel.sequence_parallel else t
    family = family_of(hf)
    te = path.layer_spec == "transformer_engine"
    # a norm: TE keeps its bf16 input and 1/rms; torch's (its weight fp32 on the CPU) an fp32
    # copy of the input, the fp32 normalised input (for the weight's gradient) and 1/rms
    norm = ts * (BF16 * d + FP32) if te else ts * (2 * FP32 * d + FP32)  # + its output, counted by its user

    # attention
    layer = norm + ts * BF16 * d  # the input norm; its output (TE's ln_out, the local qkv input)
    if family.qk_layernorm:
        width = BF16 if te else 2 * FP32
        layer += t * (width * (q_l + kv_l) + FP32 * (heads + kv_heads))
    positions = b * s if family.vision_tower else s
    layer += 4 * positions * head_dim * BF16  # RoPE cos and sin, for q and for k
    if te:
        layer += t * (BF16 * (2 * q_l + 2 * kv_l) + FP32 * heads)
    else:
        grouped = heads > kv_heads
        layer += t * BF16 * (3 * q_l if grouped else q_l + kv_l + q_l + 2 * kv_l)
        layer += b * heads * s * s * (FP32 + BF16) + s * s * BOOL
        layer += t * BF16 * q_l  # linear_proj's input (TE: the attention output, above)

    # MLP
    if family.moe:
        e, k, f = _num_experts(hf), hf["num_experts_per_tok"], hf["moe_intermediate_size"]
        etp = parallel.expert_tp
        layer += norm + ts * BF16 * d  # the pre-MLP norm and its output
        layer += ts * (e * (FP32 + BOOL) + k * (FP32 + 2 * INT64))
        copies = ts * k * etp
        layer += copies * (BF16 * d + FP32 + BF16 * (f // etp) * (3 if path.fused_swiglu else 6))
    else:
        inner = hf["intermediate_size"] // tp
        layer += norm + ts * BF16 * d  # TE: fused into fc1, which keeps its output
        layer += t * BF16 * inner * (3 if path.fused_swiglu else 5)

    head = norm + ts * BF16 * d + t * INT64  # final norm, output layer's input, token ids
    if tp > 1:
        head += t * BOOL  # the vocab-parallel embedding's mask of ids outside this rank's slice
    if shape.image_patches:  # where each merged image token and DeepStack feature goes
        taps = len(hf["vision_config"].get("deepstack_visual_indexes") or [])
        head += shape.image_patches // hf["vision_config"]["spatial_merge_size"] ** 2 * (1 + taps) * 2 * INT64
    vocab = -(-hf["vocab_size"] // tp)  # padded to a multiple of TP
    loss = t * (vocab * BF16 + LOSS_TOKEN_BYTES)
    return {"layers": hf["num_hidden_layers"] * layer, "head": head, "loss": loss,
            "vision": vision_activation_bytes(hf, shape.image_patches)}


def vision_activation_bytes(hf: dict, patches: int) -> int:
    """What the Qwen3-VL tower keeps for `patches` patches (`activation_bytes`' docstring)."""
    v = hf.get("vision_config")
    if not v or not patches:
        return 0
    _check_qwen3_vl_tower(hf, "vision activations")
    h, inner, heads = v["hidden_size"], v["intermediate_size"], v["num_heads"]
    merge = v["spatial_merge_size"] ** 2
    stats = 2 * FP32  # a LayerNorm's mean and 1/std (bf16 on the CPU)
    per_patch = BF16 * v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2
    per_patch += 4 * (FP32 + INT64)  # bilinear weights and indices into the position table
    per_patch += 2 * FP32 * (h // heads)  # RoPE cos and sin, shared by the blocks
    block = BF16 * (11 * h + 2 * inner) + FP32 * heads + 2 * stats
    taps = v.get("deepstack_visual_indexes") or []
    # the main merger normalises each patch of the last block's output (its input kept),
    # then works on merged tokens (merge x h wide); a DeepStack merger normalises merged
    # tokens of a block's output, which the next block (or the main merger) keeps already
    main = BF16 * 4 * h + stats
    deepstack = BF16 * 3 * h + stats / merge
    return round(patches * (per_patch + v["depth"] * block + main + len(taps) * deepstack))


# ---- the total ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the most loaded GPU (the first pipeline stage, the weight-sync source)."""

    dense_parameters: int  # parameters of this GPU reduced over the data-parallel group
    expert_parameters: int  # over the expert-data-parallel group
    weights: int
    gradients: int
    optimizer: int
    reference: int
    fp8_weights: int  # Transformer Engine's FP8 copies of the linear weights (FP8 training)
    sync_buffers: int  # the weight-sync source's two bucket buffers
    activations: int  # kept for backward (`activation_bytes`)
    logits_transient: int  # the logits' gradients at the start of backward, and the loss's chunks

    @property
    def parameters(self) -> int:
        return self.dense_parameters + self.expert_parameters

    @property
    def static(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.reference + self.fp8_weights + self.sync_buffers

    @property
    def total(self) -> int:
        return self.static + self.activations + self.logits_transient

    def gib(self, name: str) -> float:
        return getattr(self, name) / GIB

    def spare_gib(self, gpu: str) -> float:
        return GPU_MEMORY_GIB[gpu] - self.total / GIB

    def fits(self, gpu: str) -> bool:
        return self.spare_gib(gpu) >= SPARE_GIB


def largest_exported_tensor_bytes(hf: dict) -> int:
    """The largest bf16 tensor of the HF checkpoint the weight sync sends: the embedding or
    head, or a layer's fused experts (Qwen3-VL-MoE's gate_up_proj)."""
    d = hf["hidden_size"]
    largest = hf["vocab_size"] * d
    if family_of(hf).moe:
        fused = family_of(hf).name == "qwen3_vl_moe"
        f = hf["moe_intermediate_size"]
        largest = max(largest, (_num_experts(hf) if fused else 1) * d * 2 * f)
    else:
        largest = max(largest, d * hf["intermediate_size"])
    return BF16 * largest


def training_memory(hf: dict, parallel: ParallelConfig, world_size: int, *, micro_batch_tokens: int,
                    image_token_fraction: float = 0.0, kl_reference: bool = True, fp8: bool = False,
                    path: ActivationPath = GPU_PATH, lora=None) -> MemoryEstimate:
    """Memory of the first pipeline stage's GPU training `hf` on `world_size` ranks, with
    micro-batches of one `micro_batch_tokens`-long sequence (the most RoPE tables; every
    other term depends on the tokens only).

    `image_token_fraction`: the share of a micro-batch's tokens that are image tokens (each
    one merged from spatial_merge_size**2 patches). `fp8`: TE keeps an FP8 copy of each of
    its linear weights and its transpose (1 + 1 bytes per parameter; the KL reference, which
    needs no weight gradient, 1) between micro-batches (module/base.py get_weight_workspace,
    cached since Megatron passes is_first_microbatch); activations are still counted at
    bf16, an upper bound (TE keeps FP8 copies of the linears' inputs).

    `lora` (a models/lora.py LoraConfig with rank > 0): the base is frozen (bf16 weights
    alone: no gradient buffers, no optimizer state, and no reference, which is the base); the
    adapters are trained as the whole model is otherwise (`lora_parameters`; bf16, fp32
    gradients, distributed Adam), and keep their own activations (`lora_activation_bytes`).
    Adapters sit on the local layer spec's linears only (not Transformer Engine's yet).
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
    te_linear = round((c.attention + c.dense_mlp) * per_stage / tp) + experts
    merge = (hf.get("vision_config") or {}).get("spatial_merge_size", 1) ** 2
    shape = MicroBatchShape(1, micro_batch_tokens,
                            image_patches=round(image_token_fraction * micro_batch_tokens * merge))
    activations = sum(activation_bytes(hf, parallel, shape, path).values())
    if lora is not None:
        if fp8 or path.layer_spec != "local":
            raise ValueError("LoRA adapters sit on the local layer spec's linears (not Transformer Engine's, "
                             "nor FP8): give path=ActivationPath(layer_spec='local')")
        activations += lora_activation_bytes(hf, parallel, lora, micro_batch_tokens)
    vocab = -(-hf["vocab_size"] // tp)
    logits = (LOGIT_GRADIENT_BUFFERS * BF16 * micro_batch_tokens * vocab
              + LOSS_CHUNK_BUFFERS * FP32 * LOSS_CHUNK_ELEMENTS)
    trained_dense, trained_experts = lora_parameters(hf, lora, parallel) if lora is not None else (dense, experts)
    trained = trained_dense + trained_experts
    return MemoryEstimate(
        dense_parameters=dense, expert_parameters=experts,
        weights=2 * held + (2 * trained if lora is not None else 0), gradients=4 * trained,
        optimizer=round(12 * (trained_dense / dp + trained_experts / edp)),
        reference=2 * held if kl_reference and lora is None else 0,
        fp8_weights=(3 if kl_reference else 2) * te_linear if fp8 else 0,
        sync_buffers=2 * max(WEIGHT_SYNC_BUCKET_BYTES, largest_exported_tensor_bytes(hf)),
        activations=activations, logits_transient=logits,
    )
