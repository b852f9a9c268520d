"""`megatron-agent eval`'s decisions that need no engine: what a path is, which
configuration and which split's seeds, and the table (megatron_agent/evaluate.py)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from envs import validation_seed
from megatron_agent.evaluate import (
    HF,
    MCORE,
    EvalError,
    config_from_run,
    markdown_report,
    resolve_model,
    resolve_split,
    selects_config_group,
)


def write_json(path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def make_hf_model(path, tiny_model_note: bool = False):
    write_json(path / "config.json", {"model_type": "qwen3"})
    (path / "model.safetensors").write_bytes(b"")
    if tiny_model_note:  # what write_tiny_model leaves beside the model: how it was made
        write_json(path / "megatron_agent.json", {"family": "qwen3", "preset": "tiny"})
    return path


def make_run(path, checkpoints=()):
    write_json(path / "config.json", {"run_dir": str(path), "loop": {}, "env": "numberline"})
    make_hf_model(path / "model", tiny_model_note=True)
    for name in checkpoints:
        write_json(path / "checkpoints" / name / "megatron_agent.json", {"format": "megatron-agent mcore checkpoint"})
    return path


def test_what_a_path_is(tmp_path):
    run = make_run(tmp_path / "run", ["iter_000004", "iter_000008"])
    (run / "checkpoints" / ".iter_000012.partial").mkdir()  # a save cut short is not the latest
    latest = resolve_model(str(run))
    assert (latest.kind, latest.path, latest.run_dir) == (MCORE, run / "checkpoints" / "iter_000008", run)
    assert latest.label == f"{run} (iter_000008)"
    one = resolve_model(str(run / "checkpoints" / "iter_000004"))
    assert (one.kind, one.run_dir) == (MCORE, run)
    untrained = resolve_model(str(run / "model"))  # the tiny model's megatron_agent.json is no checkpoint's
    assert (untrained.kind, untrained.path, untrained.run_dir) == (HF, run / "model", run)
    alone = resolve_model(str(make_hf_model(tmp_path / "models" / "m")))
    assert (alone.kind, alone.run_dir) == (HF, None)


def a_file(p):
    (p / "f.txt").write_text("x")
    return p / "f.txt"


def an_empty_dir(p):
    (p / "empty").mkdir()
    return p / "empty"


def a_config_without_weights(p):
    write_json(p / "cfg" / "config.json", {"model_type": "qwen3"})
    return p / "cfg"


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing", "no such file or directory"),
    (a_file, "not a directory"),
    (an_empty_dir, "neither a Megatron checkpoint"),
    (a_config_without_weights, "neither a Megatron checkpoint"),
    (lambda p: make_run(p / "run"), "a run directory with no complete checkpoint"),
])
def test_paths_eval_cannot_score(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(EvalError, match=message) as err:
        resolve_model(str(path))
    assert str(path) in str(err.value)


def config(env: str, env_config: dict | None = None, first: int = 0):
    return SimpleNamespace(env=env, env_config=env_config or {},
                           loop=SimpleNamespace(validation=SimpleNamespace(first_seed_index=first)))


def test_held_out_tasks_are_the_validation_seeds():
    split = resolve_split(config("numberline", first=3), None, 4)
    assert split.name == "validation" and split.seeds == tuple(validation_seed(i) for i in (3, 4, 5, 6))
    assert resolve_split(config("numberline"), "train", 3).seeds == (0, 1, 2)
    assert resolve_split(config("webshop"), None, 2).name == "test"


def test_alfworld_splits_set_the_env_config():
    default = resolve_split(config("alfworld", {"eval_split": "valid_unseen"}), None, 2)
    assert default.name == "valid_unseen"  # the run's own held-out split by default
    seen = resolve_split(config("alfworld", {"max_steps": 5}), "valid_seen", 2)
    assert seen.env_config == {"max_steps": 5, "eval_split": "valid_seen"}
    assert seen.seeds == (validation_seed(0), validation_seed(1))


def test_appworld_splits_name_its_dataset():
    default = resolve_split(config("appworld", {"dataset": "train"}), None, 2)
    assert default.name == "dev" and default.env_config == {"dataset": "dev"}  # held out, not the trained-on
    assert resolve_split(config("appworld", {"dataset": "train"}), "train", 2).env_config == {"dataset": "train"}


def test_a_split_the_env_has_not():
    with pytest.raises(EvalError, match="--split 'valid_unseen': env=numberline has the splits validation, train"):
        resolve_split(config("numberline"), "valid_unseen", 2)


def test_group_overrides_compose_configs_the_rest_set_fields():
    assert selects_config_group("env=maze") and selects_config_group("+experiment=visual-quiz")
    assert selects_config_group("algorithm=grpo")
    assert not selects_config_group("env_config.max_position=3") and not selects_config_group("loop.max_steps=3")


def test_a_runs_config_with_overrides_set_on_its_fields(tmp_path):
    from megatron_agent.run_config import ConfigError, load_run_config

    trained = load_run_config(["+experiment=visual-quiz", "num_groups=4"])
    write_json(tmp_path / "config.json", json.loads(json.dumps(dataclasses.asdict(trained), default=str)))
    loaded = config_from_run(tmp_path, ["loop.sampling.temperature=0.5", "env_config.num_choices=3"])
    assert loaded.env == "visual_quiz" and loaded.num_groups == 4 and loaded.tiny_model.family == "qwen2_5_vl"
    assert loaded.loop.sampling.temperature == 0.5 and loaded.env_config["num_choices"] == 3
    assert loaded.loop.prompt == trained.loop.prompt and loaded.algorithm == trained.algorithm
    with pytest.raises(ConfigError, match="full_key: loop.samplng"):
        config_from_run(tmp_path, ["loop.samplng.temperature=0.5"])


def test_a_run_logged_to_a_tracker_this_machine_lacks_is_scored(tmp_path, monkeypatch):
    """eval logs to no tracker: a run trained with W&B is scored where wandb is missing."""
    from megatron_agent import trackers
    from megatron_agent.evaluate import eval_config
    from megatron_agent.run_config import load_run_config

    trained = load_run_config(["logging.backends=[tensorboard,wandb]", "logging.wandb_mode=offline"])
    write_json(tmp_path / "config.json", json.loads(json.dumps(dataclasses.asdict(trained), default=str)))
    monkeypatch.setitem(trackers.PACKAGES, "wandb", "a_package_this_machine_lacks")
    config, _ = eval_config([], tmp_path, None)
    assert config.logging.backends == [] and config.env == trained.env


def test_the_table_puts_models_side_by_side():
    def model(label, success, passes):
        metrics = {"success_rate": success, "success_rate/a": success, "episode_length": 2.0,
                   "num_episodes": 8.0, **{f"pass@{k}": v for k, v in enumerate(passes, 1)}}
        return {"label": label, "metrics": metrics,
                "seconds": {"conversion": 1.0, "engine_start": 2.0, "rollout": 0.5}}

    data = {"env": "numberline", "split": "validation", "num_tasks": 4, "num_samples": 2, "seeds": [10, 11, 12, 13],
            "sampling": {"temperature": 1.0}, "loop": {"max_steps": 10},
            "models": [model("A", 0.5, [0.5, 0.75]), model("B", 0.125, [0.125])]}
    lines = markdown_report(data).splitlines()
    assert lines[0].startswith("numberline, split validation: 4 tasks (seeds 10..13) x 2 samples, temperature 1")
    assert lines[2] == "| metric | A | B |" and lines[3] == "|---|---|---|"
    assert "| success rate | 0.500 | 0.125 |" in lines and "| success rate: a | 0.500 | 0.125 |" in lines
    assert "| pass@1 | 0.500 | 0.125 |" in lines and "| pass@2 | 0.750 | – |" in lines
    assert "| mean steps | 2.00 | 2.00 |" in lines
    assert lines[-1] == "| seconds: conversion + engine start + rollout | 1.0 + 2.0 + 0.5 | 1.0 + 2.0 + 0.5 |"
