"""Shared fixtures and markers.

- `gpu` tests are skipped where CUDA is absent (the reason is shown with -ra);
- `tiny_model_dir(family)` writes a tiny HF model once per session;
- under xdist (`--dist loadgroup`), the tests that share a class-, module- or
  package-scoped fixture run on one worker, so the fixture runs once.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


SHARED_SCOPES = ("class", "module", "package")


def shared_fixture_group(item) -> str | None:
    """The xdist group of a test that uses a class-, module- or package-scoped fixture: its
    module, and the values of those fixtures' parameters (None: no such fixture).

    Under `pytest -n 2 --dist loadgroup` every test outside a group is scheduled on its
    own, so the tests sharing a fixture (a multi-rank job, a server, a built data folder)
    land on both workers and each worker runs the fixture: the multi-rank modules ran
    their jobs twice. Grouped, one worker runs it once; another value of a parametrized
    fixture is another group, free to run on the other worker."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    names = sorted(name for name, defs in info.name2fixturedefs.items() if defs and defs[-1].scope in SHARED_SCOPES)
    if not names:
        return None
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    # the value where it prints the same on every worker (xdist compares their collections)
    values = [f"{name}={params[name] if isinstance(params[name], (str, int, float, bool)) else callspec.indices[name]}"
              for name in names if name in params]
    group = ":".join([item.nodeid.split("::")[0], *values])
    return "".join(c if c.isalnum() or c in "/._-=:" else "_" for c in group)  # no '@', '[' or ']'


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = shared_fixture_group(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: this machine has no GPU (see `megatron-agent doctor`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def xdist_group_name(item) -> str | None:
    """The group xdist's loadgroup gives `item` (its marks' names, sorted, joined by '_')."""
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    return "_".join(names) or None


@pytest.hookimpl(tryfirst=True)  # before the xdist worker sends the collected ids to the scheduler
def pytest_collection_finish(session):
    """xdist (3.8) tells the scheduler a test's group by appending `@group` to its node id,
    through `item._nodeid`; pytest 9.2 keeps the id in a structured `item._id` and ignores
    `_nodeid`, so every group was silently ignored (pytest-xdist#1386): the SGLang tests'
    servers ran side by side and shared fixtures ran on both workers. Set the suffix on
    the structured id where it is missing; fail loudly if it still does not show."""
    if not getattr(session.config.option, "loadgroup", False):  # set on xdist workers under --dist loadgroup
        return
    for item in session.items:
        group = xdist_group_name(item)
        if group is None or item.nodeid.endswith(f"@{group}"):
            continue
        if hasattr(item, "_id"):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(f"{item.nodeid}@{group}")
        if not item.nodeid.endswith(f"@{group}"):
            raise pytest.UsageError(f"{item.nodeid}: its xdist_group {group!r} does not reach the scheduler "
                                    "(tests/conftest.py, pytest_collection_finish)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from megatron_agent.models.tiny import write_tiny_model

    made = {}

    def make(family: str = "qwen3", preset: str = "tiny", **overrides):
        key = (family, preset, tuple(sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp("models") / f"{family}-{preset}"
            made[key] = write_tiny_model(family, out, preset=preset, seed=0, **overrides)
        return made[key]

    return make
