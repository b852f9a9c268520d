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


def make_env(name: str, config: Any = None, **overrides: Any) -> Env:
    spec = get_spec(name)
    return spec.env_cls(make_config(name, config, **overrides))
