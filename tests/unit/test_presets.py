"""The layering of configs/: the files composed together (config.yaml's own body and the
selected option of each group) never set the same key, so each is authoritative for what
it sets; only an experiment (+experiment=NAME) overrides, and it comes last.

Checked for every combination of group options from the YAML files themselves (cheap),
then each file is resolved through Hydra at least once and every key it sets must arrive
unchanged in the RunConfig. Disjoint keys make that hold in every combination."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import sys

import pytest
from omegaconf import OmegaConf

from megatron_agent.run_config import CONFIG_DIR, load_run_config
from tests.unit.test_config import QWEN3_8B, QWEN3_30B_A3B

GROUPS = ("algorithm", "env", "model", "backend")
OPTIONS = {group: sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml")) for group in GROUPS}
EXPERIMENTS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
# Cluster presets: the published architecture (config.json only) and a layout's world size.
CLUSTER_MODELS = {"qwen3-8b": (QWEN3_8B, 8), "qwen3-30b-a3b": (QWEN3_30B_A3B, 16)}
INTERPOLATION = re.compile(r"^\$\{([\w.]+)\}$")


def flatten(node, prefix=""):
    """{dotted key: value} of a YAML mapping's leaves (an empty mapping or a list is a leaf)."""
    if isinstance(node, dict) and node:
        out = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def file_keys(path, group=None):
    """What a config file sets, as full keys of the RunConfig: a `# @package _global_` file
    at the root, a group's file (algorithm/) under its group; config.yaml without its defaults."""
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    raw.pop("defaults", None)
    is_global = "# @package _global_" in path.read_text()
    prefix = "" if is_global or group is None else f"{group}."
    return flatten(raw, prefix)


BODY = file_keys(CONFIG_DIR / "config.yaml")
KEYS = {(group, option): file_keys(CONFIG_DIR / group / f"{option}.yaml", group)
        for group in (*GROUPS, "experiment") for option in (OPTIONS.get(group) or EXPERIMENTS)}
DEFAULTS = {group: option for entry in OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "config.yaml").defaults)
            if isinstance(entry, dict) for group, option in entry.items()}


def overlap(a, b):
    """Keys of `a` and `b` that name the same field or one inside the other."""
    return sorted(ka for ka in a for kb in b if ka == kb or ka.startswith(kb + ".") or kb.startswith(ka + "."))


def test_the_defaults_list_names_every_group():
    assert set(DEFAULTS) == set(GROUPS)
    assert all(DEFAULTS[group] in OPTIONS[group] for group in GROUPS)


def test_no_two_composed_files_set_the_same_key():
    """For every combination: pairwise disjoint across groups and config.yaml's body."""
    clashes = []
    files = [("config.yaml", BODY)] + [(f"{g}/{o}.yaml", KEYS[g, o]) for g in GROUPS for o in OPTIONS[g]]
    group_of = {name: name.split("/")[0] if "/" in name else None for name, _ in files}
    for (name_a, a), (name_b, b) in itertools.combinations(files, 2):
        if group_of[name_a] is not None and group_of[name_a] == group_of[name_b]:
            continue  # two options of one group are never composed together
        if shared := overlap(a, b):
            clashes.append(f"{name_a} and {name_b} both set {shared}")
    assert not clashes, "\n".join(clashes)
    # so every one of the combinations composes without an override:
    assert len(list(itertools.product(*(OPTIONS[g] for g in GROUPS)))) > 1


@pytest.fixture(autouse=True)
def engine_token(monkeypatch):
    """backend=gpu binds the engines beyond loopback: a run has a key (train.sbatch makes one)."""
    monkeypatch.setenv("MEGATRON_AGENT_ENGINE_TOKEN", "test-key")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for preset, (hf, _) in CLUSTER_MODELS.items():
        dirs[preset] = tmp_path_factory.mktemp(preset)
        (dirs[preset] / "config.json").write_text(json.dumps(hf))
    return dirs


def resolve(selection, model_dirs, extra=()):
    overrides = [f"{group}={option}" for group, option in selection.items()]
    if selection["model"] in CLUSTER_MODELS:
        overrides += [f"model_dir={model_dirs[selection['model']]}",
                      f"placement.trainer_ranks={CLUSTER_MODELS[selection['model']][1]}"]
    return dataclasses.asdict(load_run_config([*overrides, *extra]))


def lookup(resolved, key):
    value = resolved
    for part in key.split("."):
        value = value[part]
    return value


def assert_arrives(resolved, name, keys, model_dirs, overridden=()):
    """Every key the file sets has its value in the resolved config (an interpolation: the
    value of the key it names); keys an experiment overrides are left out."""
    for key, expected in keys.items():
        if any(key == o or key.startswith(o + ".") for o in overridden):
            continue
        if key == "model_dir" and lookup(resolved, key) in {str(d) for d in model_dirs.values()}:
            continue  # the placeholder of a cluster preset, set on the command line here
        if isinstance(expected, str) and (ref := INTERPOLATION.match(expected)):
            expected = lookup(resolved, ref.group(1))
        assert lookup(resolved, key) == expected, f"{name}: {key}={expected!r} arrives as {lookup(resolved, key)!r}"


SELECTIONS = (
    [{**DEFAULTS, "algorithm": a} for a in OPTIONS["algorithm"]]
    + [{**DEFAULTS, "env": e} for e in OPTIONS["env"]]
    + [{**DEFAULTS, "model": m, "backend": b} for m in OPTIONS["model"] for b in OPTIONS["backend"]]
)


@pytest.fixture(autouse=True)
def appworld_in_place(tmp_path, monkeypatch):
    """The AppWorld preset resolves where AppWorld's python and a data folder exist (the
    config check asks for both); what they hold is test_appworld.py's concern."""
    (tmp_path / "appworld" / "data" / "tasks").mkdir(parents=True)
    monkeypatch.setenv("APPWORLD_ROOT", str(tmp_path / "appworld"))
    monkeypatch.setenv("MEGATRON_AGENT_APPWORLD_PYTHON", sys.executable)


@pytest.mark.parametrize("selection", SELECTIONS, ids=lambda s: "-".join(s[g] for g in GROUPS))
def test_every_file_is_authoritative_for_what_it_sets(selection, model_dirs):
    resolved = resolve(selection, model_dirs)
    assert_arrives(resolved, "config.yaml", BODY, model_dirs)
    for group in GROUPS:
        assert_arrives(resolved, f"{group}/{selection[group]}.yaml", KEYS[group, selection[group]], model_dirs)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_an_experiment_overrides_on_purpose(experiment, model_dirs):
    resolved = resolve(DEFAULTS, model_dirs, [f"+experiment={experiment}"])
    mine = KEYS["experiment", experiment]
    assert_arrives(resolved, f"experiment/{experiment}.yaml", mine, model_dirs)
    assert_arrives(resolved, "config.yaml", BODY, model_dirs, overridden=mine)
    for group in GROUPS:
        assert_arrives(resolved, f"{group}/{DEFAULTS[group]}.yaml", KEYS[group, DEFAULTS[group]], model_dirs,
                       overridden=mine)


def test_the_cluster_presets_keep_their_settings(model_dirs):
    """The issue: config.yaml's CPU-job values (lr 1e-3, entropy 0.05, no KL, no penalty) and
    backend/gpu.yaml's one GPU per engine used to override the 30B preset."""
    run = load_run_config(["model=qwen3-30b-a3b", "backend=gpu", f"model_dir={model_dirs['qwen3-30b-a3b']}",
                           "placement.trainer_ranks=16"])
    assert run.actor.lr == 1e-6 and run.engine.gpus_per_engine == 4
    assert run.algorithm.entropy_coef == 0.001 and run.algorithm.kl_loss_active
    assert run.algorithm.invalid_action_penalty == 0.1  # the schema's defaults, not the CPU job's
    assert (run.engine.server, run.engine.dtype, run.actor.params_dtype) == ("sglang", "bfloat16", "bf16")
    assert run.placement.gpus_per_trainer == 1
    # the CPU job keeps its from-scratch settings, now in model/tiny.yaml
    cpu = load_run_config()
    assert (cpu.actor.lr, cpu.critic.lr, cpu.algorithm.entropy_coef) == (1e-3, 1e-3, 0.05)
    assert not cpu.algorithm.kl_loss_active and cpu.engine.gpus_per_engine == 0
