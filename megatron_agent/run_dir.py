"""A run's directory: what is in it, and the writers and readers of those files.

    run_dir/
      config.json            the resolved RunConfig
      model/                 the tiny model made on the spot (when model_dir is None)
      warm_start.json        with tiny_model.warm_start: what the imitation did (megatron_agent/warm_start.py)
      engine_model_fp8/      with weight_sync.quantize=fp8: the model as block FP8, what the engines start from
      metrics.jsonl          one JSON row per iteration (rank 0)
      progress.json          where the current iteration is (phase, episodes, steps, requests in
                             flight), rewritten by rank 0 at most every 0.5 s (megatron_agent/progress.py)
      tensorboard/           the same rows as TensorBoard scalars (logging.backends lists tensorboard)
      trackers.json          the W&B and MLflow run ids a resumed run continues (megatron_agent/trackers.py)
      wandb/, mlruns/        with logging.backends wandb / mlflow: W&B's run files, MLflow's default file store
      samples/iter_N.txt     a few episodes (the first whole group) as text, every samples_every iterations
      samples/iter_N.json    the same episodes for the episode page: per step the prompt, memory window,
                             response, parsed action, reward, advantage, anchor-state group, image
                             (megatron_agent/episode_page.py)
      episodes.html          `megatron-agent show RUN_DIR`: those episodes as one static page
      checkpoints/iter_N/    the actor (a dist checkpoint); critic_checkpoints/ alike
      rollout_ahead/iter_N.pkl  with training.mode=overlap: iteration N's rollout, collected ahead
      engines/               the engine processes' logs
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path


def model_dir_of(config) -> str:
    return config.model_dir or str(Path(config.run_dir) / "model")


def engine_model_dir_of(config) -> str:
    """The model the engines load: the trainer's, or its FP8 checkpoint (weight_sync.quantize)."""
    if config.weight_sync.quantize == "fp8":
        return str(Path(config.run_dir) / "engine_model_fp8")
    return model_dir_of(config)


def prepare_run_dir(config) -> None:
    """Before any rank starts: the run directory, the tiny model, the resolved config, and
    no metrics left from an earlier run in the same directory (unless resuming from it)."""
    from megatron_agent.models.tiny import write_tiny_model

    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = model_dir_of(config)
    if not (Path(model_dir) / "config.json").exists():
        tiny = config.tiny_model  # a text or a vision-language family (write_tiny_model makes both)
        # With a warm start, the model is trained in a staging directory and renamed when done.
        staging = Path(f"{model_dir}.warm-start") if tiny.warm_start.episodes else Path(model_dir)
        if tiny.warm_start.episodes:
            shutil.rmtree(staging, ignore_errors=True)  # a warm start cut short
        write_tiny_model(tiny.family, staging, preset=tiny.preset, seed=config.seed, tokenizer=tiny.tokenizer,
                         num_hidden_layers=tiny.num_hidden_layers)
        if tiny.warm_start.episodes:
            from megatron_agent.warm_start import warm_start

            done = warm_start(config, staging)
            print(f"warm start: imitated {done.steps} steps of {tiny.warm_start.episodes} noisy expert episodes "
                  f"(noise {tiny.warm_start.noise}, the expert won {done.expert_success:.2f}), action loss "
                  f"{done.first_loss:.3f} -> {done.last_loss:.3f} over {tiny.warm_start.epochs} epochs, "
                  f"{done.seconds:.1f} s", flush=True)
            (run_dir / "warm_start.json").write_text(json.dumps(asdict(done), indent=2))
            os.replace(staging, model_dir)
    if config.weight_sync.quantize == "fp8":
        from megatron_agent.weight_sync.fp8 import write_fp8_checkpoint

        write_fp8_checkpoint(model_dir, engine_model_dir_of(config))
    (run_dir / "config.json").write_text(json.dumps(asdict(config), indent=2, default=str))
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and not (config.resume and Path(config.resume).resolve() == run_dir.resolve()):
        metrics.unlink()


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:06d}"


def actor_checkpoint_dir(run_dir: Path, name: str) -> Path:
    return run_dir / "checkpoints" / name


def critic_checkpoint_dir(run_dir: Path, name: str) -> Path:
    return run_dir / "critic_checkpoints" / name


def rollout_ahead_file(run_dir: Path, name: str) -> Path:
    return run_dir / "rollout_ahead" / f"{name}.pkl"


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest complete actor checkpoint of a run (partial ones are dot-prefixed)."""
    found = sorted(p for p in (run_dir / "checkpoints").glob("iter_*") if (p / "megatron_agent.json").is_file())
    if not found:
        raise FileNotFoundError(f"no complete checkpoint in {run_dir / 'checkpoints'} to resume from")
    return found[-1]


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a row cut short by a kill
            break
    return rows


class MetricsLog:
    """metrics.jsonl and TensorBoard (unless logging.backends leaves it out), opened with the
    rows a resumed run keeps."""

    def __init__(self, run_dir: Path, history: list[dict], tensorboard: bool = True):
        from torch.utils.tensorboard import SummaryWriter

        self.file = (run_dir / "metrics.jsonl").open("w")
        for row in history:
            self.file.write(json.dumps(row) + "\n")
        self.tensorboard = SummaryWriter(str(run_dir / "tensorboard")) if tensorboard else None

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        for key, value in row.items():
            if self.tensorboard is not None and key != "iteration" and isinstance(value, int | float):
                self.tensorboard.add_scalar(key, value, row["iteration"])

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def write_sample_episodes(run_dir: Path, iteration: int, episodes: list, records: list[dict] | None = None) -> None:
    """A few trajectories as a person reads them: each step's prompt, response, reward
    (iter_N.txt); with `records` (episode_page.episode_records of the same episodes) also
    iter_N.json, what `megatron-agent show` makes its page of."""
    path = run_dir / "samples" / f"{checkpoint_name(iteration)}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for steps in episodes:
        if steps:
            lines += [*episode_lines(steps), ""]
    path.write_text("\n".join(lines))
    if records is not None:  # whole or not at all, for a page made while the run goes on
        tmp = path.with_name(f".{path.stem}.json.tmp")
        tmp.write_text(json.dumps({"iteration": iteration, "episodes": records}))
        os.replace(tmp, path.with_suffix(".json"))


def episode_lines(steps: list) -> list[str]:
    """One episode (its StepSamples, in order; not empty) as the lines of samples/iter_N.txt."""
    first = steps[0]
    lines = [f"=== episode traj {first.traj_id} (group {first.group_id}, seed {first.env_seed}): "
             f"return {first.episode_return:g}, won {steps[-1].won}, {len(steps)} steps"]
    for s in steps:
        lines.append(f"--- step {s.step_index}: reward {s.reward:g}, valid {s.is_action_valid}")
        observation = s.observation or s.anchor
        lines.append(f"observation: {observation}")
        if isinstance(s.anchor, str) and s.anchor != observation:  # the state GiGPO groups by
            lines.append(f"anchor: {s.anchor}")
        if s.images:
            lines.append("images: " + ", ".join("x".join(map(str, im.shape)) for im in s.images))
        lines.append(f"response: {s.response_text!r}")
    return lines
