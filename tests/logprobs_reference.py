"""The log-prob and entropy functions training/logprobs.py had before it worked in chunks
(Megatron's vocab_parallel_cross_entropy on an fp32 copy of the logits; the entropy through
autograd): the reference its values and gradients are held to, and whose saved bytes it cuts."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(logits.float() / temperature, targets)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    z = logits.float() / temperature
    top = z.detach().max(dim=-1, keepdim=True).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    z = z - top
    e = z.exp()
    sum_e = reduce_from_tensor_model_parallel_region(e.sum(dim=-1))
    sum_ez = reduce_from_tensor_model_parallel_region((e * z).sum(dim=-1))
    return sum_e.log() - sum_ez / sum_e
