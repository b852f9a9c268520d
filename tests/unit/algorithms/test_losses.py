"""Policy, KL, entropy and value losses: hand-computed values, metrics, and gradients checked
against autograd of a direct per-token loop formulation (float64)."""

import math

import pytest
import torch

from megatron_agent.algorithms import (
    AGG_MODES,
    AlgorithmConfig,
    actor_loss,
    aggregate_loss,
    entropy_from_logits,
    entropy_loss,
    gspo_loss,
    kl_loss,
    kl_penalty,
    ppo_clip_loss,
    rollout_correction_weights,
    value_loss,
)

F64 = torch.float64

# Two sequences, 4 positions. Ratios r = exp(logp - logp_old):
#   seq 0, A = +1, mask [1 1 1 0]: r = 1.5, 0.5, 1.1, (9 masked)
#   seq 1, A = -1, mask [1 1 1 1]: r = 1.5, 0.5, 4.0, 1.0
RATIOS = torch.tensor([[1.5, 0.5, 1.1, 9.0], [1.5, 0.5, 4.0, 1.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=F64)
ADV = torch.tensor([1.0, -1.0], dtype=F64)


def _ratio_inputs():
    old = torch.full_like(RATIOS, -1.0)
    return old + RATIOS.log(), old


def test_ppo_clip_higher_and_dual_clip_by_hand():
    # clip_low .2, clip_high .28, dual c 3. Per token max(-A r, -A clip(r, .8, 1.28)):
    #   seq 0 (A=+1): r 1.5 -> max(-1.5, -1.28) = -1.28 (clipped high); r .5 -> max(-.5, -.8) = -.5; r 1.1 -> -1.1
    #   seq 1 (A=-1): r 1.5 -> 1.5; r .5 -> max(.5, .8) = .8 (clipped low); r 4 -> max(4, 1.28) = 4, dual min(4, 3) = 3;
    #                 r 1 -> 1
    # seq sums: -2.88 and 6.3; tokens 3 and 4.
    logp, old = _ratio_inputs()
    expected = {
        "token-mean": (-2.88 + 6.3) / 7,
        "seq-mean-token-sum": (-2.88 + 6.3) / 2,
        "seq-mean-token-mean": (-2.88 / 3 + 6.3 / 4) / 2,
        "seq-mean-token-sum-norm": (-2.88 / 4 + 6.3 / 4) / 2,
    }
    for mode, value in expected.items():
        loss, m = ppo_clip_loss(
            logp, old, ADV, MASK, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, agg_mode=mode
        )
        assert loss.item() == pytest.approx(value, abs=1e-12), mode
    assert m["clipfrac_high"].item() == pytest.approx(1 / 7)  # seq 0, r 1.5
    assert m["clipfrac_low"].item() == pytest.approx(1 / 7)  # seq 1, r .5
    assert m["clipfrac_dual"].item() == pytest.approx(1 / 7)  # seq 1, r 4
    assert m["ratio_max"].item() == pytest.approx(4.0)  # the masked 9 does not count
    assert m["ratio_min"].item() == pytest.approx(0.5)
    assert m["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1 + 1.5 + 0.5 + 4 + 1) / 7)
    # approx KL (k3 of the ratio): mean of r - 1 - log r; ppo_kl: mean of -log r
    rs = [1.5, 0.5, 1.1, 1.5, 0.5, 4.0, 1.0]
    assert m["approx_kl"].item() == pytest.approx(sum(r - 1 - math.log(r) for r in rs) / 7)
    assert m["ppo_kl"].item() == pytest.approx(sum(-math.log(r) for r in rs) / 7)
    # Without dual clip the r = 4 token costs 4 instead of 3.
    loss, _ = ppo_clip_loss(logp, old, ADV, MASK, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx((-2.88 + 7.3) / 7)
    # Symmetric clip .2: seq 0's r 1.5 -> -1.2 instead of -1.28 (seq 1 unchanged: 6.3).
    loss, _ = ppo_clip_loss(logp, old, ADV, MASK, clip_low=0.2, clip_high=0.2, dual_clip_c=3.0)
    assert loss.item() == pytest.approx((-2.8 + 6.3) / 7)


def test_gspo_by_hand():
    # One sequence, two tokens, logp - old = [.1, .3] -> s = exp(.2) = 1.2214; clip (3e-4, 4e-4).
    old = torch.tensor([[-1.0, -2.0, -5.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    logp = (old + torch.tensor([[0.1, 0.3, 7.0]], dtype=F64)).requires_grad_()
    # A = +1: max(-s, -1.0004) = -1.0004, flat (clipped) -> zero gradient.
    loss, m = gspo_loss(logp, old, torch.tensor([1.0], dtype=F64), mask)
    assert loss.item() == pytest.approx(-1.0004)
    assert m["clipfrac_high"].item() == 1.0
    loss.backward()
    assert torch.count_nonzero(logp.grad) == 0
    # A = -1: max(s, 1.0004) = s; d s / d logp_t = s / 2 on each of the two tokens.
    logp.grad = None
    loss, m = gspo_loss(logp, old, torch.tensor([-1.0], dtype=F64), mask)
    s = math.exp(0.2)
    assert loss.item() == pytest.approx(s)
    assert m["ratio_mean"].item() == pytest.approx(s)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[s / 2, s / 2, 0.0]], dtype=F64))


def test_kl_penalties_by_hand():
    logp = torch.tensor([-1.0, -2.0, -40.0], dtype=F64)
    ref = torch.tensor([-2.0, -1.0, -10.0], dtype=F64)
    # diff = logp - ref = [1, -1, -30]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([1.0, -1.0, -30.0], dtype=F64))
    torch.testing.assert_close(kl_penalty(logp, ref, "kl"), kl_penalty(logp, ref, "k1"))
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), torch.tensor([1.0, 1.0, 30.0], dtype=F64))
    torch.testing.assert_close(kl_penalty(logp, ref, "mse"), torch.tensor([0.5, 0.5, 450.0], dtype=F64))
    # k3 with d = ref - logp = [-1, 1, 30 -> clamped 20]: e^-1 + 1 - 1, e - 2, then clamped to 10.
    k3 = torch.tensor([math.exp(-1), math.e - 2, 10.0], dtype=F64)
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), k3)
    with pytest.raises(ValueError, match="kl type"):
        kl_penalty(logp, ref, "k4")
    loss, m = kl_loss(logp[None], ref[None], torch.tensor([[1.0, 1.0, 0.0]]), kind="k3")
    assert loss.item() == pytest.approx((math.exp(-1) + math.e - 2) / 2)
    assert m["kl_loss"].item() == pytest.approx(loss.item())


def test_entropy_by_hand():
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3)]]], dtype=F64)
    # uniform over 2: ln 2;  p = [1/4, 3/4]: -(1/4 ln 1/4 + 3/4 ln 3/4)
    h = entropy_from_logits(logits)
    expected = [math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    torch.testing.assert_close(h, torch.tensor([expected], dtype=F64))
    value, m = entropy_loss(h, torch.tensor([[1.0, 0.0]]))
    assert value.item() == pytest.approx(math.log(2)) and m["entropy"].item() == pytest.approx(math.log(2))


def test_value_loss_by_hand():
    # V [1, 2], V_old [.5, 2], R [2, 1], clip .2:
    #   s0: (1 - 2)^2 = 1; clipped V = .5 + .2 = .7 -> 1.69; max 1.69 (clip active)
    #   s1: (2 - 1)^2 = 1; clipped V = 2 -> 1; max 1.   loss = .5 * (1.69 + 1)/2
    v = torch.tensor([1.0, 2.0], dtype=F64)
    loss, m = value_loss(v, torch.tensor([0.5, 2.0], dtype=F64), torch.tensor([2.0, 1.0], dtype=F64),
                         torch.ones(2, dtype=F64), clip_range=0.2)  # fmt: skip
    assert loss.item() == pytest.approx(0.5 * 2.69 / 2)
    assert m["value_clipfrac"].item() == pytest.approx(0.5)
    loss, _ = value_loss(v, torch.tensor([0.5, 2.0], dtype=F64), torch.tensor([2.0, 1.0], dtype=F64),
                         torch.ones(2, dtype=F64), clip_range=None)  # fmt: skip
    assert loss.item() == pytest.approx(0.5)


def test_aggregate_loss_empty_rows_and_global_denominator():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    # The all-masked row is not a sequence: every mode sees one sequence [1, 2].
    assert aggregate_loss(loss_mat, mask, "token-mean").item() == pytest.approx(1.5)
    assert aggregate_loss(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx(3.0)
    assert aggregate_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx(1.5)
    assert aggregate_loss(loss_mat, mask, "seq-mean-token-sum-norm").item() == pytest.approx(1.0)
    assert aggregate_loss(loss_mat, mask, "seq-mean-token-sum-norm", norm_length=6).item() == pytest.approx(
        0.5
    )
    # A micro-batch of a 6-token global batch: sum 3 / 6.
    assert aggregate_loss(loss_mat, mask, "token-mean", global_denominator=6).item() == pytest.approx(0.5)
    assert aggregate_loss(loss_mat, torch.zeros_like(mask), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(loss_mat, mask, "sum")


def test_actor_loss_combines_terms_by_name():
    logp, old = _ratio_inputs()
    ref = old - 0.5
    entropy = torch.full_like(logp, 2.0)
    cfg = AlgorithmConfig(clip_ratio_high=0.28, kl_loss_coef=0.1, kl_loss_type="k1", entropy_coef=0.01)
    loss, m = actor_loss(cfg, logp, old, ADV, MASK, ref_logprobs=ref, entropy=entropy)
    pg, _ = ppo_clip_loss(logp, old, ADV, MASK, clip_high=0.28, dual_clip_c=3.0)
    kl, _ = kl_loss(logp, ref, MASK, kind="k1")
    assert loss.item() == pytest.approx(pg.item() + 0.1 * kl.item() - 0.01 * 2.0)
    assert {
        "pg_loss",
        "kl_loss",
        "entropy",
        "clipfrac_high",
        "clipfrac_low",
        "approx_kl",
        "ratio_mean",
    } <= set(m)
    gspo, _ = actor_loss(AlgorithmConfig(policy_loss="gspo", use_kl_loss=False), logp, old, ADV, MASK)
    assert torch.isfinite(gspo)
    with pytest.raises(ValueError, match="ref_logprobs"):
        actor_loss(cfg, logp, old, ADV, MASK)


def test_kl_loss_with_zero_coefficient_needs_no_reference():
    # kl_loss_coef 0 is no KL loss: the actor builds no reference model, so none is asked for.
    logp, old = _ratio_inputs()
    cfg = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.0, entropy_coef=0.0)
    assert not cfg.kl_loss_active
    assert AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01).kl_loss_active
    assert not AlgorithmConfig(use_kl_loss=False, kl_loss_coef=0.01).kl_loss_active
    loss, m = actor_loss(cfg, logp, old, ADV, MASK)
    pg, _ = ppo_clip_loss(logp, old, ADV, MASK, dual_clip_c=3.0)
    assert loss.item() == pytest.approx(pg.item())
    assert "kl_loss" not in m


# --- gradients against a direct, slow formulation ------------------------------------------


def _random_batch(seed: int, batch: int = 3, seq: int = 5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, seq, generator=g, dtype=F64) * 3
    logp = (old + (torch.rand(batch, seq, generator=g, dtype=F64) - 0.5)).requires_grad_()
    mask = (torch.rand(batch, seq, generator=g) > 0.3).to(F64)
    mask[:, 0] = 1.0
    adv = torch.randn(batch, generator=g, dtype=F64)
    rollout = old + 0.3 * torch.randn(batch, seq, generator=g, dtype=F64)
    return logp, old, mask, adv, rollout


def _slow_aggregate(per_token: list[list], mask: torch.Tensor, mode: str, norm_length: float):
    seqs = []
    total, tokens = 0.0, 0.0
    for b, row in enumerate(per_token):
        seq_sum, n = 0.0, 0.0
        for t, value in enumerate(row):
            if mask[b, t] > 0:
                seq_sum = seq_sum + value
                n += 1
        total, tokens = total + seq_sum, tokens + n
        if n:
            seqs.append({"seq-mean-token-sum": seq_sum, "seq-mean-token-mean": seq_sum / n,
                         "seq-mean-token-sum-norm": seq_sum / norm_length}.get(mode))  # fmt: skip
    return total / tokens if mode == "token-mean" else sum(seqs) / len(seqs)


def _slow_ppo(logp, old, mask, adv, low, high, dual, rollout, cap, mode):
    rows = []
    for b in range(logp.shape[0]):
        row = []
        for t in range(logp.shape[1]):
            r = torch.exp(logp[b, t] - old[b, t])
            a = adv[b]
            loss = torch.maximum(-a * r, -a * torch.clamp(r, 1 - low, 1 + high))
            if dual is not None and a < 0:
                loss = torch.minimum(loss, -a * dual)
            if cap is not None:
                loss = loss * min(math.exp(float(old[b, t] - rollout[b, t])), cap)
            row.append(loss)
        rows.append(row)
    return _slow_aggregate(rows, mask, mode, logp.shape[1])


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("dual,cap", [(None, None), (1.2, None), (1.2, 1.1)])
def test_ppo_gradient_matches_direct_formulation(mode, dual, cap):
    for seed in range(3):
        logp, old, mask, adv, rollout = _random_batch(seed)
        weights = None if cap is None else rollout_correction_weights(old, rollout, mask, tis_cap=cap)[0]
        loss, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.15, dual_clip_c=dual, agg_mode=mode,
                                token_weights=weights)  # fmt: skip
        (grad,) = torch.autograd.grad(loss, logp)
        slow = _slow_ppo(logp, old, mask, adv, 0.1, 0.15, dual, rollout, cap, mode)
        (slow_grad,) = torch.autograd.grad(slow, logp)
        torch.testing.assert_close(loss, slow)
        torch.testing.assert_close(grad, slow_grad)


def test_gspo_gradient_matches_sequence_objective():
    # The direct form: s_b = exp(mean_t (logp - old)) per sequence, loss_b = max(-A s, -A clip(s)), mean over b.
    for seed in range(4):
        logp, old, mask, adv, _ = _random_batch(seed)
        loss, _ = gspo_loss(logp, old, adv, mask, clip_low=0.05, clip_high=0.08)
        (grad,) = torch.autograd.grad(loss, logp)
        per_seq = []
        for b in range(logp.shape[0]):
            terms = [logp[b, t] - old[b, t] for t in range(logp.shape[1]) if mask[b, t] > 0]
            s = torch.exp(sum(terms) / len(terms))
            per_seq.append(torch.maximum(-adv[b] * s, -adv[b] * torch.clamp(s, 0.95, 1.08)))
        slow = sum(per_seq) / len(per_seq)
        (slow_grad,) = torch.autograd.grad(slow, logp)
        torch.testing.assert_close(loss, slow)
        torch.testing.assert_close(grad, slow_grad)


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_kl_loss_gradient_matches_direct_formulation(kind, mode):
    logp, old, mask, _, _ = _random_batch(7)
    ref = old.detach()
    loss, _ = kl_loss(logp, ref, mask, kind=kind, agg_mode=mode)
    (grad,) = torch.autograd.grad(loss, logp)
    direct = {
        "k1": lambda x, r: x - r,
        "abs": lambda x, r: (x - r).abs(),
        "k2": lambda x, r: 0.5 * (x - r) ** 2,
        "k3": lambda x, r: torch.exp(r - x) - (r - x) - 1,
    }[kind]
    rows = [[direct(logp[b, t], ref[b, t]) for t in range(logp.shape[1])] for b in range(logp.shape[0])]
    slow = _slow_aggregate(rows, mask, mode, logp.shape[1])
    (slow_grad,) = torch.autograd.grad(slow, logp)
    torch.testing.assert_close(loss, slow)
    torch.testing.assert_close(grad, slow_grad)


def test_entropy_gradient_matches_direct_formulation():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 4, generator=g, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=F64)
    value, _ = entropy_loss(entropy_from_logits(logits), mask, agg_mode="seq-mean-token-mean")
    (grad,) = torch.autograd.grad(value, logits)
    rows = []
    for b in range(2):
        row = []
        for t in range(3):
            z = torch.exp(logits[b, t] - logits[b, t].max())
            p = z / z.sum()
            row.append(-sum(p[k] * torch.log(p[k]) for k in range(4)))
        rows.append(row)
    slow = _slow_aggregate(rows, mask, "seq-mean-token-mean", 3)
    (slow_grad,) = torch.autograd.grad(slow, logits)
    torch.testing.assert_close(value, slow)
    torch.testing.assert_close(grad, slow_grad)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_gradient_matches_direct_formulation(mode):
    g = torch.Generator().manual_seed(5)
    values = torch.randn(3, 4, generator=g, dtype=F64, requires_grad=True)
    old = values.detach() + 0.4 * torch.randn(3, 4, generator=g, dtype=F64)
    returns = torch.randn(3, 4, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=F64)
    loss, _ = value_loss(values, old, returns, mask, clip_range=0.2, agg_mode=mode)
    (grad,) = torch.autograd.grad(loss, values)
    rows = []
    for b in range(3):
        row = []
        for t in range(4):
            v, vo, r = values[b, t], old[b, t], returns[b, t]
            clipped = vo + torch.clamp(v - vo, -0.2, 0.2)
            row.append(0.5 * torch.maximum((v - r) ** 2, (clipped - r) ** 2))
        rows.append(row)
    slow = _slow_aggregate(rows, mask, mode, 4)
    (slow_grad,) = torch.autograd.grad(slow, values)
    torch.testing.assert_close(loss, slow)
    torch.testing.assert_close(grad, slow_grad)
