"""The training actor on one GPU: the local layer spec, bf16 parameters (fp32 main params in
the optimizer), the weights of a tiny model made on the spot. Each check is a job of one
NCCL rank (spawned, so nothing stays initialised in the test process):

- its logits are as close to HF transformers' fp32 forward on the same bf16 weights as
  transformers' own bf16 model is (`bf16_allowance`), its logprobs within the bf16 check bound;
- an update step: finite metrics, every weight moves, the positive-advantage tokens'
  logprobs rise and the policy loss falls at the next step (same old logprobs);
- a checkpoint of the distributed optimizer (DP 1) resumed: the next update equals the
  uninterrupted run's, while the same resume with Adam's step count set back to 0 (its
  bias correction restarted) differs by far more, so the comparison sees a lost step.

Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from megatron_agent.platform.launch import run_on_ranks

pytestmark = pytest.mark.gpu

DEVICE = "cuda"  # where the jobs must have run (a CPU rehearsal of these jobs sets "cpu")
TEMPERATURE = 0.9
JOB_TIMEOUT_S = 240


def _batch(vocab: int, seed: int = 0):
    from megatron_agent.training.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (6, 9, 4, 7)]
    responses = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 3, 7, 4)]
    return TrainBatch.from_sequences(prompts, responses, advantages=[1.0, 0.5, 1.5, 0.8], temperature=TEMPERATURE)


def _actor(model_dir: str, **config):
    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.platform import ParallelConfig
    from megatron_agent.training.actor import Actor, ActorConfig

    return Actor(model_dir, ParallelConfig(), ActorConfig(params_dtype="bf16", layer_spec="local", **config),
                 AlgorithmConfig(use_kl_loss=False, entropy_coef=0.0))


def _weights(actor) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", torch.float32, copy=True) for name, t in actor.named_hf_weights()}


def _where(actor) -> dict:
    p = next(actor.chunks[0].parameters())
    return {"device": p.device.type, "dtype": str(p.dtype)}


def _logits_job(model_dir: str, input_ids: torch.Tensor) -> dict:
    from megatron_agent.models import read_hf_config
    from megatron_agent.platform import init_distributed
    from megatron_agent.training.schedule import forward_logits

    init_distributed(seed=5)
    actor = _actor(model_dir)
    vocab = read_hf_config(model_dir)["vocab_size"]
    logits = forward_logits(actor.model, input_ids, vocab)
    batch = _batch(vocab)
    return {**_where(actor), "logits": logits.float().cpu(),
            "logprobs": actor.compute_logprobs(batch, with_entropy=False)["logprobs"]}


def _update_job(model_dir: str) -> dict:
    from megatron_agent.models import read_hf_config
    from megatron_agent.platform import init_distributed

    init_distributed(seed=5)
    actor = _actor(model_dir, lr=1e-2, use_distributed_optimizer=False)  # past bf16's spacing at 1.0
    batch = _batch(read_hf_config(model_dir)["vocab_size"])
    before, weights_before = actor.compute_logprobs(batch, with_entropy=False)["logprobs"], _weights(actor)
    batch.old_logprobs = before
    first = actor.update(batch)
    after = actor.compute_logprobs(batch, with_entropy=False)["logprobs"]
    weights_after = _weights(actor)
    second = actor.update(batch)  # the same old logprobs: its loss is taken at the moved ratio
    return {**_where(actor), "before": before, "after": after, "first": first, "second": second,
            "weights_before": weights_before, "weights_after": weights_after}


def _resume_job(model_dir: str, checkpoint: str) -> dict:
    from megatron_agent.models import read_hf_config
    from megatron_agent.platform import (
        destroy_model_parallel,
        init_distributed,
        initialize_model_parallel,
        set_seed,
    )

    ctx = init_distributed(seed=5)
    vocab = read_hf_config(model_dir)["vocab_size"]
    config = dict(lr=1e-2, use_distributed_optimizer=True)

    def second_update(actor) -> tuple[dict, dict]:
        batch = _batch(vocab, seed=1)
        batch.old_logprobs = actor.compute_logprobs(batch, with_entropy=False)["logprobs"]
        start = _weights(actor)
        actor.update(batch)
        return start, _weights(actor)

    def fresh_actor():
        destroy_model_parallel()
        initialize_model_parallel(ctx.parallel, ctx.world_size)
        set_seed(5)
        return _actor(model_dir, **config)

    actor = _actor(model_dir, **config)
    first = _batch(vocab)
    first.old_logprobs = actor.compute_logprobs(first, with_entropy=False)["logprobs"]
    actor.update(first)
    actor.save(f"{checkpoint}/iter_1")
    out = {**_where(actor), "optimizer": type(actor.optimizer).__name__,
           "adam": type(actor.optimizer.optimizer).__name__ if hasattr(actor.optimizer, "optimizer") else None,
           "uninterrupted": second_update(actor)}
    del actor
    resumed = fresh_actor()
    resumed.load(f"{checkpoint}/iter_1")
    out["resumed_step"] = resumed.step
    out["resumed"] = second_update(resumed)
    del resumed
    reset = fresh_actor()
    reset.load(f"{checkpoint}/iter_1")
    from megatron_agent.training.adam_steps import set_adam_steps

    set_adam_steps(reset.optimizer, 0)  # Adam's step back to 0, where the optimizer keeps it
    out["step_reset"] = second_update(reset)
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _relative_change_gap(run: tuple[dict, dict], reference: tuple[dict, dict]) -> float:
    """|(run's update) - (reference's update)| / |reference's update|, over every weight."""
    (start, end), (ref_start, ref_end) = run, reference
    num = sum(float(((end[k] - start[k]) - (ref_end[k] - ref_start[k])).square().sum()) for k in start)
    den = sum(float((ref_end[k] - ref_start[k]).square().sum()) for k in start)
    return (num / den) ** 0.5


def _hf_logits(model_dir, input_ids: torch.Tensor, dtype: torch.dtype, device: str) -> torch.Tensor:
    """transformers' logits on the actor's weights (the checkpoint's, rounded to bf16),
    computed in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
        model = model.to(device=device, dtype=dtype).eval()
        return model(input_ids.to(device)).logits.float().cpu()


def bf16_allowance(hf_bf16_error: float, exact: torch.Tensor) -> float:
    """How far bf16 logits may be from the fp32 forward on the same weights: 4x transformers'
    own bf16 error, plus 1% of the largest logit (kernels differ: Megatron's unfused attention
    rounds its scores to bf16, a fused one keeps them in fp32). A wrong weight moves logits by
    their whole size."""
    return 4 * hf_bf16_error + 1e-2 * float(exact.abs().max())


def test_actor_logits_match_transformers(tiny_model_dir):
    from megatron_agent.training.checks import DEFAULT_MEAN_BOUND

    model_dir = str(tiny_model_dir("qwen3"))
    input_ids = torch.randint(0, 800, (3, 24), generator=torch.Generator().manual_seed(3))
    out = run_on_ranks(_logits_job, 1, model_dir, input_ids, timeout_s=JOB_TIMEOUT_S)[0]
    assert (out["device"], out["dtype"]) == (DEVICE, "torch.bfloat16")
    exact = _hf_logits(model_dir, input_ids, torch.float32, DEVICE)
    hf_bf16 = _hf_logits(model_dir, input_ids, torch.bfloat16, DEVICE)
    actor_error = float((out["logits"] - exact).abs().max())
    hf_bf16_error = float((hf_bf16 - exact).abs().max())
    print(f"measured: max |logit - fp32 reference|: actor {actor_error:.3g}, transformers bf16 {hf_bf16_error:.3g} "
          f"(logits up to {float(exact.abs().max()):.3g})")
    assert actor_error <= bf16_allowance(hf_bf16_error, exact), (actor_error, hf_bf16_error)

    batch = _batch(exact.shape[-1])
    logits = _hf_logits(model_dir, batch.tokens, torch.float32, DEVICE)[:, :-1] / TEMPERATURE
    teacher = torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    gap = (out["logprobs"] - teacher)[batch.response_mask.bool()].abs()
    print(f"measured: actor vs fp32 teacher-forced logprobs: mean {float(gap.mean()):.3g}, max {float(gap.max()):.3g}")
    assert float(gap.mean()) < DEFAULT_MEAN_BOUND["bf16"], float(gap.mean())


def test_update_step_moves_the_loss_and_the_weights(tiny_model_dir):
    model_dir = str(tiny_model_dir("qwen3"))
    out = run_on_ranks(_update_job, 1, model_dir, timeout_s=JOB_TIMEOUT_S)[0]
    assert (out["device"], out["dtype"]) == (DEVICE, "torch.bfloat16")
    for metrics in (out["first"], out["second"]):
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
        assert metrics["actor/update_ok"] == 1.0, metrics
    assert out["first"]["actor/grad_norm"] > 0, out["first"]
    assert all(torch.isfinite(w).all() for w in out["weights_after"].values())
    unchanged = [k for k in out["weights_before"] if torch.equal(out["weights_before"][k], out["weights_after"][k])]
    assert not unchanged, unchanged
    mask = _batch(800).response_mask.bool()
    assert float((out["after"] - out["before"])[mask].mean()) > 0  # every advantage is positive
    assert out["second"]["actor/pg_loss"] < out["first"]["actor/pg_loss"], (out["first"], out["second"])


def test_distributed_optimizer_resume_keeps_adams_step(tiny_model_dir, tmp_path):
    model_dir = str(tiny_model_dir("qwen3"))
    out = run_on_ranks(_resume_job, 1, model_dir, str(tmp_path / "ck"), timeout_s=JOB_TIMEOUT_S)[0]
    assert (out["device"], out["dtype"]) == (DEVICE, "torch.bfloat16")
    assert out["resumed_step"] == 1
    # the checkpoint restores the weights the uninterrupted run had
    assert _max_diff(out["resumed"][0], out["uninterrupted"][0]) == 0.0
    resumed = _relative_change_gap(out["resumed"], out["uninterrupted"])
    reset = _relative_change_gap(out["step_reset"], out["uninterrupted"])
    print(f"measured: {out['optimizer']} ({out['adam']}): the update after resume differs from the uninterrupted one "
          f"by {resumed:.3g} of its size; with Adam's step reset, by {reset:.3g}")
    assert reset > 0.1, reset  # what a lost step count does to the second update
    assert resumed < 0.01, (resumed, reset)
