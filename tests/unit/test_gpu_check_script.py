"""bench/gpu_check.sh names tests that exist, each with its own time limit, and says plainly
when it cannot run: no GPU, or packages missing with no wheels (naming the command that
fetches them), each time ending with its summary line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
WHEELS_SCRIPT = ROOT / "bench" / "gpu_wheels.sh"
SUMMARY = re.compile(r"^gpu_check: (\d+) passed, (\d+) failed, (\d+) not available$")


def checks() -> list[tuple[str, int, str]]:
    """(name, time limit in seconds, pytest node) of every check, in the script's order."""
    return [(name, int(limit), node)
            for name, limit, node in re.findall(r'^\s+"(\w+) (\d+) ([^"\s]+)"$', SCRIPT.read_text(), flags=re.M)]


def script_default(variable: str) -> int:
    return int(re.search(rf'^{variable}="\$\{{\w+:-(\d+)\}}"$', SCRIPT.read_text(), flags=re.M).group(1))


def run_script(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env)


def test_every_check_is_a_collected_test():
    listed = checks()
    assert len(listed) >= 17
    names = [name for name, _, _ in listed]
    assert len(set(names)) == len(names)
    assert all(0 < limit <= script_default("BUDGET_S") for _, limit, _ in listed)
    nodes = [node for _, _, node in listed]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *nodes],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    collected = [line.strip() for line in out.stdout.splitlines() if "::" in line]
    assert sorted(collected) == sorted(nodes)


def test_every_summary_line_counts_the_three_outcomes():
    """The two places the script ends: before the checks (it cannot run them) and after."""
    lines = [line.strip() for line in SCRIPT.read_text().splitlines()
             if line.strip().startswith('echo "gpu_check: ') and "passed, " in line]
    assert lines == ['echo "gpu_check: 0 passed, 1 failed, ${#CHECKS[@]} not available"',
                     'echo "gpu_check: $passed passed, $failed failed, $unavailable not available"']


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without a GPU")
def test_without_a_gpu_it_says_so_and_fails_with_the_summary_line():
    out = run_script(sys.executable)
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert f"gpu_check: no CUDA device visible to {sys.executable}: the checks need a GPU" in lines
    assert SUMMARY.match(lines[-1]).groups() == ("0", "1", str(len(checks())))


def test_missing_packages_without_wheels_name_the_command_that_fetches_them(tmp_path):
    import os

    hidden = tmp_path / "hide" / "megatron"  # shadows the installed megatron-core
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = dict(os.environ, PYTHONPATH=str(hidden.parent), GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"))
    out = run_script(sys.executable, env=env)
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert (f"gpu_check: {sys.executable} lacks megatron-core and {tmp_path / 'no-wheels'}/ holds no wheels: run "
            f"`bash bench/gpu_wheels.sh` on a machine that reaches the package registry (it fills "
            f"{tmp_path / 'no-wheels'}/), then bring {tmp_path / 'no-wheels'}/ here") in lines
    assert SUMMARY.match(lines[-1]).groups() == ("0", "1", str(len(checks())))


def test_every_wheel_the_check_installs_is_pinned_in_the_wheels_script():
    entries = re.findall(r'"([^"]+)"', re.search(r"^WHEELS=\((.*)\)$", SCRIPT.read_text(), flags=re.M).group(1))
    needed = [entry.split()[0] for entry in entries]  # "pip-name module"
    pinned = dict(re.findall(r'^\s+"([\w.-]+)==([\w.]+)"', WHEELS_SCRIPT.read_text(), flags=re.M))
    assert needed and set(needed) <= set(pinned), (needed, pinned)
