import numpy as np
import pytest
import torch

from rollout.token_sampler import sample_tokens, token_uniforms


def rows(n, temperature=1.0, top_k=-1, top_p=1.0):
    return (torch.full((n,), float(temperature)), torch.full((n,), top_k, dtype=torch.long),
            torch.full((n,), float(top_p)))


def test_uniforms_depend_on_seed_and_position_only_and_are_uniform():
    u = token_uniforms(list(range(20000)), [3] * 20000)
    assert torch.equal(u, token_uniforms(list(range(20000)), [3] * 20000))
    assert not torch.equal(u, token_uniforms(list(range(20000)), [4] * 20000))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # Kolmogorov-Smirnov distance to U(0, 1); 1.63/sqrt(n) is the 1% critical value
    ks = float((torch.sort(u).values - torch.arange(1, 20001, dtype=torch.float64) / 20000).abs().max())
    assert ks < 1.63 / np.sqrt(20000)
    assert float(token_uniforms([2**62 - 1], [0])[0]) == float(token_uniforms([2**62 - 1], [0])[0])


def test_frequencies_follow_the_temperature_scaled_softmax():
    n = 40000
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0]).repeat(n, 1)
    tokens, logprobs = sample_tokens(logits, *rows(n, temperature=0.7), token_uniforms(range(n), [0] * n))
    expected = torch.softmax(logits[0] / 0.7, -1)
    frequency = torch.bincount(tokens, minlength=4).double() / n
    assert torch.allclose(frequency, expected.double(), atol=0.01)
    torch.testing.assert_close(logprobs, torch.log_softmax(logits / 0.7, -1).gather(1, tokens[:, None])[:, 0])


def test_top_k_and_top_p_truncate_but_the_logprob_is_taken_before():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]]).repeat(200, 1)
    u = token_uniforms(range(200), [0] * 200)
    assert set(sample_tokens(logits, *rows(200, top_k=1), u)[0].tolist()) == {1}
    tokens, logprobs = sample_tokens(logits, *rows(200, top_p=0.5), u)
    assert set(tokens.tolist()) == {1, 3}  # together they hold more than half the mass
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])


def test_greedy_rows_take_the_argmax_and_mixed_rows_keep_their_own_settings():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    temperature = torch.tensor([0.0, 1.0, 0.0])
    tokens, logprobs = sample_tokens(logits, temperature, torch.tensor([-1, 1, -1]), torch.ones(3),
                                     torch.tensor([0.999, 0.999, 0.0], dtype=torch.float64))
    assert tokens.tolist() == [1, 0, 2]
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]))


def test_a_rows_token_does_not_depend_on_the_rest_of_its_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g)
    seeds, positions = list(range(100, 164)), [2] * 64
    together = sample_tokens(logits, *rows(64), token_uniforms(seeds, positions))[0]
    alone = [int(sample_tokens(logits[i:i + 1], *rows(1), token_uniforms(seeds[i:i + 1], [2]))[0][0])
             for i in range(64)]
    assert together.tolist() == alone
    order = torch.randperm(64, generator=g)
    shuffled = sample_tokens(logits[order], *rows(64), token_uniforms([seeds[i] for i in order], positions))[0]
    assert shuffled.tolist() == together[order].tolist()
