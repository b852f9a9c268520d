"""Megatron-Core on a machine without CUDA.

Megatron-Core assumes CUDA in a handful of places (see docs/platform.md for the list
with the Megatron code paths). `enable_cpu_support()` redirects each of them to the CPU,
once, at start-up. It does nothing when CUDA is available, so the GPU path runs
Megatron unmodified.

The redirects are of three kinds:
1. the CUDA runtime calls Megatron makes (current device, synchronize, streams, events,
   the CUDA RNG) answer as the CPU would;
2. tensors Megatron creates with a literal `device="cuda"` or `.cuda()` land on the CPU;
3. six Megatron functions that cannot work on the CPU as written are wrapped.
None of them changes what a computation produces: a TP/PP/EP run on CPU equals the
single-rank run (tests/multirank).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import types
import warnings

import torch

log = logging.getLogger(__name__)

if not torch.cuda.is_available():
    # Megatron warns at import that it falls back to torch kernels without Apex/TE; on a
    # CPU machine that is the plan, and `megatron-agent doctor` reports it once.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    # A CUDA stream setting Megatron's TP layers recommend at every step (with async grad
    # all-reduce or sequence parallelism); no streams here.
    warnings.filterwarnings("ignore", message=r"When using (async grad allreduce|sequence parallelism)"
                                              r".*CUDA_DEVICE_MAX_CONNECTIONS")

_applied = False
_CPU = torch.device("cpu")


def enable_cpu_support() -> bool:
    """Apply every redirect when CUDA is absent. Idempotent. Returns whether it applied."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        _import_megatron_without_compile()
        _redirect_cuda_runtime()
        _redirect_cuda_tensor_creation()
        _patch_megatron()
        _applied = True
        log.debug("Megatron-Core CPU support enabled")
    return True


def cpu_support_enabled() -> bool:
    """Whether the redirects are in place (a CPU-only process after enable_cpu_support)."""
    return _applied


def _import_megatron_without_compile():
    """Import Megatron with `torch.compile` as the identity. At import Megatron wraps its
    fused kernels in `torch.compile` (megatron/core/jit.py: `jit_fuser`), which imports
    dynamo and inductor: 1.7 s of the 4.5 s a process took to import Megatron here, paid by
    every rank a test or a run starts. Those kernels only run with the fusions that
    `transformer_config` turns off; were one called, it would run eagerly, as it does
    uncompiled. Megatron keeps the identity as its `jit_fuser`; torch's own is restored."""
    if "megatron.core" in sys.modules:
        return
    compile_ = torch.compile

    def identity(model=None, **options):
        return model if model is not None else (lambda fn: fn)

    torch.compile = identity
    try:
        importlib.import_module("megatron.core")
    finally:
        torch.compile = compile_


# --- 1. the CUDA runtime -------------------------------------------------------------


class _CpuStream:
    """Stands in for torch.cuda.Stream / Event: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return _CpuStream()

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, stream=None):
        pass

    def __eq__(self, other):
        return isinstance(other, _CpuStream)

    def __hash__(self):
        return 0


def _redirect_cuda_runtime():
    cuda = torch.cuda
    # `device=torch.cuda.current_device()` allocates every TP/PP communication buffer
    # (tensor_parallel/mappings.py, layers.py, pipeline_parallel/p2p_communication.py,
    # the rotary embedding, the global memory buffer in utils.py).
    cuda.current_device = lambda: _CPU
    # dist_checkpointing (strategies/*, tensor_aware_state_dict.py), parallel_state and
    # p2p_communication synchronize the device before host-side work.
    cuda.synchronize = lambda device=None: None
    # The MoE all-to-all dispatcher copies split sizes on a side stream
    # (transformer/moe/token_dispatcher.py); DDP makes a communication stream when
    # overlapping grad reduction (distributed/distributed_data_parallel.py).
    cuda.Stream = _CpuStream
    cuda.Event = _CpuStream
    cuda.current_stream = lambda device=None: _CpuStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.set_device = lambda device: None
    # memory bookkeeping in utils.py / timers: nothing is allocated on a device.
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.empty_cache = lambda: None


# --- 2. tensors created for "cuda" ---------------------------------------------------


def _to_cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):  # a CUDA ordinal
        return _CPU
    if isinstance(device, str):
        return _CPU if device.startswith("cuda") else device
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _redirect_device_kwarg(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs CUDA (utils.py packed-seq params)
        return factory(*args, **kwargs)

    return wrapper


class _TorchOnCpu(types.ModuleType):
    """`torch` as seen by one Megatron module: its tensor factories put "cuda" tensors
    on the CPU; every other attribute is torch's own."""

    def __init__(self):
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _redirect_device_kwarg(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


_FACTORIES = ("tensor", "zeros", "ones", "empty", "empty_like", "randn")
# Megatron modules that create tensors with a literal device="cuda". Each gets the
# proxy above as its `torch` global, so no other library sees a changed torch.
_MODULES_WITH_CUDA_LITERALS = (
    "megatron.core.optimizer.optimizer",  # found_inf, _scale_one, _dummy_overflow_buf
    "megatron.core.optimizer.clip_grads",  # grad norm and clip buffers
    "megatron.core.optimizer.grad_scaler",  # loss scale tensors
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens
    "megatron.core.transformer.utils",  # default causal attention masks
    "megatron.core.transformer.moe.moe_utils",  # router logging trackers
    "megatron.core.rerun_state_machine",  # validation result all-reduce
    "megatron.core.distributed.param_and_grad_buffer",  # NCCL warm-up tensor
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # save plan verification
    "megatron.core.dist_checkpointing.exchange_utils",  # shard exchange buffers
    "megatron.core.tensor_parallel.data",  # broadcast_data sizes
    "megatron.core.utils",  # norm all-reduce, param hashing
)


def _redirect_cuda_tensor_creation():
    proxy = _TorchOnCpu()
    for module_name in _MODULES_WITH_CUDA_LITERALS:
        importlib.import_module(module_name).torch = proxy

    # `.cuda()` on tensors and modules: optimizer state loading (optimizer/optimizer.py),
    # tied-embedding set-up (models/common/language_module/language_module.py),
    # param hashing (utils.py), dist_checkpointing exchange_utils.py. On a build
    # without CUDA these would raise, so no other code can rely on them.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self


# --- 3. Megatron functions that need a CPU form --------------------------------------


def _patch_megatron():
    _patch_rng()
    _patch_optimizer_type_checks()
    _patch_all_to_all_split_sizes()
    _patch_moe_router_gemm()
    _patch_torch_norm_for_sequence_parallel()
    _patch_uneven_all_gather()


def _patch_rng():
    """The CUDA RNG tracker forks "the device generator"; on CPU that is the CPU one.

    tensor_parallel/random.py reads and writes the CUDA generator in
    `_get_cuda_rng_state`, `_set_cuda_rng_state`, `CudaRNGStatesTracker.add` and
    `model_parallel_cuda_manual_seed`. Pointing them at the CPU default generator keeps
    their meaning: inside `fork()`, CPU random ops (dropout, GPU-style init) draw from
    the tracked stream of this TP/EP rank.
    """
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    model_parallel_seed = mrandom.model_parallel_cuda_manual_seed

    @functools.wraps(model_parallel_seed)
    def model_parallel_manual_seed(seed, *args, **kwargs):
        # Megatron seeds the default CUDA stream with `seed` (its data-parallel seed).
        torch.manual_seed(seed)
        cuda_manual_seed = torch.cuda.manual_seed
        torch.cuda.manual_seed = lambda s: None  # already done on the CPU generator above
        try:
            return model_parallel_seed(seed, *args, **kwargs)
        finally:
            torch.cuda.manual_seed = cuda_manual_seed

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add
    mrandom.model_parallel_cuda_manual_seed = model_parallel_manual_seed
    import megatron.core.tensor_parallel as tp_pkg

    tp_pkg.model_parallel_cuda_manual_seed = model_parallel_manual_seed

    class _DropCpuRngWarning(logging.Filter):
        # fork() warns when "the CPU RNG" moved inside a device-RNG context; on CPU the
        # device RNG is the CPU RNG, so moving it there is the intended behaviour.
        def filter(self, record):
            return "CPU RNG state changed" not in record.getMessage()

    logging.getLogger(mrandom.__name__).addFilter(_DropCpuRngWarning())


@contextlib.contextmanager
def _report_cuda_tensor_types():
    """Inside, a CPU tensor's `.type()` names its CUDA counterpart."""
    tensor_type = torch.Tensor.type

    def type_(self, *args, **kwargs):
        if args or kwargs:
            return tensor_type(self, *args, **kwargs)
        name = tensor_type(self)
        return name.replace("torch.", "torch.cuda.", 1) if not self.is_cuda else name

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = tensor_type


def _patch_optimizer_type_checks():
    """The optimizers check `param.type() == 'torch.cuda.FloatTensor'` (and the half
    types) to sort parameters into fp32 / fp16 groups: optimizer/optimizer.py
    (Float16OptimizerWithFloat16Params.__init__), optimizer/distrib_optimizer.py
    (_build_model_and_main_param_groups) and optimizer/clip_grads.py
    (clip_grad_by_total_norm_fp32). During those calls only, CPU tensors answer with the
    CUDA type name, which sorts them the same way."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    def scoped(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with _report_cuda_tensor_types():
                return fn(*args, **kwargs)

        return wrapper

    f16 = optimizer.Float16OptimizerWithFloat16Params
    f16.__init__ = scoped(f16.__init__)
    dist = distrib_optimizer.DistributedOptimizer
    dist._build_model_and_main_param_groups = staticmethod(
        scoped(dist._build_model_and_main_param_groups)
    )
    clip_grads.clip_grad_by_total_norm_fp32 = scoped(clip_grads.clip_grad_by_total_norm_fp32)
    optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32


def _patch_all_to_all_split_sizes():
    """The MoE all-to-all dispatcher moves split sizes to host memory only when they are
    CUDA tensors (transformer/moe/moe_utils.py maybe_move_tensor_to_cpu), so on CPU they
    reach `all_to_all_single` as tensors, which gloo rejects: make them lists
    (tensor_parallel/mappings.py _AllToAll.forward)."""
    from megatron.core.tensor_parallel import mappings

    forward = mappings._AllToAll.forward

    def as_list(splits):
        return splits.tolist() if hasattr(splits, "tolist") else splits

    def forward_with_list_splits(ctx, group, input, output_split_sizes, input_split_sizes):
        return forward(ctx, group, input, as_list(output_split_sizes), as_list(input_split_sizes))

    mappings._AllToAll.forward = staticmethod(forward_with_list_splits)


def _patch_moe_router_gemm():
    """transformer/moe/moe_utils.py tests `te_general_gemm is not None` in the router
    but only defines the name when Transformer Engine imports (a NameError without it)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_torch_norm_for_sequence_parallel():
    """The local spec's norms are `WrappedTorchNorm` (transformer/torch_norm.py), which
    asserts `not config.sequence_parallel`: Megatron's torch fallback never marks its
    weights for sequence parallelism. With sequence parallelism each TP rank normalises
    its own slice of the sequence, so a norm weight's gradient is a partial sum that
    finalize_model_grads (distributed/finalize_model_grads.py,
    _allreduce_non_tensor_model_parallel_grads) adds up over TP for every parameter
    tagged `sequence_parallel`, the tag Transformer Engine's norms set
    (extensions/transformer_engine.py, TENorm). Here the same torch norm is built (the
    computation is per token, unchanged by where the sequence is cut) and tagged as TE
    tags it. This covers the layers' input/pre-MLP norms, the q/k norms and the final
    norm (transformer_block.py builds it from the same class); the MoE router tags its
    own weight (transformer/moe/router.py)."""
    import copy

    from megatron.core.transformer import torch_norm

    build = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return build(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False  # only its assertion reads it
        norm = build(cls, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


def _patch_uneven_all_gather():
    """gloo's all_gather needs every rank's tensor to have one shape. Megatron gathers
    pieces of different lengths along the sequence with a list all_gather
    (tensor_parallel/mappings.py, _gather_along_first_dim with output_split_sizes): the
    MoE all-to-all dispatcher does so over the expert-TP group when etp > 1 and ep > 1
    (transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher.dispatch_postprocess,
    and the backward of its reduce-scatter in combine_preprocess), as each TP rank routes
    a different number of tokens to this rank's experts. NCCL takes uneven pieces; gloo
    raises "invalid tensor size". Here every piece is padded to the longest, gathered,
    and cut back to its own length: the same tensor. Even gathers and the reduce-scatters
    (gloo has those, uneven too) go to Megatron's own code."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather = mappings._gather_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or len(set(output_split_sizes)) == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, output_split_sizes)], dim=0)

    mappings._gather_along_first_dim = gather_along_first_dim
