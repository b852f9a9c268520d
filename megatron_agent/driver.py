"""The RL training loop, top to bottom.

    collect grouped episodes -> (dynamic sampling) -> logprobs -> advantages -> update
    -> weight sync -> log -> validate every N -> checkpoint every M

`train(config)` starts the trainer ranks where `config.placement` says (this process,
local processes, or Ray actors; megatron_agent/placement.py) and each rank runs
`train_rank`. The ranks run the same loop: rank 0 (the leader) also drives the rollout
engines and the environments, writes the metrics, and broadcasts each iteration's batch;
the update, the weight sync and checkpoints are collective.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from megatron_agent.algorithms import AlgorithmConfig, compute_advantages
from megatron_agent.placement import PlacementConfig
from megatron_agent.platform.parallel import ParallelConfig
from megatron_agent.training.actor import ActorConfig
from megatron_agent.weight_sync import WeightSyncConfig
from rollout.config import AgentLoopConfig, EngineConfig

log = logging.getLogger(__name__)

MAX_ENGINE_RESTARTS = 2  # per step of an iteration


@dataclass
class TinyModelConfig:
    """The model made on the spot in run_dir/model when model_dir is None."""

    family: str = "qwen3"
    preset: str = "tiny"
    num_hidden_layers: int = 2
    tokenizer: str = "words"  # "words": the 43-word job vocabulary; "bpe": byte-level BPE


@dataclass
class RunConfig:
    """The schema configs/*.yaml fill (megatron_agent.config.load_run_config); the defaults
    here are the libraries' own, the CPU main job's settings live in configs/."""

    run_dir: str = "runs/default"
    model_dir: str | None = None  # an HF model directory; None: tiny_model, made on the spot
    tiny_model: TinyModelConfig = field(default_factory=TinyModelConfig)
    env: str = "numberline"
    env_config: dict = field(default_factory=dict)  # fields of the env's config dataclass
    num_groups: int = 16
    group_size: int = 8
    iterations: int = 200
    # Stop once the 3-iteration moving average of the success rate reaches this.
    stop_success: float | None = None
    seed: int = 0
    save_every: int = 0  # iterations between checkpoints in run_dir/checkpoints (0: none)
    val_every: int = 0  # iterations between validation runs (loop.validation settings; 0: none)
    samples_every: int = 0  # iterations between writing a few episodes as text (0: none)
    # A run directory to continue from its last complete checkpoint (the same settings).
    resume: str | None = None
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: ActorConfig = field(default_factory=ActorConfig)  # the value model of algorithm=ppo (GAE)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    loop: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)


def model_dir_of(config: RunConfig) -> str:
    return config.model_dir or str(Path(config.run_dir) / "model")


def prepare_run_dir(config: RunConfig) -> None:
    """Before any rank starts: the run directory, the tiny model, the resolved config, and
    no metrics left from an earlier run in the same directory (unless resuming from it)."""
    from megatron_agent.models.tiny import write_tiny_model

    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = model_dir_of(config)
    if not (Path(model_dir) / "config.json").exists():
        tiny = config.tiny_model
        write_tiny_model(tiny.family, model_dir, preset=tiny.preset, seed=config.seed, tokenizer=tiny.tokenizer,
                         num_hidden_layers=tiny.num_hidden_layers)
    (run_dir / "config.json").write_text(json.dumps(asdict(config), indent=2, default=str))
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and not (config.resume and Path(config.resume).resolve() == run_dir.resolve()):
        metrics.unlink()


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest complete checkpoint of a run (partial ones are dot-prefixed)."""
    found = sorted(p for p in (run_dir / "checkpoints").glob("iter_*") if (p / "megatron_agent.json").is_file())
    if not found:
        raise FileNotFoundError(f"no complete checkpoint in {run_dir / 'checkpoints'} to resume from")
    return found[-1]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a row cut short by a kill
            break
    return rows


def write_sample_episodes(path: Path, episodes: list) -> None:
    """A few trajectories as a person reads them: each step's prompt, response, reward."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for steps in episodes:
        if not steps:
            continue
        first = steps[0]
        lines.append(f"=== episode traj {first.traj_id} (group {first.group_id}, seed {first.env_seed}): "
                     f"return {first.episode_return:g}, won {steps[-1].won}, {len(steps)} steps")
        for s in steps:
            lines.append(f"--- step {s.step_index}: reward {s.reward:g}, valid {s.is_action_valid}")
            lines.append(f"observation: {s.anchor}")
            lines.append(f"response: {s.response_text!r}")
        lines.append("")
    path.write_text("\n".join(lines))


def moving_average(values: list[float], window: int = 3) -> float:
    tail = values[-window:]
    return sum(tail) / len(tail)


def rollout_seeds(config: RunConfig, iteration: int, attempt: int = 0) -> list[int]:
    """One env seed per group; dynamic sampling's extra rollouts (attempt > 0) get fresh ones."""
    tries = config.algorithm.dynamic_sampling_max_tries if config.algorithm.dynamic_sampling else 1
    first = config.seed * 1_000_003 + (iteration * tries + attempt) * config.num_groups
    return [first + g for g in range(config.num_groups)]


def train(config: RunConfig, on_iteration=None) -> list[dict]:
    """Run the training; return one metrics dict per iteration (also passed to
    `on_iteration` as it lands in run_dir/metrics.jsonl)."""
    from megatron_agent.placement import launch

    prepare_run_dir(config)
    return launch(config, on_iteration)


def train_rank(config: RunConfig, on_iteration=None, launch_engines=None) -> list[dict]:
    """The loop on one trainer rank. `launch_engines(engine_config, model_dir, log_dir)`
    returns started engines (objects with `url` and `stop()`); by default embedded engine
    processes on this machine. Returns the metrics on rank 0, [] on the others."""
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from envs import EnvManager
    from megatron_agent.platform import control_group, init_distributed
    from megatron_agent.training.actor import Actor
    from megatron_agent.training.critic import Critic
    from megatron_agent.weight_sync import WeightSync, WeightSyncError
    from rollout.agent_loop import run_validation
    from rollout.engine_client import EngineError
    from rollout.engine_launch import engine_client, launch_embedded_engines, stop_engines

    launch_engines = launch_engines or launch_embedded_engines
    run_dir, model_dir = Path(config.run_dir), model_dir_of(config)
    ctx = init_distributed(config.parallel, seed=config.seed)
    leader = ctx.rank == 0

    def from_leader(obj):
        """The leader's `obj` on every rank."""
        if ctx.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=control_group())
        return box[0]

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    actor = Actor(model_dir, ctx.parallel, config.actor, config.algorithm)
    critic = (Critic(model_dir, ctx.parallel, config.critic, config.algorithm)
              if config.algorithm.advantage_estimator == "gae" else None)
    history, first_iteration = [], 0
    if config.resume:
        checkpoint = latest_checkpoint(Path(config.resume))
        actor.load(checkpoint)
        if critic is not None:
            critic.load(checkpoint.parent.parent / "critic_checkpoints" / checkpoint.name)
        first_iteration = actor.step
        history = [row for row in read_metrics(Path(config.resume)) if row["iteration"] < first_iteration]
        log.info("resumed from %s at iteration %d", checkpoint, first_iteration)

    engines, client, envs, val_envs, metrics_file, tensorboard = [], None, None, None, None, None
    try:
        if leader:
            metrics_file = (run_dir / "metrics.jsonl").open("w")
            for row in history:
                metrics_file.write(json.dumps(row) + "\n")
            from torch.utils.tensorboard import SummaryWriter

            tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
            engines = [] if config.engine.urls else launch_engines(config.engine, model_dir, run_dir / "engines")
            envs = EnvManager(config.env, config.env_config, num_groups=config.num_groups,
                              group_size=config.group_size, backend="inline")
            if config.val_every:
                val_envs = EnvManager(config.env, config.env_config, group_size=1, backend="inline",
                                      num_groups=config.loop.validation.num_episodes)
        urls = from_leader(list(config.engine.urls) or [e.url for e in engines])
        if leader:
            client = engine_client(config.engine, urls)
        sync = WeightSync(actor, urls, config.weight_sync)
        if first_iteration:
            sync.sync(version=first_iteration)  # the engines start from the model on disk
        successes = [row["train/success_rate"] for row in history]
        start = time.perf_counter()
        restarts = 0

        def with_engine_restarts(step, version: int, is_weight_sync: bool = False):
            """Run `step()` on the leader (rollout, validation), or the weight sync itself on
            every rank. When the engines fail, the leader restarts them (embedded engines only:
            a configured SGLang fleet is the cluster's to restart), every rank points the
            weight sync at the new ones and sends the current weights, and `step` runs again."""
            nonlocal engines, client, restarts
            resync = False
            for attempt in range(MAX_ENGINE_RESTARTS + 1):
                result, error = None, None
                try:
                    if resync and version and not is_weight_sync:  # the step itself re-sends them
                        sync.sync(version=version)
                    if is_weight_sync or leader:
                        result = step()
                except (EngineError, WeightSyncError) as err:  # a weight sync fails on every rank
                    error = f"{type(err).__name__}: {err}"
                error = error if is_weight_sync else from_leader(error)
                if error is None:
                    return result
                if attempt == MAX_ENGINE_RESTARTS or config.engine.urls:
                    raise EngineError(error)
                if leader:
                    log.warning("rollout engines failed (%s); restarting them (weights version %d) and retrying",
                                error.splitlines()[0], version)
                    stop_engines(engines)
                    client.close()
                    engines = launch_engines(config.engine, model_dir, run_dir / "engines")
                    client = engine_client(config.engine, [e.url for e in engines])
                sync.set_engines(from_leader([e.url for e in engines]))
                resync, restarts = True, restarts + 1

        def collect_batch(iteration):  # the client may be replaced by a restart
            return collect_samples(config, envs, client, tokenizer, iteration)

        def validate():
            return run_validation(val_envs, client, tokenizer, config.loop)

        for iteration in range(first_iteration, config.iterations):
            iteration_start, timing = time.perf_counter(), {}
            t = time.perf_counter()
            collected = with_engine_restarts(partial(collect_batch, iteration), iteration)
            if leader:
                samples, rollout_metrics, episodes = collected
                batch = train_batch(samples, tokenizer, config)
            batch = from_leader(batch if leader else None)
            timing["time/rollout"] = time.perf_counter() - t

            t = time.perf_counter()
            values = critic.compute_values(batch) if critic is not None else None
            if leader:
                step_samples = samples.step_samples()
                if values is not None:
                    step_samples = dataclasses.replace(step_samples, values=values.numpy())
                advantages = compute_advantages(step_samples, config.algorithm)
            advantages = from_leader(advantages if leader else None)
            batch.advantages = torch.as_tensor(advantages.advantages, dtype=torch.float32)
            timing["time/advantages"] = time.perf_counter() - t

            t = time.perf_counter()
            if config.algorithm.use_kl_loss and actor.reference is not None:
                batch.ref_logprobs = actor.compute_logprobs(batch, reference=True, with_entropy=False)["logprobs"]
            if config.actor.ppo_epochs > 1 or config.actor.num_mini_batches > 1:
                batch.old_logprobs = actor.compute_logprobs(batch, with_entropy=False)["logprobs"]
            timing["time/logprobs"] = time.perf_counter() - t

            t = time.perf_counter()
            metrics = actor.update(batch)
            timing["time/update"] = time.perf_counter() - t
            if critic is not None:
                t = time.perf_counter()
                metrics.update(critic.update(batch, returns=advantages.returns, old_values=values))
                timing["time/critic_update"] = time.perf_counter() - t

            t = time.perf_counter()
            metrics.update(with_engine_restarts(partial(sync.sync, version=iteration + 1), iteration + 1,
                                                is_weight_sync=True))
            timing["time/weight_sync"] = time.perf_counter() - t
            if config.val_every and (iteration + 1) % config.val_every == 0:
                t = time.perf_counter()
                validation = with_engine_restarts(validate, iteration + 1)
                if leader:
                    metrics.update(validation.metrics)
                timing["time/validation"] = time.perf_counter() - t
            if config.save_every and (iteration + 1) % config.save_every == 0:
                t = time.perf_counter()
                name = f"iter_{iteration + 1:06d}"
                if critic is not None:  # first: a complete actor checkpoint implies a complete critic one
                    critic.save(run_dir / "critic_checkpoints" / name)
                actor.save(run_dir / "checkpoints" / name)
                timing["time/checkpoint"] = time.perf_counter() - t

            stop = False
            if leader:
                if config.samples_every and iteration % config.samples_every == 0:
                    write_sample_episodes(run_dir / "samples" / f"iter_{iteration:06d}.txt", episodes[:4])
                iteration_seconds = time.perf_counter() - iteration_start
                timing["time/other"] = iteration_seconds - sum(timing.values())
                # parts of time/rollout (its rest: prompts, tokenizing, the loop itself)
                timing["time/generate"] = rollout_metrics.pop("rollout/time_generate_s")
                timing["time/env"] = rollout_metrics.pop("rollout/time_env_s")
                rollout_metrics.pop("rollout/time_s")  # time/rollout
                overhead = rollout_metrics.pop("rollout/overhead_share")
                timing["time/iteration"] = iteration_seconds
                tokens = float(batch.lengths.sum())
                successes.append(rollout_metrics["rollout/success_rate"])
                row = {"iteration": iteration, "time/elapsed": time.perf_counter() - start,
                       **{k.replace("rollout/", "train/", 1): v for k, v in rollout_metrics.items()},
                       **metrics, **timing, "train/success_moving_average": moving_average(successes),
                       "perf/tokens_per_s": tokens / iteration_seconds,
                       "perf/update_tokens_per_s": tokens / timing["time/update"],
                       "perf/rollout_overhead_share": overhead,
                       "engine/restarts": restarts}
                history.append(row)
                write_row(metrics_file, tensorboard, row)
                if on_iteration is not None:
                    on_iteration(row)
                stop = config.stop_success is not None and row["train/success_moving_average"] >= config.stop_success
            if from_leader(stop):
                break
    finally:
        if metrics_file is not None:
            metrics_file.close()
            tensorboard.close()
        if client is not None:
            client.close()
        stop_engines(engines)
        for manager in (envs, val_envs):
            if manager is not None:
                manager.close()
    return history if leader else []


def collect_samples(config: RunConfig, envs, client, tokenizer, iteration: int):
    """Roll out `num_groups` groups (more with dynamic sampling: groups whose episodes all
    scored the same are dropped and new ones rolled until the batch is full or the tries
    run out); return the step samples (a SampleBatch), the first rollout's episode metrics
    and its episodes."""
    import numpy as np

    from megatron_agent.algorithms import enough_groups, filter_zero_variance_groups
    from rollout.agent_loop import run_rollout
    from rollout.samples import collate

    kept, metrics, episodes, tries, dropped = [], None, None, 0, 0
    while True:
        rollout = run_rollout(envs, client, tokenizer, config.loop, rollout_seeds(config, iteration, tries),
                              rollout_index=iteration)
        if metrics is None:
            metrics, episodes = rollout.metrics, rollout.episodes
        samples = [dataclasses.replace(s, group_id=s.group_id + tries * config.num_groups,
                                       traj_id=s.traj_id + tries * config.num_groups * config.group_size)
                   for s in rollout.samples]
        tries += 1
        if not config.algorithm.dynamic_sampling:
            kept = samples
            break
        scores = np.array([s.episode_return for s in samples])
        keep = filter_zero_variance_groups(scores, [s.group_id for s in samples])
        dropped += keep.num_dropped
        kept += [s for s, k in zip(samples, keep.keep) if k]
        groups = sorted({s.group_id for s in kept})
        if enough_groups(len(groups), config.num_groups, tries, config.algorithm.dynamic_sampling_max_tries):
            chosen = set(groups[:config.num_groups])
            kept = [s for s in kept if s.group_id in chosen]
            break
    if config.algorithm.dynamic_sampling:
        metrics = {**metrics, "rollout/dynamic_sampling_tries": float(tries),
                   "rollout/dynamic_sampling_dropped_groups": float(dropped),
                   "rollout/dynamic_sampling_kept_groups": float(len({s.group_id for s in kept}))}
        if not kept:
            raise RuntimeError(f"dynamic sampling: every group of {tries} rollouts had equal episode scores; "
                               "nothing to train on (raise algorithm.dynamic_sampling_max_tries)")
    return collate(kept), metrics, episodes


def train_batch(samples, tokenizer, config: RunConfig):
    """Token ids, response masks and rollout logprobs of the step samples (advantages are
    set once the critic, if any, has valued them)."""
    from megatron_agent.training.batch import TrainBatch

    return TrainBatch.from_sequences(samples.prompt_ids, samples.response_ids, pad_id=tokenizer.pad_token_id,
                                     rollout_logprobs=samples.rollout_logprobs,
                                     temperature=config.loop.sampling.temperature)


def write_row(metrics_file, tensorboard, row: dict) -> None:
    metrics_file.write(json.dumps(row) + "\n")
    metrics_file.flush()
    for key, value in row.items():
        if key != "iteration" and isinstance(value, int | float):
            tensorboard.add_scalar(key, value, row["iteration"])
