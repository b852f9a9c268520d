"""The training actor across layouts, against transformers and against itself at TP=1.

One 2-rank job per family runs every layout in turn on the same batch:
- compute_logprobs equals TP=1 (1e-5) and transformers' teacher-forced logprobs (1e-4);
- one update gives the same new weights as at TP=1 (1e-5) and raises the logprobs of
  positive-advantage tokens;
- a checkpoint saved after one update at TP=2 (or PP=2), loaded at TP=1, gives the same
  weights after the next update as the run that never stopped.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from megatron_agent.models import read_hf_config
from megatron_agent.platform.launch import run_on_ranks

pytestmark = pytest.mark.multirank

LAYOUTS = {"qwen3": [dict(tp=2), dict(pp=2)], "qwen3_moe": [dict(pp=2), dict(ep=2)]}
TEMPERATURE = 0.9


def _batch(vocab: int):
    from megatron_agent.training.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (6, 9, 4, 7, 5, 8)]
    responses = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 3, 7, 4, 6, 2)]
    return TrainBatch.from_sequences(prompts, responses, advantages=[1.0, 0.5, 1.5, 0.8, 1.2, 0.3],
                                     temperature=TEMPERATURE)


class GroupStepAdam(torch.optim.Optimizer):
    """Adam with the state layout of Transformer Engine's FusedAdam, which Megatron uses on
    GPU (transformer_engine/pytorch/optimizers/fused_adam.py): the step count in each
    param group, a parameter's state holding only exp_avg, exp_avg_sq (and master_param),
    and state_dict / load_state_dict that fail on any other name. Its arithmetic is
    torch's Adam's, so its updates equal the CPU optimizer's."""

    STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adam_w_mode=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.adam_w_mode = adam_w_mode

    def _check_names(self, state: dict) -> None:
        for per_param in state.values():
            for name in per_param:
                if name not in self.STATE_NAMES:
                    raise KeyError(name)

    def state_dict(self):
        out = super().state_dict()
        self._check_names(out["state"])
        return out

    def load_state_dict(self, state_dict):
        self._check_names(state_dict["state"])
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (beta1, beta2), t, lr, wd = group["betas"], group["step"], group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                grad = p.grad if self.adam_w_mode or not wd else p.grad + wd * p
                if self.adam_w_mode and wd:
                    p.mul_(1 - lr * wd)
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**t)).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**t))


@contextlib.contextmanager
def fused_adam_layout():
    """Megatron as it is on GPU with Transformer Engine installed (optimizer/__init__.py and
    optimizer/distrib_optimizer.py pick FusedAdam and its step handling at import), with
    `GroupStepAdam` standing in for TE's FusedAdam."""
    from megatron.core import optimizer as megatron_optimizer
    from megatron.core.optimizer import distrib_optimizer

    patches = [(megatron_optimizer, "Adam", GroupStepAdam), (megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False),
               (distrib_optimizer, "Adam", GroupStepAdam), (distrib_optimizer, "HAVE_APEX_OR_TE", True),
               (distrib_optimizer, "USING_TE_OPTIMIZER", True)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _name(layout):
    return ",".join(f"{k}={v}" for k, v in layout.items()) or "tp=1"


def actor_maker(model_dir: str, algorithm):
    """On every rank of a job: the process group, once; then `make(layout, config)` builds an
    Actor at that layout (destroy_model_parallel() between two)."""
    from megatron_agent.platform import (
        ParallelConfig,
        destroy_model_parallel,
        init_distributed,
        initialize_model_parallel,
        set_seed,
    )
    from megatron_agent.training.actor import Actor

    ctx = init_distributed(ParallelConfig(), seed=5)
    destroy_model_parallel()

    def make(layout: dict, config):
        parallel = ParallelConfig(**layout)
        initialize_model_parallel(parallel, ctx.world_size)
        set_seed(5)
        return Actor(model_dir, parallel, config, algorithm)

    return make


def _worker(model_dir: str, ckpt_root: str, layouts: list[dict]) -> dict:
    import torch.distributed as dist

    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.models import read_hf_config
    from megatron_agent.platform import destroy_model_parallel
    from megatron_agent.training.actor import ActorConfig
    from megatron_agent.training.adam_steps import adam_steps, torch_optimizers

    hf = read_hf_config(model_dir)
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01, entropy_coef=0.01)
    config = ActorConfig(lr=1e-4, max_tokens_per_micro_batch=32, use_distributed_optimizer=False)
    make = actor_maker(model_dir, algorithm)
    results = {}

    def weights(actor):
        return {k: v.clone() for k, v in actor.named_hf_weights()}

    for layout in [dict()] + layouts:
        batch = _batch(hf["vocab_size"])
        actor = make(layout, config)
        before = actor.compute_logprobs(batch)
        batch.old_logprobs = before["logprobs"]
        first = actor.update(batch)
        after = actor.compute_logprobs(batch)["logprobs"]
        out = {"logprobs": before["logprobs"], "entropy": before["entropy"], "after": after,
               "weights_1": weights(actor), "metrics": first}
        if layout:  # save after the first update, take a second one
            actor.save(f"{ckpt_root}/{_name(layout)}/iter_1")
            batch2 = _batch(hf["vocab_size"])
            batch2.old_logprobs = actor.compute_logprobs(batch2)["logprobs"]
            actor.update(batch2)
            out["weights_2"] = weights(actor)
        results[_name(layout)] = out
        del actor
        destroy_model_parallel()

    # The distributed optimizer (DP=2 shards the optimizer state): same update, and its
    # checkpoint (dp_reshardable) resumes at the same layout; with torch's Adam (CPU) and
    # with FusedAdam's state layout, which Megatron takes on GPU.
    from dataclasses import replace

    config_plain = config
    config = replace(config_plain, use_distributed_optimizer=True)
    for name, optimizer_layout in (("distopt", contextlib.nullcontext), ("distopt fused", fused_adam_layout)):
        with optimizer_layout():
            actor = make(dict(), config)
            batch = _batch(hf["vocab_size"])
            batch.old_logprobs = actor.compute_logprobs(batch)["logprobs"]
            actor.update(batch)
            results[name] = {"weights_1": weights(actor)}
            actor.save(f"{ckpt_root}/{name}/iter_1")
            batch2 = _batch(hf["vocab_size"])
            batch2.old_logprobs = actor.compute_logprobs(batch2)["logprobs"]
            actor.update(batch2)
            results[name]["weights_2"] = weights(actor)
            del actor
            destroy_model_parallel()
            actor = make(dict(), config)
            actor.load(f"{ckpt_root}/{name}/iter_1")
            results["resumed " + name] = {"adam_steps": adam_steps(actor.optimizer),
                                          "optimizers": sorted({type(o).__name__
                                                                for o in torch_optimizers(actor.optimizer)})}
            batch2 = _batch(hf["vocab_size"])
            batch2.old_logprobs = actor.compute_logprobs(batch2)["logprobs"]
            actor.update(batch2)
            results["resumed " + name]["weights_2"] = weights(actor)
            del actor
            destroy_model_parallel()
    config = config_plain

    for layout in layouts:  # resume each checkpoint at TP=1 (DP=2) and take the second update
        actor = make(dict(), config)
        if layout.get("ep", 1) > 1:
            try:
                actor.load(f"{ckpt_root}/{_name(layout)}/iter_1")
            except ValueError as err:
                results["resumed " + _name(layout)] = {"error": str(err)}
            del actor
            destroy_model_parallel()
            continue
        actor.load(f"{ckpt_root}/{_name(layout)}/iter_1")
        assert actor.step == 1
        batch2 = _batch(hf["vocab_size"])
        batch2.old_logprobs = actor.compute_logprobs(batch2)["logprobs"]
        actor.update(batch2)
        results["resumed " + _name(layout)] = {"weights_2": weights(actor)}
        del actor
        destroy_model_parallel()
    dist.barrier()
    return results


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def actor_results(request, tiny_model_dir, tmp_path_factory):
    family = request.param
    model_dir = tiny_model_dir(family)
    results = run_on_ranks(_worker, 2, str(model_dir), str(tmp_path_factory.mktemp(f"ck_{family}")),
                           LAYOUTS[family], timeout_s=900)
    return family, model_dir, results


def _merged_weights(per_rank, name, key):
    merged = {}
    for r in per_rank:
        merged.update(r[name][key])
    return merged


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_logprobs_match_tp1_and_transformers(actor_results):
    from transformers import AutoModelForCausalLM

    family, model_dir, per_rank = actor_results
    reference = per_rank[0]["tp=1"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = _batch(hf.config.vocab_size)
    logits = hf(batch.tokens).logits[:, :-1] / TEMPERATURE
    teacher = torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    mask = batch.response_mask.bool()
    assert (reference["logprobs"] - teacher)[mask].abs().max() < 1e-4
    for layout in LAYOUTS[family]:
        for rank in per_rank:  # every rank returns the full batch
            got = rank[_name(layout)]
            assert (got["logprobs"] - reference["logprobs"])[mask].abs().max() < 1e-5, layout
            assert (got["entropy"] - reference["entropy"])[mask].abs().max() < 1e-5, layout


def test_update_matches_tp1_and_improves_positive_tokens(actor_results):
    family, model_dir, per_rank = actor_results
    reference = _merged_weights(per_rank, "tp=1", "weights_1")
    mask = _batch(read_hf_config(model_dir)["vocab_size"]).response_mask.bool()
    ref = per_rank[0]["tp=1"]
    assert (ref["after"] - ref["logprobs"])[mask].mean() > 0  # every advantage is positive
    assert ref["metrics"]["actor/grad_norm"] > 0
    for layout in LAYOUTS[family]:
        got = _merged_weights(per_rank, _name(layout), "weights_1")
        assert _max_diff(got, reference) < 1e-5, layout
        for metric in ("actor/grad_norm", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/actor_loss"):
            # the same whether the batch sits on one rank or is split over DP ranks
            assert per_rank[0][_name(layout)]["metrics"][metric] == pytest.approx(
                ref["metrics"][metric], rel=1e-5, abs=1e-7), (layout, metric)


def test_resume_at_another_layout_continues_exactly(actor_results):
    family, _, per_rank = actor_results
    for layout in LAYOUTS[family]:
        if layout.get("ep", 1) > 1:  # refused with a clear error instead
            assert "saved at ep=2; resuming its optimizer at ep=1 is not supported" in (
                per_rank[0]["resumed " + _name(layout)]["error"])
            continue
        uninterrupted = _merged_weights(per_rank, _name(layout), "weights_2")
        resumed = _merged_weights(per_rank, "resumed " + _name(layout), "weights_2")
        assert _max_diff(resumed, uninterrupted) < 1e-5, layout


@pytest.mark.parametrize("optimizer", ["distopt", "distopt fused"])
def test_distributed_optimizer_updates_and_resumes_the_same(actor_results, optimizer):
    """torch's Adam, and FusedAdam's layout (the step in the param groups; on GPU a
    per-parameter "step" made its state_dict raise KeyError, and the step read back was
    0, restarting the bias correction)."""
    _, _, per_rank = actor_results
    plain = _merged_weights(per_rank, "tp=1", "weights_1")
    assert _max_diff(_merged_weights(per_rank, optimizer, "weights_1"), plain) < 1e-6
    for rank in per_rank:
        assert rank["resumed " + optimizer]["adam_steps"] == 1
        assert rank["resumed " + optimizer]["optimizers"] == (
            ["GroupStepAdam"] if optimizer.endswith("fused") else ["AdamW"])
    resumed = _merged_weights(per_rank, "resumed " + optimizer, "weights_2")
    assert _max_diff(resumed, _merged_weights(per_rank, optimizer, "weights_2")) < 1e-6
