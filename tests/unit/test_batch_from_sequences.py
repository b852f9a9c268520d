"""`TrainBatch.from_sequences` (built with numpy) against a row-by-row construction written
here: the same tensors and dtypes from lists and from numpy arrays, the same errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_agent.training.batch import TrainBatch


def reference(prompts, responses, pad_id, logprobs):
    """Row by row: ids left-aligned and padded; a response token t+1's mask and logprob at
    target position t, i.e. from position len(prompt) - 1 on."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width - 1, dtype=torch.float32)
    rollout = torch.zeros(len(prompts), width - 1, dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        for j, t in enumerate(list(p) + list(r)):
            tokens[i, j] = int(t)
        for k in range(len(r)):
            mask[i, len(p) - 1 + k] = 1.0
            rollout[i, len(p) - 1 + k] = float(np.float32(logprobs[i][k]))
    return tokens, mask, rollout


def random_sequences(rng: np.random.Generator, n: int):
    prompts = [rng.integers(0, 150_000, rng.integers(1, 40)).tolist() for _ in range(n)]
    responses = [rng.integers(0, 150_000, rng.integers(0, 20)).tolist() for _ in range(n)]
    logprobs = [(-rng.exponential(2.0, len(r))).tolist() for r in responses]  # doubles: rounded to float32 once
    return prompts, responses, logprobs


@pytest.mark.parametrize("form", ["lists", "arrays", "mixed"])
def test_from_sequences_equals_a_row_by_row_construction(form):
    rng = np.random.default_rng(0)
    prompts, responses, logprobs = random_sequences(rng, 9)
    responses[3] = []  # a sequence without a response
    logprobs[3] = []
    prompts[5] = prompts[5][:1]  # a one-token prompt
    expected = reference(prompts, responses, 7, logprobs)
    if form == "arrays":  # what the trainer's batches are made of: int32 ids, float32 logprobs
        prompts = [np.asarray(p, np.int32) for p in prompts]
        responses = [np.asarray(r, np.int32) for r in responses]
        logprobs = [np.asarray(lp, np.float32) for lp in logprobs]
    elif form == "mixed":
        prompts = [np.asarray(p, np.int64) if i % 2 else p for i, p in enumerate(prompts)]
        logprobs = [np.asarray(lp, np.float64) if i % 3 else lp for i, lp in enumerate(logprobs)]
    batch = TrainBatch.from_sequences(prompts, responses, pad_id=7, rollout_logprobs=logprobs,
                                      advantages=[0.5] * 9, temperature=0.7)
    for got, want in zip((batch.tokens, batch.response_mask, batch.rollout_logprobs), expected):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert batch.lengths.dtype == torch.int64
    assert batch.lengths.tolist() == [len(p) + len(r) for p, r in zip(prompts, responses)]
    assert batch.advantages.dtype == torch.float32 and batch.temperature == 0.7
    assert TrainBatch.from_sequences(prompts, responses).rollout_logprobs is None


def test_the_first_bad_sequence_is_named():
    with pytest.raises(ValueError, match="sequence 1 has an empty prompt"):
        TrainBatch.from_sequences([[1], [], [2]], [[2], [3], [4]], rollout_logprobs=[[-1.0], [-1.0], []])
    with pytest.raises(ValueError, match=r"sequence 0: 2 rollout logprobs for 1 tokens"):
        TrainBatch.from_sequences([[1], []], [[2], [3]], rollout_logprobs=[[-1.0, -2.0], [-1.0]])
    with pytest.raises(ValueError, match="sequence 1 has an empty prompt"):
        TrainBatch.from_sequences([[1], np.zeros(0, np.int32)], [[2], [3]])
    with pytest.raises(ValueError, match="3 prompts, 2 responses"):
        TrainBatch.from_sequences([[1], [2], [3]], [[2], [3]])
