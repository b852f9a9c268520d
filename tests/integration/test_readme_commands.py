"""Every command of the README's "Other commands" block, as a user runs it after the first
`make`: here, on the CPU default, in a fresh working directory, with the fewest
iterations, groups and sizes that exercise it appended; or, where another test already
runs the line's arguments, checked to be that test's. The table below names each line
exactly, so a README line that changes (or a new one) fails here until it is run or
covered again."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent  # the README's .venv/bin

# A run of the CPU main job that exercises it: one update, on 2 groups of 2.
SMALL = ("num_groups=2", "group_size=2", "stop_success=null")


@dataclass(frozen=True)
class Run:
    """Run the line here, as written, with `appended` after it."""

    appended: tuple[str, ...] = ()


@dataclass(frozen=True)
class Covered:
    """`test` (path::function) runs the line's arguments: each of `arguments` is in the
    source of `test`'s file or of `helpers` (files it runs the command through)."""

    test: str
    arguments: tuple[str, ...]
    helpers: tuple[str, ...] = ()


COMMANDS = {
    ".venv/bin/megatron-agent train placement.trainer_ranks=2 parallel.tp=2": Covered(
        "tests/integration/test_driver.py::test_multi_rank_trainers_reproduce_the_single_rank_run",
        ("placement.trainer_ranks=2", "parallel.tp=2")),
    # there with placement.colocate=true; Ray's disaggregated engines (a bundle each) in
    # test_a_dead_engine_is_restarted_under_a_multi_rank_trainer_and_under_ray
    ".venv/bin/megatron-agent train placement.launcher=ray placement.trainer_ranks=2 parallel.pp=2": Covered(
        "tests/integration/test_driver.py::test_multi_rank_trainers_reproduce_the_single_rank_run",
        ("placement.launcher=ray", "placement.trainer_ranks=2", "parallel.pp=2")),
    ".venv/bin/megatron-agent train resume=runs/cpu-default run_dir=runs/cpu-default": Run(
        ("iterations=3", *SMALL, "val_every=0", "samples_every=0", "save_every=1")),
    ".venv/bin/megatron-agent train placement.colocate=true": Covered(
        "tests/integration/test_colocated_job.py::test_colocated_cpu_job_releases_resumes_and_serves_the_synced_weights",
        ("placement.colocate=true",)),
    ".venv/bin/megatron-agent train training.mode=overlap algorithm.tis_cap=2.0": Covered(
        "tests/integration/test_driver.py::test_overlapped_rollout_is_one_update_stale_and_resumes_exactly",
        ("training.mode=overlap", "algorithm.tis_cap=2.0")),
    ".venv/bin/megatron-agent train training.mode=async algorithm.tis_cap=2.0": Covered(
        "tests/integration/test_driver.py::test_async_training_killed_with_groups_in_flight_resumes_and_finishes",
        ("training.mode=async", "algorithm.tis_cap=2.0")),
    ".venv/bin/megatron-agent train rollout.workers=2": Covered(
        "tests/integration/test_driver.py::test_rollout_workers_on_a_ray_cluster_lose_no_group_when_one_is_killed",
        ("rollout.workers=2",)),
    ".venv/bin/megatron-agent train env=webshop tiny_model.tokenizer=bpe": Covered(
        "tests/integration/envs/test_webshop_job.py::test_train_two_iterations_on_webshop",
        ('"megatron_agent.cli", "train", f"env={env}"', '"webshop"', "tiny_model.tokenizer=bpe"),
        helpers=("tests/integration/envs/env_job.py",)),
    ".venv/bin/megatron-agent plot runs/a runs/b --out compare.png": Run(),
    ".venv/bin/megatron-agent show runs/cpu-default": Run(),
    ".venv/bin/megatron-agent eval --checkpoint runs/cpu-default --compare runs/cpu-default/model --num-samples 4":
        Covered("tests/integration/test_eval.py::test_the_comparison_table_and_json",
                ('"--checkpoint", str(run), "--compare", str(run / "model"), "--num-samples"',)),
    ".venv/bin/megatron-agent train 'logging.backends=[tensorboard,wandb,mlflow]'": Covered(
        "tests/integration/test_trackers.py::test_a_resumed_run_continues_both_tracker_runs_with_each_iteration_once",
        ('"logging.backends=[tensorboard,wandb,mlflow]"',)),
    ".venv/bin/megatron-agent train +experiment=maze actor.lora.rank=8 run_dir=runs/maze-lora": Covered(
        "tests/integration/test_lora_job.py::test_a_lora_run_prints_saves_adapters_and_exports",
        ("+experiment=maze", "actor.lora.rank=8")),
    ".venv/bin/megatron-agent train +experiment=maze actor.lora.rank=8 weight_sync.lora=adapters": Covered(
        "tests/integration/test_lora_job.py::test_a_lora_run_prints_saves_adapters_and_exports",
        ("+experiment=maze", "actor.lora.rank=8", '"weight_sync.lora=adapters"')),
    ".venv/bin/megatron-agent-convert lora-to-peft --mcore runs/maze-lora/checkpoints/iter_000040 --out maze-adapter":
        Covered("tests/integration/test_lora_job.py::test_a_lora_run_prints_saves_adapters_and_exports",
                ('"lora-to-peft", "--mcore"',)),
    ".venv/bin/python bench/gigpo_vs_grpo.py": Run(("--quick",)),
    ".venv/bin/megatron-agent doctor": Run(),
    ".venv/bin/megatron-agent init-model --family qwen3_moe --preset tiny --out models/moe": Run(),
    # the MoE (qwen3_moe is one of its families) through the same command lines there
    ".venv/bin/megatron-agent-convert hf-to-mcore --hf models/moe --out models/moe-mcore": Covered(
        "tests/integration/test_checkpoint_convert.py::test_round_trip_through_the_cli",
        ('convert("hf-to-mcore", "--hf", str(src), "--out", str(mcore)', '"qwen3_moe"')),
    ".venv/bin/megatron-agent-convert verify --hf models/moe --mcore models/moe-mcore --ep 2": Covered(
        "tests/integration/test_checkpoint_convert.py::test_round_trip_through_the_cli",
        ('"qwen3_moe": ["--ep", "2"]', 'convert("verify", "--hf", str(src), "--mcore", str(mcore), *LAYOUT[family])')),
    ".venv/bin/megatron-agent-convert mcore-to-hf --mcore models/moe-mcore --out models/moe-hf": Covered(
        "tests/integration/test_checkpoint_convert.py::test_round_trip_through_the_cli",
        ('convert("mcore-to-hf", "--mcore", str(mcore), "--out", str(back)', '"qwen3_moe"')),
    # a dense model through the command line there; the MoE quantized in test_moe_fp8_export_keeps_the_router
    ".venv/bin/megatron-agent-convert mcore-to-hf --mcore models/moe-mcore --out models/moe-fp8 --quantize fp8":
        Covered("tests/integration/test_quantized_export.py::test_fp8_export_is_modelopt_format",
                ('convert("mcore-to-hf", "--mcore"', '"--quantize", "fp8"')),
    "make bench": Run(("--repeats", "1", "--batch", "1", "--seq", "16")),
    ".venv/bin/python bench/convert_throughput.py": Run(("--quick",)),
    ".venv/bin/python bench/rollout_scale.py": Covered(
        "tests/unit/rollout/test_rollout_scale_bench.py::test_the_bench_runs_both_loops_to_the_same_samples",
        ('"bench" / "rollout_scale.py"', "bench.main([")),
    ".venv/bin/python bench/async_training.py": Run(("--quick",)),
    ".venv/bin/python bench/minimal_loop.py": Run(("--quick",)),
    ".venv/bin/python bench/weight_sync.py": Run(("--layers", "1", "--hidden", "64", "--intermediate", "128",
                                                  "--buckets-mib", "1", "--repeats", "1")),
}


def readme_commands() -> list[str]:
    """The lines of the ```bash block after "Other commands", without their comments."""
    text = (ROOT / "README.md").read_text()
    block = text.split("Other commands", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    return [shlex.join(shlex.split(line, comments=True)) for line in block.splitlines() if line.strip()]


def make_recipe(target: str) -> list[str]:
    """What `make TARGET` runs, the venv taken as installed (make -n: nothing is run)."""
    # Under `make test` this runs inside make: its MAKEFLAGS (--jobs) and MAKELEVEL would make
    # the inner make print "Entering directory" lines.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    out = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", target], cwd=ROOT,
                         capture_output=True, text=True, check=True, env=env)
    (line,) = [line for line in out.stdout.splitlines() if line.strip()]
    return shlex.split(line)


def as_run_here(words: list[str]) -> list[str]:
    """The README's paths (.venv/bin/..., bench/...) from the repository root; the rest as is."""
    resolved = []
    for word in words:
        if word.startswith(".venv/bin/"):
            word = str(VENV_BIN / word.removeprefix(".venv/bin/"))
        elif word.startswith("bench/"):
            word = str(ROOT / word)
        resolved.append(word)
    return resolved


def test_every_readme_command_is_run_or_covered():
    assert readme_commands() == list(COMMANDS), "a README line changed: run it here or name the test that runs it"
    for command, step in COMMANDS.items():
        if isinstance(step, Covered):
            path, function = step.test.split("::")
            source = (ROOT / path).read_text()
            assert f"def {function}(" in source, (command, step.test)
            sources = source + "".join((ROOT / helper).read_text() for helper in step.helpers)
            missing = [argument for argument in step.arguments if argument not in sources]
            assert not missing, (command, step.test, missing)
    assert make_recipe("bench")[1] == "bench/tiny_forward_backward.py"  # the flags Run appends are its


def run(words: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    started = time.perf_counter()
    out = subprocess.run(as_run_here(words), cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{shlex.join(words)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    print(f"{time.perf_counter() - started:6.1f} s  {shlex.join(words)}")  # what each costs (pytest -s)
    return out


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path):
    """In README order, in a fresh directory, after the equivalent of the first `make train`."""
    first_make = make_recipe("train")  # .venv/bin/megatron-agent train
    out = run([*first_make, "iterations=2", *SMALL, "val_every=2", "samples_every=1", "save_every=1",
               "loop.validation.num_episodes=2"], tmp_path)
    run_dir = tmp_path / "runs" / "cpu-default"
    assert "gigpo on numberline" in out.stdout and "2 iterations (0-1) in" in out.stdout
    assert "wall time, start-up included" in out.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [0, 1]
    assert "val/success_rate" in rows[1] and "val/success_rate" not in rows[0]
    assert (run_dir / "model" / "config.json").exists() and list((run_dir / "tensorboard").glob("events.*"))
    assert json.loads((run_dir / "config.json").read_text())["env"] == "numberline"
    assert "observation: Target:" in (run_dir / "samples" / "iter_000001.txt").read_text()
    # no bar of another library inside the run's (the tiny model is written at the start)
    assert "Writing model shards" not in out.stderr and "0/2" in out.stderr and "2/2" in out.stderr
    (tmp_path / "runs" / "b").mkdir()  # the run as it was, for `plot runs/a runs/b`
    shutil.copy(run_dir / "metrics.jsonl", tmp_path / "runs" / "b")

    for command, step in COMMANDS.items():
        if isinstance(step, Covered):
            continue
        words = shlex.split(command)
        if words[0] == "make":
            words = make_recipe(words[1])
        if words[1:3] == ["plot", "runs/a"]:
            shutil.copytree(run_dir, tmp_path / "runs" / "a")
        out = run([*words, *step.appended], tmp_path)

        if "resume=runs/cpu-default" in command:
            # resumed at iteration 2: the bar counts from there; no warning a user cannot act on
            assert "resuming at iteration 2" in out.stdout and "1 iteration (2) in" in out.stdout
            assert "2/3" in out.stderr and "3/3" in out.stderr and "0/3" not in out.stderr
            assert "Warning" not in out.stderr, out.stderr
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            assert [row["iteration"] for row in rows] == [0, 1, 2]
        elif words[1:2] == ["show"]:  # the first run's samples (samples_every=1): iterations 0 and 1
            assert out.stdout.strip() == f"wrote {Path('runs/cpu-default/episodes.html')}"
            page = (run_dir / "episodes.html").read_text()
            assert page.index('<option value="1">') < page.index('<option value="0">')  # newest first
            assert "Target:" in page  # NumberLine's observation
        elif words[1:2] == ["plot"]:
            assert "wrote compare.png" in out.stdout and "|  | a | b |" in out.stdout
            assert (tmp_path / "compare.png").stat().st_size > 10_000
        elif command.endswith("gigpo_vs_grpo.py"):
            lines = out.stdout.splitlines()
            assert "expected about" in lines[0]  # said before anything runs
            assert lines[1].startswith("run 1/2: dense grpo seed 0")
            assert "dense gigpo seed 0: iteration 1/1" in out.stdout
            assert (tmp_path / "runs" / "gigpo-vs-grpo" / "results.md").exists()
        elif command.endswith("minimal_loop.py"):
            assert "about 1.5 minutes" in out.stdout.splitlines()[0] and "minimal_loop: product" in out.stdout
        elif words[1:2] == ["init-model"]:
            assert (tmp_path / "models" / "moe" / "config.json").exists()
