"""Ray bundles for trainer ranks and engines, by hand."""

from __future__ import annotations

from megatron_agent.placement import engine_bundles, trainer_bundles
from megatron_agent.run_config import RunConfig


def config(**engine) -> RunConfig:
    run = RunConfig()
    run.placement.trainer_ranks, run.placement.cpus_per_trainer = 2, 3
    for key, value in engine.items():
        setattr(run.engine, key, value)
    return run


def test_disaggregated_engines_reserve_a_thread_per_rank_and_their_gpus():
    run = config(num_engines=2, threads_per_engine=2, ranks_per_engine=3, gpus_per_engine=4)
    assert trainer_bundles(run) == [{"CPU": 3}, {"CPU": 3}]
    assert engine_bundles(run) == [{"CPU": 6, "GPU": 4}, {"CPU": 6, "GPU": 4}]


def test_colocated_engines_join_the_trainer_bundles_and_a_given_fleet_takes_none():
    run = config(num_engines=3, threads_per_engine=1, ranks_per_engine=2)
    run.placement.colocate = True
    assert trainer_bundles(run) == [{"CPU": 7}, {"CPU": 5}]
    assert engine_bundles(run) == []
    fleet = config(urls=("http://10.0.0.5:30000",))
    assert engine_bundles(fleet) == []
