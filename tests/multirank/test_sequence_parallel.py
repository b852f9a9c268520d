"""Sequence parallelism on CPU, and the padding it needs, held to the TP=1 result.

One job per case runs the same batch at TP=1 (all ranks data parallel) and at the
sequence-parallel layout: dense TP=2+SP and MoE TP=2+EP=2+SP on 2 ranks (expert TP 1, so
the two expert-parallel ranks are the two ranks of the TP group), MoE TP=2+EP=2+ETP=2+SP
on 4 ranks. The batch's micro-batches have odd widths, so sequence parallelism pads them
(to a multiple of 2). Compared with TP=1:
- compute_logprobs (logprobs, entropy) within 1e-5;
- one update (PPO clip + KL loss + entropy bonus): loss metrics and grad norm, the weights
  after the optimizer step, the logprobs after it, within 1e-5; a second update's metrics
  (its KL term is non-zero) too;
- the dense job also pads TP=1 to 16 columns (FP8's alignment) and gets TP=1's numbers,
  and runs the critic at TP=2+SP (values before and after an update).

Two checks of the layer below ride on these jobs, so as not to start ranks of their own
(a rank's start-up, its imports, costs more than the check): the dense job gathers uneven
sequence pieces over its TP group (what the MoE dispatcher does), and the 4-rank job
scatters a batch to its two data-parallel ranks of TP=2 (training/batch.py).
"""

from __future__ import annotations

import pytest
import torch

from megatron_agent.models import read_hf_config
from megatron_agent.platform.launch import run_on_ranks

pytestmark = pytest.mark.multirank

# case -> (family, layout, ranks, the job's extra checks)
CASES = {
    "qwen3 tp=2 sp": ("qwen3", dict(tp=2, sequence_parallel=True), 2, ("padding and critic", "uneven gather")),
    "qwen3_moe tp=2 ep=2 etp=1 sp": ("qwen3_moe", dict(tp=2, ep=2, etp=1, sequence_parallel=True), 2, ()),
    # expert TP 2 as well: 4 ranks (about a minute on 2 cores). The dispatcher gathers
    # uneven pieces over expert TP, which gloo needs the CPU layer for.
    "qwen3_moe tp=2 ep=2 etp=2 sp": ("qwen3_moe", dict(tp=2, ep=2, sequence_parallel=True), 4, ("batch scatter",)),
}
TEMPERATURE = 0.9
MAX_TOKENS = 32
METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/actor_loss", "actor/grad_norm")


def _batch(vocab: int):
    from megatron_agent.training.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (6, 9, 4, 7, 5, 8)]
    responses = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 3, 7, 4, 6, 2)]
    return TrainBatch.from_sequences(prompts, responses, advantages=[1.0, -0.5, 1.5, 0.8, -1.2, 0.3],
                                     temperature=TEMPERATURE)


def _worker(model_dir: str, layout: dict, extras: tuple[str, ...]) -> dict:
    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.models import read_hf_config
    from megatron_agent.platform import (
        ParallelConfig,
        destroy_model_parallel,
        init_distributed,
        initialize_model_parallel,
        set_seed,
    )
    from megatron_agent.training import actor as actor_module
    from megatron_agent.training import schedule
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.training.critic import Critic, ValueHead

    hf = read_hf_config(model_dir)
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01, entropy_coef=0.01)
    config = ActorConfig(lr=1e-4, max_tokens_per_micro_batch=MAX_TOKENS, use_distributed_optimizer=False)
    ctx = init_distributed(ParallelConfig(), seed=5)
    destroy_model_parallel()
    results = {}

    def run_actor(lay: dict) -> dict:
        parallel = ParallelConfig(**lay)
        initialize_model_parallel(parallel, ctx.world_size)
        set_seed(5)
        actor = Actor(model_dir, parallel, config, algorithm)
        widths = []  # the sequence length each forward gave the model
        for chunk in actor.chunks:
            chunk.register_forward_pre_hook(lambda _m, args: widths.append(int(args[0].shape[1])))
        batch = _batch(hf["vocab_size"])
        before = actor.compute_logprobs(batch)
        batch.old_logprobs = before["logprobs"]
        metrics = actor.update(batch)
        out = {"logprobs": before["logprobs"], "entropy": before["entropy"], "metrics": metrics,
               "after": actor.compute_logprobs(batch)["logprobs"], "widths": widths,
               "weights": {k: v.clone() for k, v in actor.named_hf_weights()}}
        # A second update: the policy has left the reference, so the KL term is non-zero.
        batch.old_logprobs = out["after"]
        out["metrics_2"] = actor.update(batch)
        del actor
        destroy_model_parallel()
        return out

    results["tp=1"] = run_actor({})
    results["sp"] = run_actor(layout)
    if "uneven gather" in extras:
        results["uneven gather"] = _uneven_gather(ctx.world_size)
    if "batch scatter" in extras:
        results["batch scatter"] = _batch_scatter(ctx.world_size)
    if "padding and critic" not in extras:
        return results

    # TP=1 padded to FP8's 16 columns: the padding must change nothing.
    padded = actor_module.layout_multiple, schedule.layout_multiple
    actor_module.layout_multiple = schedule.layout_multiple = lambda chunks: 16
    try:
        results["tp=1 padded to 16"] = run_actor({})
    finally:
        actor_module.layout_multiple, schedule.layout_multiple = padded

    head = torch.Generator().manual_seed(3)
    head_w, head_b = torch.randn(1, hf["hidden_size"], generator=head) * 0.1, torch.tensor([0.25])
    returns = torch.tensor([1.0, -0.5, 2.0, 0.3, 0.7, -1.0])
    for name, lay in (("critic tp=1", {}), ("critic sp", layout)):
        parallel = ParallelConfig(**lay)
        initialize_model_parallel(parallel, ctx.world_size)
        set_seed(5)
        critic = Critic(model_dir, parallel, ActorConfig(lr=1e-3, max_tokens_per_micro_batch=MAX_TOKENS,
                                                         use_distributed_optimizer=False),
                        AlgorithmConfig(use_kl_loss=False, value_clip=None))
        for chunk in critic.chunks:
            if isinstance(getattr(chunk, "output_layer", None), ValueHead):
                chunk.output_layer.weight.data.copy_(head_w)
                chunk.output_layer.bias.data.copy_(head_b)
        batch = _batch(hf["vocab_size"])
        values = critic.compute_values(batch)
        metrics = critic.update(batch, returns)
        results[name] = {"values": values, "metrics": metrics, "after": critic.compute_values(batch)}
        del critic
        destroy_model_parallel()
    return results


DENSE = "qwen3 tp=2 sp"


@pytest.fixture(scope="module", params=list(CASES))
def sp_results(request, tiny_model_dir):
    family, layout, ranks, extras = CASES[request.param]
    model_dir = tiny_model_dir(family)
    per_rank = run_on_ranks(_worker, ranks, str(model_dir), layout, extras, timeout_s=900)
    return family, read_hf_config(model_dir)["vocab_size"], per_rank


def _real_positions(vocab: int) -> torch.Tensor:
    """Target positions inside each sequence (past its end, a row holds what its
    micro-batch's width left there, which depends on how samples were grouped)."""
    batch = _batch(vocab)
    return torch.arange(batch.tokens.shape[1] - 1) < (batch.lengths - 1)[:, None]


def _merged(per_rank, name):
    merged = {}
    for rank in per_rank:
        merged.update(rank[name]["weights"])
    return merged


def _weights_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_sequence_parallel_pads_odd_widths(sp_results):
    _, _, per_rank = sp_results
    assert any(w % 2 for rank in per_rank for w in rank["tp=1"]["widths"])  # odd widths at TP=1 ...
    for rank in per_rank:
        assert rank["sp"]["widths"] and all(w % 2 == 0 for w in rank["sp"]["widths"])  # ... padded under SP


def test_sequence_parallel_logprobs_and_update_match_tp1(sp_results):
    family, vocab, per_rank = sp_results
    reference = per_rank[0]["tp=1"]
    real = _real_positions(vocab)
    reference_weights = _merged(per_rank, "tp=1")
    for rank in per_rank:
        got = rank["sp"]
        # Every target of every sequence, prompt included: the unpadded batch's values.
        for key in ("logprobs", "entropy", "after"):
            assert (got[key] - reference[key])[real].abs().max() < 1e-5, (family, key)
        for metric in METRICS:
            for step in ("metrics", "metrics_2"):
                assert got[step][metric] == pytest.approx(reference[step][metric], rel=1e-5, abs=1e-7), (
                    family, step, metric)
    assert _weights_diff(_merged(per_rank, "sp"), reference_weights) < 1e-5, family
    # the update moved the policy (the comparisons above are not vacuous)
    assert (reference["after"] - reference["logprobs"]).abs().max() > 1e-4
    assert reference["metrics_2"]["actor/kl_loss"] > 0


@pytest.mark.parametrize("sp_results", [DENSE], indirect=True)  # run in the dense job
def test_padding_changes_nothing_at_tp1(sp_results):
    family, vocab, per_rank = sp_results
    reference, padded = per_rank[0]["tp=1"], per_rank[0]["tp=1 padded to 16"]
    assert all(w % 16 == 0 for w in padded["widths"])
    real = _real_positions(vocab)
    for key in ("logprobs", "entropy", "after"):
        assert (padded[key] - reference[key])[real].abs().max() < 1e-5, key
    for metric in METRICS:
        for step in ("metrics", "metrics_2"):
            assert padded[step][metric] == pytest.approx(reference[step][metric], rel=1e-5, abs=1e-7), (step, metric)
    assert _weights_diff(_merged(per_rank, "tp=1 padded to 16"), _merged(per_rank, "tp=1")) < 1e-5


@pytest.mark.parametrize("sp_results", [DENSE], indirect=True)  # run in the dense job
def test_critic_under_sequence_parallelism_matches_tp1(sp_results):
    family, vocab, per_rank = sp_results
    reference = per_rank[0]["critic tp=1"]
    assert reference["values"].abs().max() > 0
    for rank in per_rank:
        got = rank["critic sp"]
        assert (got["values"] - reference["values"]).abs().max() < 1e-5
        # after an Adam step of lr 1e-3 on values of about 3: 1e-5 relative
        assert torch.allclose(got["after"], reference["after"], rtol=1e-5, atol=1e-5)
        assert got["metrics"]["critic/value_loss"] == pytest.approx(reference["metrics"]["critic/value_loss"],
                                                                    rel=1e-5)
        assert got["metrics"]["critic/grad_norm"] == pytest.approx(reference["metrics"]["critic/grad_norm"],
                                                                   rel=1e-5)


def _uneven_gather(world_size: int) -> dict:
    """In the dense job (2 ranks, TP=2)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    from megatron_agent.platform import ParallelConfig, destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(ParallelConfig(tp=2), world_size)
    rank = parallel_state.get_tensor_model_parallel_rank()
    sizes = [3, 5]  # what the MoE dispatcher gathers: each rank's own number of tokens
    mine = torch.full((sizes[rank], 2), float(rank + 1), requires_grad=True)
    gathered = gather_from_sequence_parallel_region(mine, group=parallel_state.get_tensor_model_parallel_group(),
                                                    output_split_sizes=sizes)
    (gathered * torch.arange(8.0)[:, None]).sum().backward()  # backward: an uneven reduce-scatter
    destroy_model_parallel()
    return {"rank": rank, "gathered": gathered.detach(), "grad": mine.grad}


@pytest.mark.parametrize("sp_results", [DENSE], indirect=True)  # run in the dense job
def test_uneven_sequence_gather_on_gloo(sp_results):
    _, _, per_rank = sp_results
    expected = torch.cat([torch.full((3, 2), 1.0), torch.full((5, 2), 2.0)])
    weights = torch.arange(8.0)[:, None].expand(8, 2)
    assert [rank["uneven gather"]["rank"] for rank in per_rank] == [0, 1]
    for rank, out in enumerate(rank["uneven gather"] for rank in per_rank):
        assert torch.equal(out["gathered"], expected)
        # both ranks computed the same loss: each slice's gradient is summed over the 2 ranks
        own = weights[:3] if rank == 0 else weights[3:]
        assert torch.equal(out["grad"], 2 * own)


# Each data-parallel rank receives exactly its shard of the leader's batch, as tensors; its
# TP peers receive the same one; per-sample rows go out and come back the same way.

def _whole_batch():
    from megatron_agent.training.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (3, 6, 2, 5, 4)]
    responses = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (2, 1, 4, 3, 2)]
    logprobs = [(-torch.rand(len(r), generator=g)).tolist() for r in responses]
    return TrainBatch.from_sequences(prompts, responses, rollout_logprobs=logprobs, temperature=0.7)


def _batch_scatter(world_size: int) -> dict:
    """In the 4-rank job, at TP=2 (DP=2)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_agent.platform import ParallelConfig, destroy_model_parallel, initialize_model_parallel
    from megatron_agent.training.batch import gather_rows, scatter_batch, scatter_rows

    initialize_model_parallel(ParallelConfig(tp=2), world_size)
    dp_size = ps.get_data_parallel_world_size()
    leader = dist.get_rank() == 0
    whole = _whole_batch() if leader else None
    shard = scatter_batch(whole, dp_size)
    advantages = torch.arange(5, dtype=torch.float32) * 10
    rows = scatter_rows({"advantages": advantages} if leader else None, dp_size)
    gathered = gather_rows(shard.positions().to(torch.float32) * 100, shard)
    out = {"dp_rank": ps.get_data_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
           "dp_size": dp_size, "shard": shard.tensors(), "advantages": rows["advantages"], "gathered": gathered}
    destroy_model_parallel()
    return out


@pytest.mark.parametrize("sp_results", ["qwen3_moe tp=2 ep=2 etp=2 sp"], indirect=True)  # run in the 4-rank job
def test_each_dp_rank_receives_its_shard_and_tp_peers_the_same(sp_results):
    per_rank = [rank["batch scatter"] for rank in sp_results[2]]
    assert len(per_rank) == 4
    whole = _whole_batch()
    assert {r["dp_size"] for r in per_rank} == {2}
    for r in per_rank:
        expected = whole.dp_shard(r["dp_rank"], 2).tensors()
        assert r["shard"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(r["shard"][name], value), (r["dp_rank"], r["tp_rank"], name)
        assert r["advantages"].tolist() == [10.0 * i for i in range(r["dp_rank"], 5, 2)]
    by_dp = {}
    for r in per_rank:
        by_dp.setdefault(r["dp_rank"], []).append(r)
    assert sorted(by_dp) == [0, 1] and all(len(peers) == 2 for peers in by_dp.values())
    for peers in by_dp.values():  # TP peers: the same shard
        assert torch.equal(peers[0]["shard"]["tokens"], peers[1]["shard"]["tokens"])
    assert per_rank[0]["gathered"].tolist() == [0.0, 100.0, 200.0, 300.0, 400.0]  # on the leader, in order
    assert all(r["gathered"] is None for r in per_rank[1:])
