"""The RL training loop, top to bottom.

    collect grouped episodes -> (dynamic sampling) -> advantages -> logprobs (served vs
    trained check) -> update
    -> weight sync -> validate every N -> checkpoint every M -> log

`train(config)` starts the trainer ranks where `config.placement` says (this process,
local processes, or Ray actors: launcher.py) and each rank runs `train_rank`. The ranks
run the same loop: rank 0 (the leader) also drives the rollout engines and the
environments, computes the advantages over the whole batch, writes the metrics, and sends
each data-parallel rank its shard of the batch (training/batch.py); the update, the
weight sync and checkpoints are collective. With `training.mode=overlap`, the next iteration's
rollout runs while this one trains (rollout_ahead.py); with `async`, the workers play groups
without end and each iteration takes finished ones (rollout_stream.py). The pieces: samples.py (episodes
to batches), engine_fleet.py (engines, restarts, weight sync), run_dir.py (the files),
iteration_metrics.py (the metrics row).
"""

from __future__ import annotations

import logging
import pickle
import time
from pathlib import Path

from megatron_agent.episode_page import episode_records
from megatron_agent.iteration_metrics import PhaseTimer, iteration_row
from megatron_agent.launcher import launch
from megatron_agent.progress import ProgressReporter, progress_path
from megatron_agent.rollout_ahead import RolloutAhead
from megatron_agent.rollout_stream import RolloutStream
from megatron_agent.run_config import ConfigError, RunConfig, env_copies_memory_problem
from megatron_agent.run_dir import (
    MetricsLog,
    actor_checkpoint_dir,
    checkpoint_name,
    critic_checkpoint_dir,
    engine_model_dir_of,
    latest_checkpoint,
    model_dir_of,
    prepare_run_dir,
    read_metrics,
    rollout_ahead_file,
    write_sample_episodes,
)
from megatron_agent.trackers import open_trackers

log = logging.getLogger(__name__)


def train(config: RunConfig, on_iteration=None, on_progress=None) -> list[dict]:
    """Run the training; return one metrics dict per iteration (also passed to
    `on_iteration` as it lands in run_dir/metrics.jsonl). `on_progress(progress)`: where
    the run is inside an iteration (megatron_agent/progress.py), a few times a second."""
    prepare_run_dir(config)
    progress_path(config.run_dir).unlink(missing_ok=True)  # an earlier run's, in the same directory
    return launch(config, train_rank, on_iteration, on_progress)


def first_iteration(config: RunConfig) -> int:
    """The iteration the run starts at: 0, or with `resume` the step of its last complete
    checkpoint (FileNotFoundError when it has none; ConfigError when it holds LoRA adapters
    of other settings, or none where the run has some)."""
    from megatron_agent.models.checkpoint import read_mcore_metadata
    from megatron_agent.models.lora import lora_mismatch
    from megatron_agent.run_config import ConfigError

    if not config.resume:
        return 0
    checkpoint = latest_checkpoint(Path(config.resume))
    metadata = read_mcore_metadata(checkpoint)
    mismatch = lora_mismatch(str(checkpoint), metadata.get("lora"), config.actor.lora)
    if mismatch:  # before any process starts
        raise ConfigError(mismatch)
    return int(metadata["step"])


def train_rank(config: RunConfig, on_iteration=None, launch_engines=None, on_progress=None) -> list[dict]:
    """The loop on one trainer rank. `launch_engines(engine_config, model_dir, log_dir)`
    returns started engines (objects with `url` and `stop()`); by default embedded engine
    processes on this machine. Rank 0 reports its progress to `on_progress` and to
    run_dir/progress.json. Returns the metrics on rank 0, [] on the others."""
    import torch
    from transformers import AutoTokenizer

    from megatron_agent.engine_fleet import EngineFleet
    from megatron_agent.platform import from_leader, init_distributed
    from megatron_agent.rollout_workers import RolloutWorkers
    from megatron_agent.training.actor import Actor
    from megatron_agent.training.batch import gather_rows, scatter_rows
    from megatron_agent.training.checks import batch_mismatch_by_turn, batch_rollout_gap, served_vs_trained
    from megatron_agent.training.critic import Critic
    from megatron_agent.worker_batches import fetch_batch
    from rollout.agent_loop import run_validation
    from rollout.vision import load_image_processor

    run_dir, model_dir = Path(config.run_dir), model_dir_of(config)
    ctx = init_distributed(config.parallel, seed=config.seed)
    leader = ctx.rank == 0
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = load_image_processor(model_dir)  # None: a text model
    actor = Actor(model_dir, ctx.parallel, config.actor, config.algorithm)
    critic = (Critic(model_dir, ctx.parallel, config.critic, config.algorithm)
              if config.algorithm.advantage_estimator == "gae" else None)
    history, first_iteration = resume(config, actor, critic)
    dp = ctx.data_parallel_size
    reporter = ProgressReporter(run_dir, config.iterations, first_iteration, on_progress) if leader else None

    def phase(name: str):
        """A phase of the iteration: timed, and shown as the run's progress."""
        if reporter is not None:
            reporter.phase(iteration, name)
        return timer.phase(name)

    def shown_as(label: str):
        return reporter.rollout(label) if reporter is not None else None

    fleet = workers = val_envs = metrics_log = trackers = None
    try:
        fleet = EngineFleet(config, engine_model_dir_of(config), actor, leader=leader, launch_engines=launch_engines)
        if leader:
            metrics_log = MetricsLog(run_dir, history, tensorboard="tensorboard" in config.logging.backends)
            trackers = open_trackers(config)  # W&B, MLflow: logging.backends
            refuse_copies_that_do_not_fit(config)
            workers = RolloutWorkers(config, str(model_dir), on_progress=shown_as)
            if config.val_every:
                val_envs = env_manager(config, config.loop.validation.num_episodes, 1)
        if config.training.mode == "async":
            rollouts = RolloutStream(fleet, workers)
        else:
            rollouts = RolloutAhead(fleet, lambda client, i: workers.collect(
                                        i, client.urls, keep_episodes=4 if samples_due(config, i) else 0),
                                    leader=leader, overlap=config.training.mode == "overlap")
        # the engines start from the model on disk; adapters are synced at the start too, so that
        # the engines' version names an adapter of this run (one a running engine's older
        # version would not)
        if first_iteration or config.weight_sync.lora == "adapters":
            fleet.sync_weights(first_iteration)
        if first_iteration:
            if config.training.mode == "overlap":
                ahead = load_rollout_ahead(config, first_iteration) if leader else None
                rollouts.restore(first_iteration, workers.restore(ahead) if ahead is not None else None)
        successes = [row["train/success_rate"] for row in history]
        start = time.perf_counter()
        for iteration in range(first_iteration, config.iterations):
            timer = PhaseTimer()
            with phase("rollout"):
                collected = rollouts.take(iteration)  # the leader's (no tokens: they stay on the workers)
                if leader:  # updates between the weights that generated the samples and these
                    staleness = actor.step - collected.mean_weight_version
                fleet.release_memory()  # colocated: the engines' memory goes to the actor until the sync
                # this rank's data-parallel shard, with its advantages (but GAE's), from the workers
                batch = fetch_batch(workers, collected, dp, pad_id=tokenizer.pad_token_id,
                                    temperature=config.loop.sampling.temperature)
            rollouts.start(iteration + 1)  # overlap: on the engines' current weights, while this trains

            if critic is not None:
                with phase("advantages"):  # GAE: the critic's values go to the workers that hold the samples
                    values = critic.compute_values(batch)  # the shard's
                    whole_values = gather_rows(values, batch)
                    targets = None
                    if leader:
                        advantages, returns = workers.gae_advantages(collected, whole_values.numpy())
                        targets = {"advantages": torch.as_tensor(advantages, dtype=torch.float32),
                                   "returns": torch.as_tensor(returns, dtype=torch.float32)}
                    targets = scatter_rows(targets, dp, rows=collected.positions if leader else None)
                    batch.advantages = targets["advantages"]

            with phase("logprobs"):
                quantized = config.weight_sync.quantize
                # quantized rollouts: the whole batch's gap every iteration, from the old logprobs
                old, routing = {}, None  # routing: MoE with the engines' routes, where the trainer's differs
                if config.actor.ppo_epochs > 1 or config.actor.num_mini_batches > 1 or quantized:
                    old = actor.compute_logprobs(batch, with_entropy=False,
                                                 watch_routing=batch.routed_experts is not None,
                                                 record_routing=config.algorithm.routing_replay == "recompute")
                    batch.old_logprobs, routing = old["logprobs"], old.get("routing")
                # served vs trained compares the same weights: not for a rollout done ahead
                checked = (served_vs_trained(actor, batch, config.check, config.actor.params_dtype, iteration,
                                             quantize=quantized)
                           if config.check.due(iteration, first_iteration) and not rollouts.taken_ahead else {})
                if quantized:
                    checked.update(batch_rollout_gap(batch, prefix=f"{quantized}/"))
                if batch.old_logprobs is not None:
                    checked.update(batch_mismatch_by_turn(batch, config.algorithm, routing))
                if actor.has_reference:  # an active KL loss
                    batch.ref_logprobs = actor.compute_logprobs(batch, reference=True,
                                                                with_entropy=False)["logprobs"]
                if "routes" in old:  # R2: the update routes as the old policy did (the reference did not)
                    batch.routed_experts = old["routes"]

            with phase("update"):
                metrics = {**checked, **actor.update(batch)}
            if critic is not None:
                with phase("critic_update"):
                    metrics.update(critic.update(batch, returns=targets["returns"], old_values=values))

            with phase("rollout_wait"):  # for the rollout ahead (training.mode=overlap)
                rollouts.finish()
            with phase("weight_sync"):
                metrics.update(fleet.sync_weights(iteration + 1))

            if config.val_every and (iteration + 1) % config.val_every == 0:
                with phase("validation"):
                    validation = fleet.run(lambda client: run_validation(val_envs, client, tokenizer, config.loop,
                                                                         image_processor=image_processor,
                                                                         on_progress=shown_as("validation")),
                                           iteration + 1)
                    if leader:
                        metrics.update(validation.metrics)

            if config.save_every and (iteration + 1) % config.save_every == 0:
                with phase("checkpoint"):
                    ahead = rollouts.pending(iteration + 1)
                    save_checkpoint(run_dir, iteration + 1, actor, critic,
                                    workers.snapshot(ahead) if ahead is not None else None)

            stop = False
            if leader:
                if samples_due(config, iteration):
                    write_sample_episodes(run_dir, iteration, collected.episodes, episode_records(
                        collected.episodes, workers.step_advantages(collected), tokenizer, config.loop.prompt,
                        config.algorithm.similarity_threshold))
                    trackers.log_samples(iteration, collected.episodes)
                successes.append(collected.metrics["rollout/success_rate"])
                metrics["train/policy_staleness"] = staleness
                if config.training.mode == "async":
                    metrics["async/trainer_idle_fraction"] = timer.seconds.get("time/rollout", 0.0) / max(
                        sum(timer.seconds.values()), 1e-9)
                metrics["rollout/worker_restarts"] = float(workers.restarts)
                row = iteration_row(iteration, timer, collected.metrics, metrics, tokens=float(collected.tokens),
                                    elapsed=time.perf_counter() - start, successes=successes,
                                    restarts=fleet.restarts)
                history.append(row)
                metrics_log.write(row)
                trackers.log(row)
                if on_iteration is not None:
                    on_iteration(row)
                stop = config.stop_success is not None and row["train/success_moving_average"] >= config.stop_success
            if from_leader(stop):
                break
    finally:
        for part in (reporter, metrics_log, trackers, fleet, workers, val_envs):
            if part is not None:
                part.close()
    return history if leader else []


def samples_due(config: RunConfig, iteration: int) -> bool:
    """Whether a few of this iteration's episodes are written to run_dir/samples."""
    return bool(config.samples_every) and iteration % config.samples_every == 0


def refuse_copies_that_do_not_fit(config: RunConfig) -> None:
    """Under Ray the env copies run on rank 0's node, which the launcher's config check
    (run_config.validate_run_config, launcher=local) cannot see: check them here."""
    import psutil

    if config.placement.launcher != "local":
        problem = env_copies_memory_problem(config, psutil.virtual_memory().available)
        if problem:
            raise ConfigError(problem)


def env_manager(config: RunConfig, num_groups: int, group_size: int):
    from envs import EnvManager

    return EnvManager(config.env, config.env_config, num_groups=num_groups, group_size=group_size,
                      backend=config.env_backend, num_workers=config.env_workers)


def resume(config: RunConfig, actor, critic) -> tuple[list[dict], int]:
    """Load the last complete checkpoint of `config.resume` (none: a fresh start); return the
    metrics rows before it and the iteration to continue at."""
    if not config.resume:
        return [], 0
    checkpoint = latest_checkpoint(Path(config.resume))
    actor.load(checkpoint)
    if critic is not None:
        critic.load(critic_checkpoint_dir(checkpoint.parent.parent, checkpoint.name))
    history = [row for row in read_metrics(Path(config.resume)) if row["iteration"] < actor.step]
    log.info("resumed from %s at iteration %d", checkpoint, actor.step)
    return history, actor.step


def save_checkpoint(run_dir: Path, iteration: int, actor, critic, rollout_ahead=None) -> None:
    """The critic and the rollout collected ahead (the leader's `rollout_ahead`, with
    training.mode=overlap) first: a complete actor checkpoint implies complete others."""
    name = checkpoint_name(iteration)
    if rollout_ahead is not None:
        path = rollout_ahead_file(run_dir, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(rollout_ahead))
    if critic is not None:
        critic.save(critic_checkpoint_dir(run_dir, name))
    actor.save(actor_checkpoint_dir(run_dir, name))
    if rollout_ahead is not None:  # keep those of the checkpoints kept
        kept = {p.name for p in actor_checkpoint_dir(run_dir, name).parent.iterdir()}
        for stale in rollout_ahead_file(run_dir, name).parent.glob("*.pkl"):
            if stale.stem not in kept:
                stale.unlink()


def load_rollout_ahead(config: RunConfig, iteration: int):
    """The rollout of `iteration` collected ahead before the checkpoint (None: the
    checkpoint was saved in another training.mode; the rollout then runs on resumed weights)."""
    path = rollout_ahead_file(Path(config.resume), checkpoint_name(iteration))
    if not path.is_file():
        log.warning("%s not found: iteration %d is rolled out on the resumed weights", path, iteration)
        return None
    return pickle.loads(path.read_bytes())
