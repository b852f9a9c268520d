"""The routes' layout rules of training/routing_replay.py, on ids that encode where they came from."""

import pytest
import torch

from megatron_agent.training.routing_replay import pad_routes, router_ids


def _routes(b=2, s=4, layers=3, k=2):
    """id = 100 b + 10 s + layer in slot 0, and + 1 in slot 1: every entry says its place."""
    bi, si, li = torch.meshgrid(torch.arange(b), torch.arange(s), torch.arange(layers), indexing="ij")
    first = 100 * bi + 10 * si + li
    return torch.stack([first, first + 1], dim=-1)


def test_a_router_reads_its_layer_in_its_token_order():
    # the router's tokens are [s, b] flattened s-major: (s0 b0), (s0 b1), (s1 b0), ...
    ids = router_ids(_routes(), 2)
    assert ids[:, 0].tolist() == [2, 102, 12, 112, 22, 122, 32, 132]
    assert ids[:, 1].tolist() == [3, 103, 13, 113, 23, 123, 33, 133]
    assert ids.dtype == torch.int64


def test_sequence_parallel_ranks_take_contiguous_blocks_of_the_sequence():
    # TP rank r holds positions [r s/2, (r+1) s/2) of every row (megatron's first-dim split)
    rank0 = router_ids(_routes(), 1, tp_rank=0, tp_size=2, sequence_parallel=True)
    rank1 = router_ids(_routes(), 1, tp_rank=1, tp_size=2, sequence_parallel=True)
    assert rank0[:, 0].tolist() == [1, 101, 11, 111]
    assert rank1[:, 0].tolist() == [21, 121, 31, 131]
    # without sequence parallelism every TP rank routes the whole sequence
    assert router_ids(_routes(), 1, tp_rank=1, tp_size=2).shape == (8, 2)


def test_padding_columns_route_to_distinct_experts():
    routes = _routes().to(torch.int16)
    padded = pad_routes(routes, 6)
    assert padded.shape == (2, 6, 3, 2) and padded.dtype == torch.int16
    assert torch.equal(padded[:, :4], routes)
    assert padded[:, 4:].reshape(-1, 2).tolist() == [[0, 1]] * 12
    assert pad_routes(routes, 4) is routes


def test_replay_needs_an_moe_model():
    from megatron_agent.models.tiny import hf_config_for
    from megatron_agent.models.transformer_config import transformer_config_from_hf
    from megatron_agent.platform import ParallelConfig

    hf = dict(hf_config_for("qwen3"), model_type="qwen3")
    with pytest.raises(ValueError, match="routing replay needs an MoE model"):
        transformer_config_from_hf(hf, ParallelConfig(), routing_replay=True)


def test_routes_are_asked_of_an_moe_model_only():
    from megatron_agent.run_config import ConfigError, load_run_config

    for setting in ("algorithm.routing_replay=rollout", "engine.return_routed_experts=true"):
        with pytest.raises(ConfigError, match=f"{setting}.*has no experts"):
            load_run_config([setting])
    assert load_run_config(["model=tiny-moe", "algorithm.routing_replay=rollout"]).engine.return_routed_experts
    with pytest.raises(ConfigError, match="actor.ppo_epochs=1 and actor.num_mini_batches=1"):
        load_run_config(["model=tiny-moe", "algorithm.routing_replay=recompute"])
    assert not load_run_config(["model=tiny-moe", "algorithm.routing_replay=recompute",
                                "actor.ppo_epochs=2"]).engine.return_routed_experts
