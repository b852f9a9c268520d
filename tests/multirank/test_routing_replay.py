"""Routing replay (algorithm.routing_replay=rollout) on the tiny MoE, against transformers with
its routers forced to the same expert ids, at TP=1 and across layouts.

The routes are drawn at random (two distinct experts of four per token and layer), so most
differ from the model's natural top-2: a trainer that ignored them, or gave a router another
token's ids, would compute other logprobs. One 2-rank job runs every layout on one batch:
- every router's routing map is exactly the given ids, on every rank (a forward hook);
- the routing watch counts, per sample, the decisions the trainer's own top-k would make
  otherwise, as transformers' routers on the same forced pass count them;
- the logprobs equal transformers' teacher-forced ones with the same forced routes (1e-4),
  and TP=1's at TP=2 + SP + EP=2 and PP=2 (1e-5);
- one update gives TP=1's new weights at the other layouts (1e-5);
- routing_replay=recompute's record of a pass is the model's own routing (transformers').
"""

from __future__ import annotations

import pytest
import torch

from megatron_agent.platform.launch import run_on_ranks

pytestmark = pytest.mark.multirank

LAYOUTS = [dict(tp=2, sequence_parallel=True, ep=2, etp=1), dict(pp=2)]
TEMPERATURE = 0.9


def _batch(hf: dict):
    from megatron_agent.training.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    vocab, layers, experts, k = hf["vocab_size"], hf["num_hidden_layers"], hf["num_experts"], hf["num_experts_per_tok"]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (6, 9, 4, 7)]
    responses = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 3, 7, 4)]
    routes = [torch.rand(len(p) + len(r) - 1, layers, experts, generator=g).argsort(-1)[..., :k].to(torch.uint8).numpy()
              for p, r in zip(prompts, responses)]
    return TrainBatch.from_sequences(prompts, responses, advantages=[1.0, -0.5, 1.5, -0.8], temperature=TEMPERATURE,
                                     routed_experts=routes)


def _layout_name(layout: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in layout.items()) or "tp=1"


def _worker(model_dir: str) -> dict:
    from dataclasses import replace

    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.models import read_hf_config
    from megatron_agent.platform import (
        ParallelConfig,
        destroy_model_parallel,
        init_distributed,
        initialize_model_parallel,
        set_seed,
    )
    from megatron_agent.training.actor import Actor, ActorConfig

    hf = read_hf_config(model_dir)
    algorithm = AlgorithmConfig(use_kl_loss=False, entropy_coef=0.0, routing_replay="rollout")
    config = ActorConfig(lr=1e-3, max_tokens_per_micro_batch=32, use_distributed_optimizer=False)
    ctx = init_distributed(ParallelConfig(), seed=5)
    destroy_model_parallel()
    results = {}
    for layout in [dict()] + LAYOUTS:
        initialize_model_parallel(ParallelConfig(**layout), ctx.world_size)
        set_seed(5)
        actor = Actor(model_dir, ParallelConfig(**layout), config, algorithm)
        counts = {"mismatches": 0, "routed": 0}

        def compare(router, _inputs, output, counts=counts):  # the map it produced against the ids it was given
            ids = router.router_replay.target_topk_idx
            given = torch.zeros_like(output[1]).scatter(1, ids.to(output[1].device), True)
            counts["mismatches"] += int((given != output[1]).any(-1).sum())
            counts["routed"] += output[1].shape[0]

        # R2's record first (the same model as R2 builds, before any update): natural routing
        batch = _batch(hf)
        actor.algorithm = replace(algorithm, routing_replay="recompute")
        recorded = actor.compute_logprobs(replace(batch, routed_experts=None), with_entropy=False,
                                          record_routing=True)["routes"]
        actor.algorithm = algorithm
        hooks = [m.register_forward_hook(compare) for chunk in actor.chunks for m in chunk.modules()
                 if isinstance(m, TopKRouter)]
        out = actor.compute_logprobs(batch, with_entropy=False, watch_routing=True)
        logprobs = out["logprobs"]
        batch.old_logprobs = logprobs
        actor.update(batch)
        for hook in hooks:
            hook.remove()
        results[_layout_name(layout)] = {
            "logprobs": logprobs, "routing": out["routing"], "recorded": recorded, **counts,
            "weights": {k: v.clone() for k, v in actor.named_hf_weights()}}
        del actor
        destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def replay_results(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3_moe")
    return model_dir, run_on_ranks(_worker, 2, str(model_dir), timeout_s=600)


def _forced_routes_logprobs(model_dir, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' teacher-forced logprobs with every router returning the batch's ids
    (scores: the softmax over all experts at those ids, renormalised, as norm_topk_prob), and
    per sample the fed tokens' (token, layer) decisions where the router's own top-k differs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    routes = batch.routed_experts.long()  # [N, L-1, layers, k]
    n, width = routes.shape[:2]
    fed = torch.arange(width) < (batch.lengths[:, None] - 1)
    differ = torch.zeros(n)

    def forced(layer):
        def forward(hidden_states):
            gate = model.model.layers[layer].mlp.gate
            logits = torch.nn.functional.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)
            ids = routes[:, :, layer].reshape(-1, routes.shape[-1])
            own = logits.topk(ids.shape[1], dim=-1).indices
            differ.add_(((own.sort(-1).values != ids.sort(-1).values).any(-1).reshape(n, width) & fed).sum(-1))
            scores = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
            return logits, scores / scores.sum(-1, keepdim=True), ids
        return forward

    for layer, block in enumerate(model.model.layers):
        block.mlp.gate.forward = forced(layer)
    with torch.no_grad():
        logits = model(batch.tokens[:, :-1]).logits / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None])[..., 0], differ


def test_replayed_routing_is_the_engines_on_every_token_and_layer(replay_results):
    _, per_rank = replay_results
    for name in ["tp=1"] + [_layout_name(layout) for layout in LAYOUTS]:
        for rank in per_rank:
            assert rank[name]["routed"] > 0 and rank[name]["mismatches"] == 0, (name, rank[name])


def test_replayed_logprobs_match_transformers_with_the_same_routes_at_every_layout(replay_results):
    from megatron_agent.models import read_hf_config

    model_dir, per_rank = replay_results
    batch = _batch(read_hf_config(model_dir))
    mask = batch.response_mask.bool()
    forced, differ = _forced_routes_logprobs(model_dir, batch)
    reference = per_rank[0]["tp=1"]["logprobs"]
    assert (reference - forced)[mask].abs().max() < 1e-4
    from transformers import AutoModelForCausalLM

    natural = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = natural(batch.tokens[:, :-1]).logits / TEMPERATURE
    natural_logprobs = torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    assert (reference - natural_logprobs)[mask].abs().max() > 1e-2  # the routes changed the network
    for layout in LAYOUTS:
        for rank in per_rank:
            got = rank[_layout_name(layout)]["logprobs"]
            assert (got - reference)[mask].abs().max() < 1e-5, layout


def test_an_update_with_replay_matches_tp1_at_every_layout(replay_results):
    _, per_rank = replay_results
    reference = {}
    for rank in per_rank:
        reference.update(rank["tp=1"]["weights"])
    for layout in LAYOUTS:
        merged = {}
        for rank in per_rank:
            merged.update(rank[_layout_name(layout)]["weights"])
        assert merged.keys() == reference.keys()
        assert max(float((merged[k] - reference[k]).abs().max()) for k in merged) < 1e-5, layout


def test_the_routing_watch_counts_what_transformers_counts_at_every_layout(replay_results):
    """Per sample, the decisions where the trainer's own top-k differs from the given routes
    (most of them: the routes are random), against transformers' routers on the same forced
    pass; summed over the ranks that route a sample's tokens, the same at every layout."""
    from megatron_agent.models import read_hf_config

    model_dir, per_rank = replay_results
    hf = read_hf_config(model_dir)
    batch = _batch(hf)
    _, differ = _forced_routes_logprobs(model_dir, batch)
    decisions = (batch.lengths - 1).double() * hf["num_hidden_layers"]
    assert 0 < differ.sum() < decisions.sum()
    for name in ["tp=1"] + [_layout_name(layout) for layout in LAYOUTS]:
        for rank in per_rank:
            routing = rank[name]["routing"]
            assert torch.equal(routing[:, 1], decisions), name
            assert torch.equal(routing[:, 0], differ.double()), name


def test_the_record_for_recompute_is_the_models_own_routing_at_every_layout(replay_results):
    """routing_replay=recompute records what the old-logprob pass routed: before any update,
    transformers' own top-k of the same weights, on every fed (token, layer); unfed places
    route to 0..k-1. Assembled over TP+SP, EP and PP ranks alike."""
    from transformers import AutoModelForCausalLM

    from megatron_agent.models import read_hf_config

    model_dir, per_rank = replay_results
    batch = _batch(read_hf_config(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model(batch.tokens[:, :-1], output_router_logits=True)
    k = model.config.num_experts_per_tok
    n, width = batch.tokens.shape[0], batch.tokens.shape[1] - 1
    natural = torch.stack([logits.topk(k, dim=-1).indices.reshape(n, width, k) for logits in out.router_logits], 2)
    fed = torch.arange(width) < (batch.lengths[:, None] - 1)
    for name in ["tp=1"] + [_layout_name(layout) for layout in LAYOUTS]:
        for rank in per_rank:
            recorded = rank[name]["recorded"].long()
            assert recorded.shape == natural.shape, name
            assert torch.equal(recorded.sort(-1).values[fed], natural.sort(-1).values[fed]), name
            assert (recorded[~fed] == torch.arange(k)).all(), name
