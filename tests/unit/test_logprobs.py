"""training/logprobs.py at TP=1 against the functions it replaced (tests/logprobs_reference.py):
the same log-probs and entropies, the same gradients, in chunks smaller than a row block,
and the bytes autograd keeps: the bf16 logits where the reference kept three fp32 copies.
TP=2 is checked in tests/multirank/test_activation_memory.py's job."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_agent.training import logprobs
from tests import logprobs_reference as reference
from tests.saved_tensors import SavedTensors, total

TEMPERATURES = (1.0, 0.7)


@pytest.fixture(scope="module")
def one_rank():
    """Megatron's parallel state on one gloo rank (the reference's cross entropy asks for it)."""
    from megatron_agent.platform import (
        ParallelConfig,
        destroy_model_parallel,
        free_port,
        initialize_model_parallel,
    )

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    initialize_model_parallel(ParallelConfig(), 1)
    yield
    destroy_model_parallel()
    dist.destroy_process_group()


def _logits(dtype=torch.float32, shape=(3, 21, 257), seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape, generator=g) * 4
    logits[..., -5:] = -1.0e4  # padded vocabulary rows (models/builder.py PADDED_VOCAB_LOGIT)
    targets = torch.randint(0, shape[-1] - 5, shape[:-1], generator=g)
    return logits.to(dtype), targets


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_values_and_gradients_equal_the_reference(one_rank, monkeypatch, temperature):
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 1000)  # 3 rows a chunk: 7 chunks a sequence
    full, targets = _logits()
    # the loss sees the model's output cut back to the micro-batch's columns: a strided view
    cases = {"contiguous": (full, targets), "column slice": (full[:, :17], targets[:, :17]),
             "one token": (full[0, 0], targets[0, 0])}
    g = torch.Generator().manual_seed(1)
    for name, (logits, tgt) in cases.items():
        w_lp, w_h = torch.randn(tgt.shape, generator=g), torch.randn(tgt.shape, generator=g)
        results = []
        for fns in ((reference.token_logprobs, reference.token_entropy),
                    (logprobs.token_logprobs, logprobs.token_entropy),
                    (None, None)):
            x = logits.detach().clone().requires_grad_()
            if fns[0] is None:
                lp, h = logprobs.token_logprobs_and_entropy(x, tgt, temperature)
            else:
                lp, h = fns[0](x, tgt, temperature), fns[1](x, temperature)
            ((lp * w_lp).sum() + (h * w_h).sum()).backward()
            results.append((lp.detach(), h.detach(), x.grad))
        (ref_lp, ref_h, ref_grad), *ours = results
        for lp, h, grad in ours:
            assert torch.equal(lp, ref_lp) and torch.equal(h, ref_h), name  # the same fp32 operations
            torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6, msg=name)  # summed in another order
        assert ref_grad.abs().max() > 0.01, name  # not vacuous


def test_only_the_logprob_or_only_the_entropy_gets_a_gradient(one_rank):
    logits, targets = _logits(shape=(2, 9, 64))
    for make, used in ((lambda x: logprobs.token_logprobs(x, targets, 0.9), reference.token_logprobs),
                       (lambda x: logprobs.token_entropy(x, 0.9), reference.token_entropy)):
        x, y = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        make(x).sum().backward()
        (used(y, targets, 0.9) if used is reference.token_logprobs else used(y, 0.9)).sum().backward()
        torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-6)


def test_without_grad_nothing_is_kept(one_rank):
    logits, targets = _logits(torch.bfloat16)
    with torch.no_grad(), SavedTensors() as saved:
        lp = logprobs.token_logprobs(logits, targets)
    assert lp.dtype == torch.float32 and saved.bytes() == {}


def test_kept_bytes_fall_from_twelve_to_two_per_logit(one_rank):
    """bf16 logits [3, 21, 257] (what the GPU's output layer gives): the reference keeps the
    cross entropy's fp32 softmax and the entropy's fp32 exp and shifted logits, 12 bytes
    per value; the chunked function keeps the bf16 logits (2) and a few fp32 per token."""
    logits, targets = _logits(torch.bfloat16)
    values, tokens = logits.numel(), targets.numel()
    kept = {}
    for name, (lp_fn, h_fn) in {"reference": (reference.token_logprobs, reference.token_entropy),
                                "chunked": (logprobs.token_logprobs, logprobs.token_entropy)}.items():
        x = logits.clone().requires_grad_()
        with SavedTensors() as saved:
            lp, h = lp_fn(x, targets), h_fn(x)
        by_dtype = saved.bytes()["other"]
        kept[name] = (by_dtype, total({"": by_dtype}))
        assert lp.requires_grad and h.requires_grad
    ref, ours = kept["reference"], kept["chunked"]
    assert ref[0][torch.float32] == pytest.approx(12 * values, abs=64 * tokens)
    assert ours[0].get(torch.bfloat16, 0) == 2 * values and ours[0][torch.float32] <= 2 * 3 * 4 * tokens
    assert ours[1] <= 2 * values + 64 * tokens and ref[1] >= 12 * values
