"""Name -> (env class, config class). An env module registers itself at import time.

Built-in envs are imported on first use, so `make_env("sokoban")` works without an
explicit import and importing `envs` stays cheap (no PIL / bm25s until needed).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any

from envs.base import Env


@dataclass(frozen=True)
class EnvSpec:
    name: str
    env_cls: type
    config_cls: type


_REGISTRY: dict[str, EnvSpec] = {}

_BUILTIN_MODULES = {
    "sokoban": "envs.sokoban",
    "numberline": "envs.gym_cards.numberline",
    "ezpoints": "envs.gym_cards.points",
    "points24": "envs.gym_cards.points",
    "blackjack": "envs.gym_cards.blackjack",
    "search": "envs.search",
    "appworld": "envs.appworld",
    "webshop": "envs.webshop",
    "alfworld": "envs.alfworld",
    "visual_quiz": "envs.visual_quiz",
    "maze": "envs.maze",
}


def register_env(name: str, env_cls: type, config_cls: type) -> None:
    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"config class for {name!r} must be a dataclass, got {config_cls!r}")
    existing = _REGISTRY.get(name)
    if existing is not None and (existing.env_cls, existing.config_cls) != (env_cls, config_cls):
        raise ValueError(f"environment {name!r} is already registered to {existing.env_cls!r}")
    _REGISTRY[name] = EnvSpec(name, env_cls, config_cls)


def get_spec(name: str) -> EnvSpec:
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _REGISTRY:
        raise KeyError(f"unknown environment {name!r}; registered: {registered_envs()}")
    return _REGISTRY[name]


def registered_envs() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def make_config(name: str, config: Any = None, **overrides: Any) -> Any:
    """The env's config: the default, a given dataclass, or a dict of field values."""
    spec = get_spec(name)
    if config is None:
        config = spec.config_cls()
    elif isinstance(config, dict):
        config = spec.config_cls(**config)
    elif not isinstance(config, spec.config_cls):
        raise TypeError(f"{name!r} expects a {spec.config_cls.__name__}, got {type(config).__name__}")
    return dataclasses.replace(config, **overrides) if overrides else config


def env_instructions(name: str, config: Any) -> str:
    """The env's task description and action format for the agent loop's system prompt
    (its class's optional `instructions_for(config)`; "" without one)."""
    describe = getattr(get_spec(name).env_cls, "instructions_for", None)
    return describe(config) if describe is not None else ""


def make_env(name: str, config: Any = None, **overrides: Any) -> Env:
    spec = get_spec(name)
    return spec.env_cls(make_config(name, config, **overrides))


# The share of the machine's available memory that env copies running as processes may
# plan to take; the rest is the trainer's, the engines' and the env workers'.
COPIES_MEMORY_SHARE = 0.75


def memory_problem(env_config: Any, num_copies: int, available_bytes: int) -> str | None:
    """Why `num_copies` copies of the env `env_config` configures would not fit in memory
    (None: they fit, or the env declares no cost). An env whose copies are processes
    declares what one costs with a `copy_memory_bytes()` method on its config (AppWorld:
    one server process per copy); the copies may take COPIES_MEMORY_SHARE of
    `available_bytes` (psutil.virtual_memory().available, before the run starts)."""
    declared = getattr(env_config, "copy_memory_bytes", None)
    if declared is None or num_copies < 1:
        return None
    per_copy = int(declared())
    needed, budget = num_copies * per_copy, int(available_bytes * COPIES_MEMORY_SHARE)
    if needed <= budget:
        return None
    name = next((s.name for s in _REGISTRY.values() if isinstance(env_config, s.config_cls)),
                type(env_config).__name__)
    fits = budget // per_copy  # per_copy > 0: a zero cost fits above
    remedy = (f"at most {fits} fit: lower num_groups or group_size (and loop.validation.num_episodes when "
              f"validating) so that they hold at most {fits} copies together" if fits else "not one fits: free memory first")
    return (f"env={name}: {num_copies} env copies would take {needed / 2**30:.1f} GiB (one process of "
            f"{per_copy / 2**20:.0f} MiB each), more than {COPIES_MEMORY_SHARE:.0%} of the "
            f"{available_bytes / 2**30:.1f} GiB this machine has available; {remedy}")
