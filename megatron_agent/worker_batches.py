"""Each DP rank's batch, from the rollout workers (megatron_agent/rollout_workers.py).

    batch = fetch_batch(workers, collected, dp, pad_id=..., temperature=...)   # collective

The leader assigns the whole batch's samples to the DP ranks by tokens (`assign_by_tokens`);
a worker's shard of them is compact (int32 ids and float32 response logprobs, unpadded, and
the advantages), and `batch_from_shards` pads a rank's samples into its TrainBatch, each in
its whole-batch place. With Ray workers the first rank of each DP index fetches its shards
from the worker actors itself and shares the batch with its TP/PP/CP peers, so no token
passes through rank 0; with the worker in rank 0's process (W = 1), rank 0 fetches every
shard and scatters them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def compact_shard(samples: Sequence, advantages: np.ndarray | None = None) -> dict:
    """Step samples (rollout.samples.StepSample) as a worker sends them: int32 token ids and
    float32 response logprobs, unpadded and flat, each sample's prompt and response lengths,
    its images (None for a text prompt), its step in its episode and, when given, its advantage."""
    prompt_lengths = np.array([len(s.prompt_ids) for s in samples], dtype=np.int32)
    response_lengths = np.array([len(s.response_ids) for s in samples], dtype=np.int32)
    out = {
        "prompt_lengths": prompt_lengths,
        "response_lengths": response_lengths,
        "tokens": np.fromiter((t for s in samples for ids in (s.prompt_ids, s.response_ids) for t in ids),
                              dtype=np.int32, count=int(prompt_lengths.sum() + response_lengths.sum())),
        "logprobs": np.fromiter((x for s in samples for x in s.rollout_logprobs), dtype=np.float32,
                                count=int(response_lengths.sum())),
        "images": [None if s.pixel_values is None else (s.pixel_values, s.image_grid_thw) for s in samples],
        "step_index": np.array([s.step_index for s in samples], dtype=np.int32),
    }
    routed = [s.routed_experts is not None for s in samples]
    if any(routed):
        if not all(routed):
            raise ValueError(f"{routed.count(False)} of {len(samples)} step samples carry no routed experts")
        out["routed_experts"] = np.concatenate([s.routed_experts for s in samples])
    if advantages is not None:
        out["advantages"] = np.asarray(advantages, dtype=np.float32)
    return out


def assign_by_tokens(lengths: Sequence[int], dp: int) -> list[np.ndarray]:
    """Whole-batch positions per DP rank: longest sample first, each to the rank with the
    fewest tokens so far (the lowest rank on a tie); each rank's positions ascending."""
    lengths = np.asarray(lengths, dtype=np.int64)
    load, owner = np.zeros(dp, dtype=np.int64), np.empty(len(lengths), dtype=np.int64)
    for i in np.argsort(-lengths, kind="stable"):
        rank = int(np.argmin(load))
        owner[i] = rank
        load[rank] += lengths[i]
    return [np.flatnonzero(owner == d) for d in range(dp)]



def batch_from_shards(shards: list[dict], order: np.ndarray, positions: np.ndarray, whole_size: int, *,
                      pad_id: int, temperature: float):
    """A DP rank's TrainBatch from the workers' compact shards (in worker order, their rows
    concatenated); `order[i]`: which of those rows is the rank's i-th sample, at whole-batch
    position `positions[i]`."""
    import torch

    from megatron_agent.training.batch import TrainBatch

    prompts, responses, logprobs, images, steps, advantages, routes = [], [], [], [], [], [], []
    for shard in shards:
        ends = np.cumsum(np.stack([shard["prompt_lengths"], shard["response_lengths"]], 1).reshape(-1))
        pieces = np.split(shard["tokens"], ends[:-1]) if len(ends) else []
        prompts += pieces[0::2]
        responses += pieces[1::2]
        logprobs += np.split(shard["logprobs"], np.cumsum(shard["response_lengths"])[:-1]) if len(ends) else []
        images += shard["images"]
        steps.append(shard["step_index"])
        if "routed_experts" in shard:  # rows: each sample's prompt + response - 1
            fed = shard["prompt_lengths"].astype(np.int64) + shard["response_lengths"] - 1
            routes += np.split(shard["routed_experts"], np.cumsum(fed)[:-1]) if len(fed) else []
        if "advantages" in shard:
            advantages.append(shard["advantages"])
    pick = [int(i) for i in order]
    batch = TrainBatch.from_sequences([prompts[i] for i in pick], [responses[i] for i in pick], pad_id=pad_id,
                                      rollout_logprobs=[logprobs[i] for i in pick], temperature=temperature,
                                      images=[images[i] for i in pick],
                                      routed_experts=[routes[i] for i in pick] if routes else None)
    batch.step_index = torch.as_tensor(np.concatenate(steps)[pick], dtype=torch.long)
    if advantages:
        batch.advantages = torch.as_tensor(np.concatenate(advantages)[pick], dtype=torch.float32)
    return batch.with_place(torch.as_tensor(positions, dtype=torch.long), whole_size)


def fetch_batch(workers, collected, dp: int, *, pad_id: int,
                temperature: float):
    """Collective: this rank's shard of the rollout (`workers`, the RolloutWorkers, and
    `collected`, their Collected rollout, on the leader; None elsewhere). The leader assigns the samples to DP ranks by tokens; with Ray
    workers the first rank of each DP index fetches its rows from the workers itself (a
    worker that dies meanwhile is replaced and the fetch repeated), else the leader
    fetches all of them and scatters them."""
    from megatron_agent.platform import from_leader
    from megatron_agent.training.batch import TrainBatch

    if collected is not None:
        collected.positions = assign_by_tokens(collected.lengths, dp)
    remote = from_leader(workers.remote if workers is not None else None)
    if not remote:
        from megatron_agent.platform.distributed import scatter_to_data_parallel

        parts = None
        if collected is not None:
            parts = []
            for positions in collected.positions:
                sources = collected.sources[positions]
                shards = workers.fetch(collected.iteration, sources, collected.moments)
                parts.append(batch_from_shards(shards, shard_order(sources), positions, collected.size,
                                               pad_id=pad_id, temperature=temperature).tensors())
        return TrainBatch.from_tensors(scatter_to_data_parallel(parts))
    return TrainBatch.from_tensors(_fetch_from_ray(workers, collected, pad_id=pad_id, temperature=temperature))


def shard_order(sources: np.ndarray) -> np.ndarray:
    """For (worker, row) pairs, where each one lands in the worker-ordered concatenation of
    the workers' shards (each worker's rows asked in their order in `sources`)."""
    by_worker = np.argsort(sources[:, 0], kind="stable")
    order = np.empty(len(sources), dtype=np.int64)
    order[by_worker] = np.arange(len(sources))
    return order


def _fetch_from_ray(workers, collected, *, pad_id: int, temperature: float) -> dict:
    """Each DP index's first rank gets its rows from the worker actors; its peers get them from it."""
    import ray
    import torch.distributed as dist
    from ray.exceptions import RayActorError

    from megatron_agent.platform import from_leader
    from megatron_agent.platform.distributed import data_parallel_peers, share_with_peers

    peers = data_parallel_peers() if dist.is_initialized() and dist.get_world_size() > 1 else None
    head = peers is None or dist.get_rank() == peers.heads[peers.dp_index]
    dp_index = 0 if peers is None else peers.dp_index
    while True:
        plan = from_leader(None if collected is None else {
            "address": ray.get_runtime_context().gcs_address, "namespace": workers.namespace,
            "iteration": collected.iteration,
            "names": [workers.name(k) for k in range(workers.count)], "moments": collected.moments,
            "whole": collected.size, "positions": collected.positions,
            "sources": [collected.sources[p] for p in collected.positions]})
        tensors, lost = None, None
        if head:
            if not ray.is_initialized():
                ray.init(address=plan["address"], namespace=plan["namespace"])
            sources, positions = plan["sources"][dp_index], plan["positions"][dp_index]
            try:
                handles = [ray.get_actor(name, namespace=plan["namespace"]) for name in plan["names"]]
                rows = [sources[sources[:, 0] == k, 1] for k in range(len(handles))]
                shards = ray.get([h.shard.remote(plan["iteration"], r, plan["moments"])
                                  for h, r in zip(handles, rows)])
                tensors = batch_from_shards(shards, shard_order(sources), positions, plan["whole"], pad_id=pad_id,
                                            temperature=temperature).tensors()
            except (RayActorError, ValueError) as err:  # ValueError: get_actor of a dead worker's name
                lost = f"{type(err).__name__}: {err}"
        losses = _all_gather(lost)
        if not any(losses):
            break
        if workers is not None:  # the leader replaces the dead workers, then everyone asks again
            for k in range(workers.count):
                if not _alive(workers.handles[k]):
                    workers._replace(k, next(x for x in losses if x))
    return share_with_peers(tensors if head else None, peers)


def _alive(handle) -> bool:
    import ray
    from ray.exceptions import RayActorError

    try:
        ray.get(handle.pid.remote(), timeout=60)
        return True
    except RayActorError:
        return False


def _all_gather(obj) -> list:
    import torch.distributed as dist

    from megatron_agent.platform.distributed import control_group

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=control_group())
    return out
