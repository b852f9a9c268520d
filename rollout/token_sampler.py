"""The embedded engine's next-token choice for a whole batch at once.

Each request has its own seed, and the uniform number that picks its t-th token is a hash
of (seed, t): a request's tokens depend on its seed and its logits only, never on which
requests share its batch or in what order they arrived. Sampling is by inverse CDF over
the temperature-scaled, top-k / top-p truncated distribution; the logprob returned is
the token's under the temperature-scaled distribution before truncation (what SGLang
reports and what importance ratios are taken against).
"""

from __future__ import annotations

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def token_uniforms(seeds: list[int], positions: list[int]) -> torch.Tensor:
    """One uniform in [0, 1) per (seed, position), float64."""
    s = np.asarray(seeds, dtype=np.uint64)
    p = np.asarray(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = _mix64(s ^ _mix64((p + np.uint64(1)) * _GOLDEN))
    return torch.from_numpy((x >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32; per row: temperature (<= 0: greedy), top_k (<= 0: all), top_p,
    and the uniform that picks the token. Returns (tokens [B] long, logprobs [B] fp32)."""
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    probs = logp.exp()
    limited = (top_k > 0) & (top_k < vocab)
    if bool(limited.any()):
        k = torch.where(limited, top_k, torch.full_like(top_k, vocab))
        kth = probs.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if bool((top_p < 1.0).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above
        sorted_p = torch.where(before < top_p[:, None] * sorted_p.sum(-1, keepdim=True), sorted_p,
                               torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    cdf = probs.double().cumsum(-1)
    sampled = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(max=vocab - 1)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
