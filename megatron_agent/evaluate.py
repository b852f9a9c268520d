"""`megatron-agent eval`: score a model on an env's held-out tasks, without training,
through the agent loop, prompts and engines of training (docs/evaluation.md).

    report = run_eval(EvalRequest(checkpoint="runs/x", compare="runs/x/model", num_samples=4))
    print(report.markdown)       # also in report.out: eval.json, eval.md

The model (`checkpoint`): a Megatron checkpoint (a run's checkpoints/iter_N, converted to
HF layout in a temporary directory by tools/checkpoint_convert), a run directory (its
latest complete checkpoint), or an HF model directory; without one, `model_dir=` or the
running engines of `engine.urls` (scored as they are, `model_dir=` giving the tokenizer).
The configuration: the run's config.json when the model belongs to a run (the path, or
one of its two parents, is a run directory), with the overrides set on its fields;
otherwise, or when an override selects a config group (`env=`, `+experiment=`, ...),
configs/ composed with the overrides as `train` composes them. `compare` names a second
model, scored with the same configuration on the same tasks and sampling seeds.

Each task (an env seed of the split) is played `num_samples` times: one group of that
many copies, as training plays a group. One sample: the validation sampling
(loop.validation.sampling, greedy by default); more: the training sampling (loop.sampling),
since greedy copies would repeat one answer. Everything the input decides (paths, the
configuration, the split) is checked before any engine starts: `EvalError`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MCORE, HF, ENGINES = "megatron checkpoint", "hf model", "running engines"
# The held-out splits of the envs that have named ones (ALFWorld's: envs.alfworld.EVAL_SPLITS),
# and the env config field a split sets; every other env: "validation", the validation seeds.
HELD_OUT_SPLITS = {"webshop": ("test",), "appworld": ("dev", "test_normal", "test_challenge")}
SPLIT_FIELDS = {"alfworld": "eval_split", "appworld": "dataset"}
TRAIN_SPLIT = "train"


class EvalError(ValueError):
    """Input `eval` cannot score (a path, the configuration, the split); the message says why."""


@dataclass
class EvalRequest:
    checkpoint: str | None = None
    compare: str | None = None
    num_samples: int = 1
    num_tasks: int | None = None  # None: loop.validation.num_episodes
    split: str | None = None  # None: the env's first held-out split (ALFWorld: env_config.eval_split)
    out: str | None = None  # None: RUN/eval/NAME-SPLIT for a run's model, else ./eval/NAME-SPLIT
    overrides: list[str] = field(default_factory=list)
    command: str = ""  # the command line, recorded in eval.json


@dataclass(frozen=True)
class ModelSource:
    """One model to score: where it is and what it is."""

    label: str  # the path as given (a run's: with its checkpoint's name)
    kind: str  # MCORE, HF or ENGINES
    path: Path | None  # the checkpoint or HF directory (None: the engines)
    run_dir: Path | None  # the run it belongs to (its config.json), if any

    @property
    def name(self) -> str:
        return self.path.name if self.path is not None else "engines"


@dataclass(frozen=True)
class Split:
    name: str
    seeds: tuple[int, ...]
    env_config: dict


@dataclass
class EvalReport:
    out: Path
    data: dict  # what eval.json holds
    markdown: str  # what eval.md holds, the table printed


# -- what a path is ------------------------------------------------------------------------


def _json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def is_run_dir(path: Path) -> bool:
    """A run directory: its config.json is a resolved RunConfig (megatron_agent/run_dir.py)."""
    config = _json_file(path / "config.json")
    return "run_dir" in config and "loop" in config


def is_mcore_checkpoint(path: Path) -> bool:
    """A Megatron dist checkpoint of this project's (the trainer's or hf-to-mcore's; a tiny
    model's megatron_agent.json says how it was made, not this)."""
    return _json_file(path / "megatron_agent.json").get("format") == "megatron-agent mcore checkpoint"


def is_hf_model(path: Path) -> bool:
    """An HF model directory: a config.json with a model_type, and weights."""
    weights = any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json")) or any(
        path.glob("pytorch_model*.bin"))
    return "model_type" in _json_file(path / "config.json") and weights


def owning_run(path: Path) -> Path | None:
    """The run directory `path` belongs to: itself or one of its two parents (a run's
    checkpoints/iter_N, its model/)."""
    for candidate in (path, path.parent, path.parent.parent):
        if is_run_dir(candidate):
            return candidate
    return None


def resolve_model(text: str) -> ModelSource:
    """What `--checkpoint` / `--compare` names; EvalError when it is nothing eval can score."""
    from megatron_agent.run_dir import latest_checkpoint

    path = Path(text).expanduser()
    if not path.exists():
        raise EvalError(f"{text}: no such file or directory")
    if not path.is_dir():
        raise EvalError(f"{text}: not a directory (a Megatron checkpoint, a run directory or an HF model directory)")
    if is_mcore_checkpoint(path):
        return ModelSource(text, MCORE, path, owning_run(path))
    if is_hf_model(path):
        return ModelSource(text, HF, path, owning_run(path))
    if is_run_dir(path):
        try:
            checkpoint = latest_checkpoint(path)
        except FileNotFoundError:
            raise EvalError(f"{text}: a run directory with no complete checkpoint in {path / 'checkpoints'} "
                            "(a run saves one every save_every iterations)") from None
        return ModelSource(f"{text} ({checkpoint.name})", MCORE, checkpoint, path)
    raise EvalError(f"{text}: neither a Megatron checkpoint (no megatron_agent.json), an HF model directory "
                    "(config.json with a model_type, and safetensors weights) nor a run directory (a run's "
                    "config.json and checkpoints/)")


def served_model_dir(source: ModelSource) -> Path:
    """The HF directory whose config and tokenizer the model is served with (a Megatron
    checkpoint's: its hf/ side files, until it is converted)."""
    return source.path / "hf" if source.kind == MCORE else source.path


# -- the configuration ---------------------------------------------------------------------


def selects_config_group(override: str) -> bool:
    """Whether a Hydra override composes configs/ (`env=maze`, `+experiment=x`, `~key`) rather
    than setting a field."""
    from megatron_agent.run_config import CONFIG_DIR

    key = override.split("=", 1)[0]
    groups = {p.name for p in CONFIG_DIR.iterdir() if p.is_dir()}
    return key.startswith(("+", "~")) or key in groups


def config_from_run(run_dir: Path, overrides: list[str]):
    """The run's resolved config.json with `overrides` (key=value on its fields, typed by the
    schema) set on it, checked as `train` checks a configuration."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from megatron_agent.run_config import ConfigError, _first_line, _schema, validate_run_config

    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
    try:
        merged = OmegaConf.merge(_schema(), json.loads((run_dir / "config.json").read_text()),
                                 OmegaConf.from_dotlist(list(overrides)))
        config = OmegaConf.to_object(merged)
    except (OmegaConfBaseException, ValueError) as err:
        raise ConfigError(_first_line(err)) from None
    validate_run_config(config)
    return config


def eval_config(overrides: list[str], run_dir: Path | None, model_dir: Path | None):
    """(RunConfig, where it came from). `model_dir`: the model the prompts are made for (its
    config and tokenizer), set in the configuration before it is checked."""
    from megatron_agent.run_config import ConfigError, load_run_config

    # eval trains nothing: no warm start (it needs the tiny model), nothing to resume, no
    # tracker (a run logged to W&B is scored where wandb is not installed)
    settings = ["tiny_model.warm_start.episodes=0", "resume=null", "logging.backends=[]",
                *([f"model_dir='{model_dir}'"] if model_dir else [])]
    composed = run_dir is None or any(selects_config_group(o) for o in overrides)
    try:
        if composed:
            config = load_run_config([*overrides, *settings])
        else:
            config = config_from_run(run_dir, [*overrides, *settings])
    except ConfigError as err:
        raise EvalError(f"bad configuration: {err}") from None
    shown = " ".join(overrides)
    source = (f"configs/ composed with {shown}" if composed and overrides else "configs/" if composed
              else f"{run_dir / 'config.json'}" + (f" with {shown}" if overrides else ""))
    return config, source


def check_other_model(config, model_dir: Path) -> None:
    """The configuration checks again for a second model (its config and tokenizer)."""
    from megatron_agent.run_config import ConfigError, validate_run_config

    try:
        validate_run_config(dataclasses.replace(config, model_dir=str(model_dir)))
    except ConfigError as err:
        raise EvalError(f"bad configuration for {model_dir}: {err}") from None


def check_engines(config, models: list[ModelSource]) -> None:
    urls = list(config.engine.urls)
    if urls and any(m.kind != ENGINES for m in models):
        raise EvalError(f"engine.urls={urls} names running engines, which serve their own weights and are scored as "
                        "they are: drop --checkpoint/--compare (keep model_dir= for the tokenizer), or set "
                        "engine.urls=[] to serve the checkpoint on embedded engines")
    if not urls and config.engine.server != "embedded":
        raise EvalError(f"engine.server={config.engine.server!r}: eval starts embedded engines only; give "
                        "engine.urls of running servers (serving the model to score) or engine.server=embedded")


# -- the tasks -----------------------------------------------------------------------------


def env_splits(env: str) -> tuple[str, ...]:
    """The env's splits, held-out ones first, then its training seeds."""
    if env == "alfworld":
        from envs.alfworld import EVAL_SPLITS

        return (*EVAL_SPLITS, TRAIN_SPLIT)
    return (*HELD_OUT_SPLITS.get(env, ("validation",)), TRAIN_SPLIT)


def resolve_split(config, name: str | None, num_tasks: int) -> Split:
    """The seeds (one per task) and env config of a split. Held-out tasks are the validation
    seed range (envs.validation_seed(first_seed_index + i), which each env maps to its
    held-out set: ALFWorld's games of env_config.eval_split, AppWorld's tasks of
    env_config.dataset, WebShop's test goals, the search env's validation questions);
    `train` is training seeds 0..num_tasks-1 on the env config as it is."""
    from envs import validation_seed
    from envs.registry import make_config

    env_config = dict(config.env_config)
    splits = env_splits(config.env)
    if name is None:
        name = make_config(config.env, env_config).eval_split if config.env == "alfworld" else splits[0]
    if name not in splits:
        raise EvalError(f"--split {name!r}: env={config.env} has the splits {', '.join(splits)}")
    if name == TRAIN_SPLIT:
        return Split(name, tuple(range(num_tasks)), env_config)
    if config.env in SPLIT_FIELDS:
        env_config[SPLIT_FIELDS[config.env]] = name
    first = config.loop.validation.first_seed_index
    return Split(name, tuple(validation_seed(first + i) for i in range(num_tasks)), env_config)


def default_out(models: list[ModelSource], split: Split) -> Path:
    name = "-vs-".join(m.name for m in models) + f"-{split.name}"
    run_dir = models[0].run_dir
    return (run_dir / "eval" / name) if run_dir is not None else Path("eval") / name


# -- scoring -------------------------------------------------------------------------------


def play(config, model_dir: Path, envs, seeds, sampling, log_dir: Path):
    """One rollout of every task's group on engines serving `model_dir` (embedded engines
    started here, or engine.urls): (rollout.agent_loop.RolloutResult, seconds to start the
    engines)."""
    from transformers import AutoTokenizer

    from rollout.agent_loop import run_rollout
    from rollout.engine_launch import engine_client, launch_embedded_engines, stop_engines
    from rollout.vision import load_image_processor

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = dataclasses.replace(config.engine, return_routed_experts=False)  # routes: for training's replay
    engines, started = [], time.perf_counter()
    try:
        if not engine.urls:
            engines = launch_embedded_engines(engine, model_dir, log_dir)
        engine_seconds = time.perf_counter() - started
        client = engine_client(engine, list(engine.urls) or [e.url for e in engines], model_dir)
        try:
            return run_rollout(envs, client, tokenizer, dataclasses.replace(config.loop, drop_failed_episodes=True),
                               list(seeds), sampling=sampling,
                               image_processor=load_image_processor(model_dir)), engine_seconds
        finally:
            client.close()
    finally:
        stop_engines(engines)


def hf_model_of(source: ModelSource, config, converted: Path) -> Path:
    """The HF directory to serve: a Megatron checkpoint converted to `converted` (in this
    process, by tools/checkpoint_convert), an HF model as it is, model_dir for the engines."""
    if source.kind == ENGINES:
        return Path(config.model_dir)
    if source.kind == HF:
        return source.path
    from tools.checkpoint_convert.convert import mcore_to_hf

    return mcore_to_hf(source.path, converted)


def run_eval(request: EvalRequest, say: Callable[[str], None] = print) -> EvalReport:
    """Score `request.checkpoint` (and `request.compare`) and write eval.json and eval.md."""
    from envs import EnvManager
    from megatron_agent.eval_metrics import model_metrics, task_results

    if request.num_samples < 1:
        raise EvalError(f"--num-samples {request.num_samples}: at least 1 sample per task")
    if request.num_tasks is not None and request.num_tasks < 1:
        raise EvalError(f"--num-tasks {request.num_tasks}: at least 1 task")
    if request.compare and not request.checkpoint:
        raise EvalError("--compare PATH2 scores a second model beside --checkpoint PATH: give --checkpoint too")
    models = [resolve_model(p) for p in (request.checkpoint, request.compare) if p]
    model_overrides = [o for o in request.overrides if o.split("=", 1)[0].lstrip("+") == "model_dir"]
    if models and model_overrides:
        raise EvalError(f"{model_overrides[0]} and --checkpoint both name the model: give one")
    first = served_model_dir(models[0]) if models else None
    config, source = eval_config(request.overrides, models[0].run_dir if models else None, first)
    if not models:
        if config.model_dir is None:
            raise EvalError("nothing to score: give --checkpoint PATH, model_dir=HF_DIR, or engine.urls=[...] of "
                            "running engines with model_dir=HF_DIR (their tokenizer)")
        path = Path(config.model_dir)
        if not is_hf_model(path) and not config.engine.urls:
            raise EvalError(f"model_dir={config.model_dir}: not an HF model directory (config.json with a "
                            "model_type, and safetensors weights)")
        models = [ModelSource(f"engines {', '.join(config.engine.urls)}", ENGINES, None, None) if config.engine.urls
                  else ModelSource(config.model_dir, HF, path, None)]
    check_engines(config, models)
    for other in models[1:]:
        check_other_model(config, served_model_dir(other))
    num_tasks = request.num_tasks or config.loop.validation.num_episodes
    split = resolve_split(config, request.split, num_tasks)
    sampling = config.loop.validation.sampling if request.num_samples == 1 else config.loop.sampling
    out = Path(request.out) if request.out else default_out(models, split)
    out.mkdir(parents=True, exist_ok=True)

    say(f"megatron-agent eval: {config.env}, split {split.name}, {num_tasks} tasks x {request.num_samples} "
        f"sample{'s' if request.num_samples > 1 else ''} at temperature {sampling.temperature:g}; "
        f"configuration: {source}")
    scored, envs = [], None
    work = Path(tempfile.mkdtemp(prefix=".converted-", dir=out))  # beside the outputs: a model's size
    try:
        envs = EnvManager(config.env, split.env_config, num_groups=num_tasks, group_size=request.num_samples,
                          backend=config.env_backend, num_workers=config.env_workers)
        for index, model in enumerate(models):
            say(f"{model.label}: " + ("converting to HF, then " if model.kind == MCORE else "") + "scoring")
            started = time.perf_counter()
            model_dir = hf_model_of(model, config, work / f"model-{index}")
            converted = time.perf_counter()
            result, engine_seconds = play(config, model_dir, envs, split.seeds, sampling, out / "engines")
            seconds = {"total": time.perf_counter() - started, "conversion": converted - started,
                       "engine_start": engine_seconds, "rollout": result.metrics["rollout/time_s"]}
            metrics = model_metrics(result.summaries, split.seeds, request.num_samples)
            say(f"{model.label}: success {metrics.get('success_rate', 0.0):.3f} over "
                f"{int(metrics['num_episodes'])} episodes, {seconds['total']:.0f} s")
            scored.append({
                "label": model.label, "kind": model.kind, "path": str(model.path) if model.path else None,
                "served_from": str(model_dir) if model.kind != MCORE else "converted to HF in a temporary directory",
                "seconds": seconds, "metrics": metrics,
                "tasks": [dataclasses.asdict(t) for t in task_results(result.summaries, split.seeds,
                                                                        request.num_samples)],
            })
    finally:
        if envs is not None:
            envs.close()
        shutil.rmtree(work, ignore_errors=True)

    data = {
        "command": request.command, "env": config.env, "env_config": split.env_config, "split": split.name,
        "num_tasks": num_tasks, "num_samples": request.num_samples, "seeds": list(split.seeds),
        "sampling": dataclasses.asdict(sampling), "configuration": source,
        "loop": dataclasses.asdict(dataclasses.replace(config.loop, sampling=sampling)), "models": scored,
    }
    markdown = markdown_report(data)
    (out / "eval.json").write_text(json.dumps(data, indent=2, default=str))
    (out / "eval.md").write_text(markdown)
    return EvalReport(out, data, markdown)


# -- the table -----------------------------------------------------------------------------

RATE, COUNT, MEAN = "{:.3f}", "{:.0f}", "{:.2f}"
ROWS = (  # (label, metric, format)
    ("success rate", "success_rate", RATE),
    ("mean steps", "episode_length", MEAN),
    ("invalid-action rate", "invalid_action_rate", RATE),
    ("prompt tokens per step", "prompt_length", MEAN),
    ("response tokens per step", "response_length", MEAN),
    ("prompt tokens", "prompt_tokens", COUNT),
    ("response tokens", "response_tokens", COUNT),
    ("episodes", "num_episodes", COUNT),
    ("failed episodes (env broke, not counted)", "failed_episodes", COUNT),
)


def markdown_report(data: dict) -> str:
    """A line saying what was scored, and a table: one row per metric, one column per model."""
    models = data["models"]
    seeds, samples = data["seeds"], data["num_samples"]
    sampling = data["sampling"]
    head = (f"{data['env']}, split {data['split']}: {data['num_tasks']} tasks (seeds {seeds[0]}..{seeds[-1]}) x "
            f"{samples} sample{'s' if samples > 1 else ''}, temperature {sampling['temperature']:g} "
            f"({'the validation' if samples == 1 else 'the training'} sampling), at most "
            f"{data['loop']['max_steps']} steps")
    metrics = [m["metrics"] for m in models]
    types = sorted({k.split("/", 1)[1] for m in metrics for k in m if k.startswith("success_rate/")})
    rows = [ROWS[0], *((f"success rate: {t}", f"success_rate/{t}", RATE) for t in types),
            *((f"pass@{k}", f"pass@{k}", RATE) for k in range(1, samples + 1)), *ROWS[1:]]
    lines = [head, "", "| metric | " + " | ".join(m["label"] for m in models) + " |",
             "|---|" + "---|" * len(models)]
    for label, key, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt.format(m[key]) if key in m else "–" for m in metrics) + " |")
    lines.append("| seconds: conversion + engine start + rollout | " + " | ".join(
        "{conversion:.1f} + {engine_start:.1f} + {rollout:.1f}".format(**m["seconds"]) for m in models) + " |")
    return "\n".join(lines) + "\n"
