"""Per-token logprobs and entropy from vocabulary-parallel logits (each TP rank holds a
slice of the vocabulary; nothing gathers the full logits).

Both go through one autograd function that never holds an fp32 copy of the whole logits:
it works through the tokens a chunk at a time (`CHUNK_ELEMENTS` fp32 values), keeps the
logits it was given (bf16 on GPU) and three fp32 numbers per token for backward, and
recomputes each chunk's softmax there. Megatron's vocab_parallel_cross_entropy keeps an
fp32 softmax of every logit, and the entropy's autograd graph two more fp32 tensors of
that size: 12 bytes per (token x vocabulary/TP) value where this keeps the 2 of the bf16
logits (tests/unit/test_logprobs.py measures both).
"""

from __future__ import annotations

import itertools

import torch

from megatron_agent.platform.collectives import all_reduce

# fp32 values of one chunk of logits (64 MiB); a chunk is this many values' worth of rows.
CHUNK_ELEMENTS = 2**24


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature); logits [..., V/tp], targets [...]."""
    return _LogprobsAndEntropy.apply(logits, targets, temperature)[0]


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the whole (TP-split) vocabulary."""
    return _LogprobsAndEntropy.apply(logits, None, temperature)[1]


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor,
                               temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Both at once: one pass over the logits forward and one backward (instead of two
    each), and one gradient buffer for the logits instead of two summed."""
    return _LogprobsAndEntropy.apply(logits, targets, temperature)


def _tensor_parallel() -> tuple[object | None, int, int]:
    """(group, size, rank) of the tensor-parallel group; (None, 1, 0) without one."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return None, 1, 0
    return (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank())


def _row_chunks(shape: torch.Size) -> list[tuple]:
    """Index tuples that cut a [..., n, V] tensor into blocks of whole rows (the last dim
    whole) of about CHUNK_ELEMENTS values, without copying a non-contiguous input."""
    *outer, n, vocab = shape
    rows = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    starts = range(0, n, rows)
    return [(*lead, slice(s, s + rows)) for lead in itertools.product(*(range(k) for k in outer)) for s in starts]


class _LogprobsAndEntropy(torch.autograd.Function):
    """(log p(target), entropy) per token of softmax(logits / T), the softmax over every TP
    rank's vocabulary slice. The same arithmetic as Megatron's vocab_parallel_cross_entropy
    (max-shifted exp, sums all-reduced over TP) and as the entropy H = log Z - E_p[z - max];
    backward needs no communication: each rank's slice gets its gradient from the global
    per-token sums."""

    @staticmethod
    def forward(ctx, logits, targets, temperature):
        group, size, rank = _tensor_parallel()
        squeeze = logits.dim() == 1
        if squeeze:
            logits = logits.unsqueeze(0)
            targets = None if targets is None else targets.unsqueeze(0)
        vocab = logits.shape[-1]
        first = rank * vocab  # this rank's slice of the vocabulary: [first, first + vocab)
        chunks = _row_chunks(logits.shape)
        lead = logits.shape[:-1]
        top = torch.empty(lead, dtype=torch.float32, device=logits.device)
        for c in chunks:
            top[c] = (logits[c].float() / temperature).max(dim=-1).values
        if size > 1:
            all_reduce(top, group, op=torch.distributed.ReduceOp.MAX)
        # per token: sum exp(z - max), sum exp(z - max) * (z - max), (z - max) at the target
        sums = torch.zeros((3, *lead), dtype=torch.float32, device=logits.device)
        if targets is not None:
            local = targets - first
            owned = (local >= 0) & (local < vocab)
            local = torch.where(owned, local, 0)
        for c in chunks:
            z = logits[c].float() / temperature
            z -= top[c].unsqueeze(-1)
            if targets is not None:
                picked = z.gather(-1, local[c].unsqueeze(-1)).squeeze(-1)
                sums[2][c] = torch.where(owned[c], picked, 0.0)
            e = z.exp()
            sums[0][c] = e.sum(dim=-1)
            sums[1][c] = (e * z).sum(dim=-1)
        if size > 1:
            all_reduce(sums, group)
        sum_exp, sum_exp_z, target_z = sums
        log_z = torch.log(sum_exp)
        logprob = -(log_z - target_z) if targets is not None else torch.zeros_like(log_z)
        mean_z = sum_exp_z / sum_exp
        entropy = log_z - mean_z
        ctx.save_for_backward(logits, None if targets is None else local, None if targets is None else owned,
                              top, sum_exp.clone(), mean_z)  # a copy: not the whole `sums`
        ctx.temperature, ctx.squeeze = temperature, squeeze
        ctx.set_materialize_grads(False)
        if squeeze:
            return logprob.squeeze(0), entropy.squeeze(0)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, local, owned, top, sum_exp, mean_z = ctx.saved_tensors
        temperature = ctx.temperature
        if ctx.squeeze:
            grad_logprob = None if grad_logprob is None else grad_logprob.unsqueeze(0)
            grad_entropy = None if grad_entropy is None else grad_entropy.unsqueeze(0)
        if local is None:
            grad_logprob = None
        if grad_logprob is None and grad_entropy is None:
            return None, None, None
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for c in _row_chunks(logits.shape):  # three fp32 chunks at a time: z, p, g
            z = logits[c].float() / temperature
            z -= top[c].unsqueeze(-1)
            p = z.exp()
            p /= sum_exp[c].unsqueeze(-1)
            g = torch.zeros_like(p)
            if grad_logprob is not None:
                # d(-cross entropy)/dz = onehot(target) - p, the target's 1 on its owner only
                g -= p
                g.scatter_add_(-1, local[c].unsqueeze(-1), owned[c].unsqueeze(-1).to(g.dtype))
                g *= grad_logprob[c].unsqueeze(-1)
            if grad_entropy is not None:
                # dH/dz_v = p_v * (E_p[z] - z_v)
                g += z.neg_().add_(mean_z[c].unsqueeze(-1)).mul_(p).mul_(grad_entropy[c].unsqueeze(-1))
            grad[c] = g.div_(temperature)
        return (grad.squeeze(0) if ctx.squeeze else grad), None, None
