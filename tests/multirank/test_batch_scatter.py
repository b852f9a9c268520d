"""Each data-parallel rank receives exactly its shard of the leader's batch, as tensors;
its TP peers receive the same one; per-sample rows go out and come back the same way."""

from __future__ import annotations

import pytest
import torch

from megatron_agent.platform.launch import run_on_ranks

pytestmark = pytest.mark.multirank


def _whole_batch():
    from megatron_agent.training.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (3, 6, 2, 5, 4)]
    responses = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (2, 1, 4, 3, 2)]
    logprobs = [(-torch.rand(len(r), generator=g)).tolist() for r in responses]
    return TrainBatch.from_sequences(prompts, responses, rollout_logprobs=logprobs, temperature=0.7)


def _worker() -> dict:
    from megatron.core import parallel_state as ps

    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.batch import gather_rows, scatter_batch, scatter_rows

    ctx = init_distributed(ParallelConfig(tp=2), seed=0)
    leader = ctx.rank == 0
    whole = _whole_batch() if leader else None
    shard = scatter_batch(whole, ctx.data_parallel_size)
    advantages = torch.arange(5, dtype=torch.float32) * 10
    rows = scatter_rows({"advantages": advantages} if leader else None, ctx.data_parallel_size)
    gathered = gather_rows(shard.positions().to(torch.float32) * 100, shard)
    return {"dp_rank": ps.get_data_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
            "dp_size": ctx.data_parallel_size, "shard": shard.tensors(), "advantages": rows["advantages"],
            "gathered": gathered}


def test_each_dp_rank_receives_its_shard_and_tp_peers_the_same():
    per_rank = run_on_ranks(_worker, 4, timeout_s=600)
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
