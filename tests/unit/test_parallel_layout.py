"""A bad parallel layout fails before any process group or model exists, naming the numbers."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_agent.models.tiny import hf_config_for
from megatron_agent.models.transformer_config import transformer_config_from_hf, validate_layout_for_model
from megatron_agent.platform import ParallelConfig, ParallelLayoutError, init_distributed


@pytest.mark.parametrize(
    "layout, world, dp",
    [(dict(), 1, 1), (dict(tp=2), 4, 2), (dict(tp=2, pp=2), 8, 2), (dict(ep=2), 2, 2), (dict(pp=2, vpp=2), 2, 1)],
)
def test_data_parallel_is_derived(layout, world, dp):
    assert ParallelConfig(**layout).validate(world) == dp


@pytest.mark.parametrize(
    "layout, world, message",
    [
        (dict(tp=2, pp=2), 6, "tp*pp*cp = 2*2*1 = 4 does not divide the world size 6"),
        (dict(tp=3, pp=2), 8, "tp*pp*cp = 3*2*1 = 6 does not divide the world size 8"),
        (dict(cp=2), 2, "parallel.cp=2: context parallelism is not supported; set parallel.cp=1"),
        (dict(tp=2, cp=2), 8, "parallel.sequence_parallel=true"),  # what to use instead
        (dict(ep=3), 4, "etp*ep*pp = 1*3*1 = 3 does not divide the world size 4"),
        (dict(tp=2, ep=2, etp=2), 2, "etp*ep*pp = 2*2*1 = 4 does not divide the world size 2"),
        (dict(vpp=2), 2, "parallel.vpp=2 needs pipeline parallelism, but pp=1"),
        (dict(tp=0), 1, "parallel.tp=0 must be >= 1"),
        (dict(sequence_parallel=True), 1, "sequence_parallel needs tp > 1"),
    ],
)
def test_layout_errors_name_the_numbers(layout, world, message):
    with pytest.raises(ParallelLayoutError) as err:
        ParallelConfig(**layout).validate(world)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "family, overrides, layout, message",
    [
        ("qwen3", {}, dict(tp=8), "num_attention_heads=4 is not divisible by tp=8"),
        ("qwen3", {}, dict(tp=4), "num_key_value_heads=2 is not divisible by tp=4"),
        ("qwen3", {}, dict(pp=3), "num_hidden_layers=4 is not divisible by pp*vpp = 3*1 = 3"),
        ("qwen3", {}, dict(pp=2, vpp=4), "num_hidden_layers=4 is not divisible by pp*vpp = 2*4 = 8"),
        ("qwen3", {}, dict(ep=2), "ep=2 but the model has no experts"),
        ("qwen3_moe", {}, dict(ep=3), "num_experts=4 is not divisible by ep=3"),
        ("qwen3_moe", {}, dict(tp=2), "set parallel.sequence_parallel=true"),
        ("llama", {"intermediate_size": 130}, dict(tp=4), "num_attention_heads=6 is not divisible by tp=4"),
        ("llama", {"intermediate_size": 130, "num_key_value_heads": 4}, dict(tp=4), "intermediate_size=130"),
    ],
)
def test_model_does_not_fit_layout(family, overrides, layout, message):
    hf = dict(hf_config_for(family, "tiny", **overrides), model_type=family)
    if family == "llama" and "num_key_value_heads" not in overrides:
        hf["num_attention_heads"] = 6  # 6 heads do not split over tp=4
    with pytest.raises(ParallelLayoutError) as err:
        validate_layout_for_model(hf, ParallelConfig(**layout))
    assert message in str(err.value)
    # Building the Megatron config goes through the same check first.
    with pytest.raises(ParallelLayoutError):
        transformer_config_from_hf(hf, ParallelConfig(**layout))


def test_context_parallelism_is_refused_before_any_process_starts(monkeypatch):
    # RunConfig validates the layout at config time; init_distributed checks it again
    # before it creates a process group.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ParallelLayoutError, match="context parallelism is not supported"):
        init_distributed(ParallelConfig(cp=2))
    assert not dist.is_initialized()
    assert ParallelConfig(cp=1).validate(2) == 2


def test_init_distributed_checks_before_creating_groups(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ParallelLayoutError, match="does not divide the world size 4"):
        init_distributed(ParallelConfig(tp=3))
    assert not dist.is_initialized()
