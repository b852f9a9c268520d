"""Every shipped environment config (configs/env/*.yaml) runs an iteration on the CPU
default as shipped (with its env_on_backend/ENV_cpu.yaml settings): `megatron-agent train
env=NAME` with only the fewest iterations and groups overridden. The envs whose CPU job
another test runs are not run again here; together they cover every config file.

One subprocess runs them one after another (shipped_configs.py): the imports are paid once,
and the distributed state it creates never reaches this pytest worker."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from megatron_agent.run_config import CONFIG_DIR

pytestmark = pytest.mark.slow  # ~10 s an env on 2 cores (an engine and the tiny model each)

SHIPPED = sorted(p.stem for p in (CONFIG_DIR / "env").glob("*.yaml"))
# The CPU job on these runs in its own test, with that env's checks.
RUN_ELSEWHERE = {
    "numberline": "tests/integration/test_cli.py, test_driver.py (the CPU main job)",
    "webshop": "tests/integration/envs/test_webshop_job.py",
    "alfworld": "tests/integration/envs/test_alfworld.py",
    "appworld": "tests/integration/envs/test_appworld.py (needs AppWorld's venv and data)",
}
RUN_HERE = [env for env in SHIPPED if env not in RUN_ELSEWHERE]


def shipped_max_steps(env: str) -> int:
    """loop.max_steps as the files say for backend=cpu: env_on_backend's, else the env's."""
    for path in (CONFIG_DIR / "env_on_backend" / f"{env}_cpu.yaml", CONFIG_DIR / "env" / f"{env}.yaml"):
        if path.exists() and (steps := OmegaConf.select(OmegaConf.load(path), "loop.max_steps")) is not None:
            return steps
    raise AssertionError(f"{env}: no loop.max_steps in its files")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("shipped")
    out = root / "results.json"
    done = subprocess.run([sys.executable, "-m", "tests.integration.envs.shipped_configs", ",".join(RUN_HERE),
                           str(out), str(root)], capture_output=True, text=True, timeout=600)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_shipped_env_config_is_run_by_some_test():
    assert set(RUN_ELSEWHERE) <= set(SHIPPED) and RUN_HERE


@pytest.mark.parametrize("env", RUN_HERE)
def test_one_iteration_as_shipped_on_the_cpu_default(results, env):
    result = results[env]
    assert "error" not in result, result.get("error")
    (row,) = result["rows"]
    assert row["iteration"] == 0 and row["train/num_episodes"] == 2
    assert 1 <= row["train/episode_length"] <= shipped_max_steps(env)
    assert math.isfinite(row["actor/grad_norm"]) and row["weight_sync/bytes"] > 0
    config = result["config"]  # what the run resolved: the env's own file, the CPU sizing on top
    assert config["env"] == OmegaConf.load(CONFIG_DIR / "env" / f"{env}.yaml").env
    assert config["placement"]["launcher"] == "local" and config["engine"]["server"] == "embedded"
