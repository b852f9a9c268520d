"""Ray bundles for trainer ranks and engines, and what each actor asks of its bundle, by hand.

Ray's rule (ray 2.60, placement groups): an actor scheduled into bundle i is given a part
of that bundle's resources, so the requests of the actors placed in one bundle must add up
to no more than the bundle; an actor asking for any part of a bundle's GPU is given that
GPU (CUDA_VISIBLE_DEVICES). An actor that does not fit waits forever: colocated engines
asking for a GPU that the trainer actor holds whole hung the run."""

from __future__ import annotations

import pytest

from megatron_agent.launcher import EngineActor, TrainerRankActor
from megatron_agent.placement import (
    colocated_engine_bundles,
    colocated_engine_devices,
    engine_actor_resources,
    engine_bundles,
    trainer_actor_resources,
    trainer_bundles,
)
from megatron_agent.run_config import RunConfig


def config(**engine) -> RunConfig:
    run = RunConfig()
    run.placement.trainer_ranks, run.placement.cpus_per_trainer = 2, 3
    for key, value in engine.items():
        setattr(run.engine, key, value)
    return run


def gpu_config(trainer_ranks: int, **engine) -> RunConfig:
    """Colocated on GPUs under Ray: a trainer rank per GPU, SGLang engines of
    `gpus_per_engine` GPUs (its TP size) among them."""
    run = RunConfig()
    p = run.placement
    p.launcher, p.colocate, p.trainer_ranks, p.cpus_per_trainer, p.gpus_per_trainer = "ray", True, trainer_ranks, 1, 1
    run.engine.server = "sglang"
    for key, value in engine.items():
        setattr(run.engine, key, value)
    return run


def test_disaggregated_engines_reserve_a_thread_per_rank_and_their_gpus():
    run = config(num_engines=2, threads_per_engine=2, ranks_per_engine=3, gpus_per_engine=4)
    assert trainer_bundles(run) == [{"CPU": 3}, {"CPU": 3}]
    assert engine_bundles(run) == [{"CPU": 6, "GPU": 4}, {"CPU": 6, "GPU": 4}]
    assert engine_actor_resources(run.engine, shares_trainer_gpu=False) == {"num_cpus": 6, "num_gpus": 4}


def test_colocated_engines_join_the_trainer_bundles_and_a_given_fleet_takes_none():
    run = config(num_engines=3, threads_per_engine=1, ranks_per_engine=2)
    run.placement.colocate = True
    assert trainer_bundles(run) == [{"CPU": 7}, {"CPU": 5}]
    assert engine_bundles(run) == []
    fleet = config(urls=("http://10.0.0.5:30000",))
    assert engine_bundles(fleet) == []


def placed(run: RunConfig) -> list[list[dict]]:
    """The requests of the actors `_launch_on_ray` puts in each trainer bundle: trainer
    rank i in bundle i, each engine's actor in the first bundle it spans."""
    per_bundle = [[trainer_actor_resources(run)] for _ in range(run.placement.trainer_ranks)]
    for spanned in colocated_engine_bundles(run):
        per_bundle[spanned[0]].append(engine_actor_resources(run.engine, shares_trainer_gpu=True))
    return per_bundle


@pytest.mark.parametrize("num_engines,gpus_per_engine", [(4, 1), (2, 2), (1, 4)])
def test_colocated_engine_actors_fit_beside_the_trainer_on_its_gpu(num_engines, gpus_per_engine):
    run = gpu_config(4, num_engines=num_engines, gpus_per_engine=gpus_per_engine, threads_per_engine=2)
    engine_cpus = 2  # threads_per_engine x ranks_per_engine
    hosts = range(0, 4, gpus_per_engine)  # engine k's actor: bundle k * gpus_per_engine
    assert trainer_bundles(run) == [{"CPU": 1 + (engine_cpus if i in hosts else 0), "GPU": 1} for i in range(4)]
    assert colocated_engine_bundles(run) == [list(range(k * gpus_per_engine, (k + 1) * gpus_per_engine))
                                             for k in range(num_engines)]
    for bundle, requests in zip(trainer_bundles(run), placed(run)):
        for resource, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
            assert sum(r[key] for r in requests) <= bundle.get(resource, 0), (bundle, requests)
        assert all(r["num_gpus"] > 0 for r in requests)  # each is given the bundle's GPU
    assert all(0 < r["num_gpus"] < 1 for requests in placed(run) for r in requests)


def test_cpu_colocation_keeps_whole_requests_and_engines_share_bundles_round_robin():
    run = config(num_engines=3, threads_per_engine=1, ranks_per_engine=2)
    run.placement.colocate = True
    assert colocated_engine_bundles(run) == [[0], [1], [0]]
    assert trainer_actor_resources(run) == {"num_cpus": 3, "num_gpus": 0}
    for bundle, requests in zip(trainer_bundles(run), placed(run)):
        assert sum(r["num_cpus"] for r in requests) <= bundle["CPU"]


def test_an_engine_of_several_gpus_is_told_the_gpus_of_the_bundles_it_spans():
    run = gpu_config(4, num_engines=2, gpus_per_engine=2)
    node = "10.0.0.1"
    devices = [(node, ["4"]), (node, ["5"]), (node, ["6"]), (node, ["7"])]  # what Ray gave each trainer rank
    assert colocated_engine_devices(run, devices) == ["4,5", "6,7"]
    split = [(node, ["6"]), ("10.0.0.2", ["0"]), (node, ["7"]), (node, ["0"])]
    with pytest.raises(RuntimeError, match=r"colocated engine 0 would span trainer ranks \[0, 1\].*2 nodes"):
        colocated_engine_devices(run, split)


def test_engine_urls_name_the_node_by_rays_address_not_the_hosts_file(monkeypatch, tmp_path):
    """An engine bound to 0.0.0.0 in a Ray actor: its URL names the node by the IP Ray
    knows it by, not by its host name looked up in /etc/hosts (127.0.1.1 on Debian-style
    hosts files, which no other node reaches). Nothing is started: Popen and the health
    check are stand-ins."""
    import socket
    import subprocess

    import ray.util

    import rollout.engine_launch as engine_launch
    from rollout.engine_launch import EngineConfig

    monkeypatch.setattr(socket, "gethostname", lambda: "worker-7")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.7")
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kwargs: started.append((cmd, kwargs["env"])) or object())
    monkeypatch.setattr(engine_launch, "wait_healthy", lambda engine, timeout_s: True)
    config = EngineConfig(server="sglang", host="0.0.0.0", auth_token="k", gpus_per_engine=2)
    url = EngineActor().start(config, str(tmp_path / "model"), str(tmp_path / "logs"), 0, "4,5")
    assert url.startswith("http://10.0.0.7:")
    cmd, env = started[0]
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5" and "--enable-memory-saver" in cmd


@pytest.fixture
def ray_with_two_fake_gpus():
    """A local Ray instance that counts 2 GPUs (Ray only counts them: none are needed)."""
    import ray

    ray.init(address="local", num_cpus=3, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_schedules_the_colocated_actors_and_gives_both_the_bundles_gpu(ray_with_two_fake_gpus):
    """Two trainer ranks and one engine of TP 2 on 2 GPUs: the placement group of
    `trainer_bundles`, every actor with the request `_launch_on_ray` gives it (the engine's
    stand-in is a second TrainerRankActor asking for the engine's resources). All are
    scheduled; the engine's actor has the GPU of the trainer rank it sits with and is told
    both ranks' GPUs. With whole-GPU requests the engine's actor never started."""
    ray = ray_with_two_fake_gpus
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    run = gpu_config(2, num_engines=1, gpus_per_engine=2, threads_per_engine=1)
    group = placement_group(trainer_bundles(run), strategy="STRICT_PACK")
    assert ray.get(group.ready(), timeout=60) is not None
    remote = ray.remote(TrainerRankActor)

    def in_bundle(i: int, wants: dict):
        return remote.options(**wants, scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()

    trainers = [in_bundle(i, trainer_actor_resources(run)) for i in range(2)]
    engine = in_bundle(colocated_engine_bundles(run)[0][0], engine_actor_resources(run.engine, shares_trainer_gpu=True))
    devices = ray.get([a.device.remote() for a in trainers], timeout=60)
    engine_device = ray.get(engine.device.remote(), timeout=60)
    assert sorted(gpu for _, gpus in devices for gpu in gpus) == ["0", "1"]
    assert engine_device == devices[0]
    assert colocated_engine_devices(run, devices) == [f"{devices[0][1][0]},{devices[1][1][0]}"]
