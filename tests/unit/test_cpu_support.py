"""The CPU support layer: each redirect does what the CUDA call would have done, on CPU."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_agent.platform.cpu_support import enable_cpu_support

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is off where CUDA exists")


@pytest.fixture(scope="module", autouse=True)
def cpu_support():
    assert enable_cpu_support() is True
    assert enable_cpu_support() is True  # idempotent


def test_megatron_cuda_allocations_land_on_cpu():
    from megatron.core.optimizer import optimizer
    from megatron.core.transformer import utils

    assert optimizer.torch.zeros(3, device="cuda").device.type == "cpu"
    assert optimizer.torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
    assert utils.get_default_causal_mask(3).device.type == "cpu"
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert optimizer.torch.zeros(2, dtype=torch.int64).dtype == torch.int64
    assert optimizer.torch.zeros(2, device="meta").device.type == "meta"


def test_torch_itself_is_untouched():
    # Only Megatron's modules see the redirecting factories: other libraries (here
    # transformers building a model under a meta-device context) get torch's own.
    for name in ("tensor", "zeros", "ones", "empty", "empty_like", "randn"):
        assert isinstance(getattr(torch, name), types.BuiltinFunctionType), name
    with pytest.raises((RuntimeError, AssertionError), match="CUDA"):
        torch.zeros(1, device="cuda")


def test_transformers_rope_survives(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    inv_freq = model.model.rotary_emb.inv_freq
    head_dim = model.config.head_dim
    expected = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    assert torch.allclose(inv_freq, expected)


def test_streams_and_sync_are_no_ops():
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
    stream.record_event().synchronize()
    torch.cuda.synchronize()


def test_rng_tracker_forks_distinct_streams_and_restores():
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, initialize_rng_tracker

    initialize_rng_tracker(force_reset=True)
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("a", 1)
    tracker.add("b", 2)
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    with tracker.fork("a"):
        a1 = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside)  # the default stream is untouched
    with tracker.fork("b"):
        b1 = torch.rand(4)
    with tracker.fork("a"):
        a2 = torch.rand(4)
    torch.manual_seed(1)
    expected_a = torch.rand(8)
    assert torch.equal(torch.cat([a1, a2]), expected_a)  # "a" continues where it left off
    torch.manual_seed(2)
    assert torch.equal(b1, torch.rand(4))
    assert tensor_parallel.model_parallel_cuda_manual_seed is not None


def test_optimizer_type_check_is_scoped():
    from megatron_agent.platform.cpu_support import _report_cuda_tensor_types

    x = torch.zeros(1)
    with _report_cuda_tensor_types():
        assert x.type() == "torch.cuda.FloatTensor"
        assert x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
    assert x.type() == "torch.FloatTensor"


def test_all_to_all_split_sizes_become_lists():
    from megatron.core.tensor_parallel import mappings

    seen = {}

    class FakeGroup:
        def size(self):
            return 1

    class Ctx:
        pass

    ctx = Ctx()
    out = mappings._AllToAll.forward(ctx, FakeGroup(), torch.ones(3), torch.tensor([1, 2]), torch.tensor([2, 1]))
    seen["out"] = out
    assert ctx.output_split_sizes == [1, 2] and ctx.input_split_sizes == [2, 1]
    assert torch.equal(seen["out"], torch.ones(3))


def test_torch_norms_take_sequence_parallelism_and_tag_their_weights():
    # Megatron's WrappedTorchNorm asserts `not config.sequence_parallel`; on CPU it builds
    # the same torch norm and tags its weight, so finalize_model_grads sums it over TP.
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def config(sequence_parallel):
        return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                                 tensor_model_parallel_size=2 if sequence_parallel else 1,
                                 sequence_parallel=sequence_parallel, use_cpu_initialization=True)

    sp = config(True)
    norm = WrappedTorchNorm(config=sp, hidden_size=8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    assert norm.weight.sequence_parallel is True
    assert sp.sequence_parallel is True  # the model's config is left as it was
    plain = WrappedTorchNorm(config=config(False), hidden_size=8, eps=1e-6)
    assert not getattr(plain.weight, "sequence_parallel", False)
    x = torch.randn(3, 8)
    assert torch.equal(norm(x), plain(x))  # per token: where the sequence is cut changes nothing


def test_megatron_imports_without_torch_compile_and_its_fused_kernels_run_eagerly():
    """In a fresh process: the CPU layer imports Megatron without dynamo/inductor (its
    `torch.compile` wrappers become the identity), torch's own `torch.compile` is back
    afterwards, and a wrapped kernel (SwiGLU) computes silu(a) * b."""
    import subprocess
    import sys

    code = """
import sys, torch
import torch.nn.functional as F
from megatron_agent.platform.cpu_support import enable_cpu_support
compile_ = torch.compile
enable_cpu_support()
from megatron.core.fusions.fused_bias_swiglu import swiglu
y = torch.randn(4, 6)
a, b = torch.chunk(y, 2, dim=-1)
assert torch.equal(swiglu(y), F.silu(a) * b)
assert torch.compile is compile_
assert "torch._dynamo" not in sys.modules, "Megatron's import pulled in dynamo"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
