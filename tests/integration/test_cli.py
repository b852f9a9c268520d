"""The command line as a user runs it: doctor, init-model, config errors, and the main job
killed and resumed. The main job and its resume as the README runs them (what the bar
and the last line say, what the run directory holds): test_readme_commands.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "megatron_agent.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU report")
def test_doctor_says_why_the_gpu_path_is_unavailable():
    out = run_cli("doctor")
    assert out.returncode == 0, out.stderr
    assert "megatron-core       0.16" in out.stdout or "megatron-core" in out.stdout
    assert "GPU path unavailable:" in out.stdout
    assert "CPU build" in out.stdout and "transformer_engine is not importable" in out.stdout
    assert "layer spec          local" in out.stdout


def test_init_model_writes_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM

    out = run_cli("init-model", "--family", "qwen3_moe", "--preset", "tiny", "--out", str(tmp_path / "m"))
    assert out.returncode == 0, out.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 4
    for flag, value in (("--family", "gpt2"), ("--preset", "huge")):  # names from the family tables and presets
        wrong = run_cli("init-model", "--family", "qwen3", flag, value, "--out", str(tmp_path / "w"))
        assert wrong.returncode == 2 and f"{flag} '{value}': choose one of" in wrong.stderr
        assert "qwen3_moe" in wrong.stderr or "small" in wrong.stderr
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.lrr=1", "Key 'lrr' not in 'ActorConfig'; full_key: actor.lrr"),
        ("actor.lr=fast", "full_key: actor.lr"),
        ("algorithm=gipgo", "algorithm/gipgo"),
        ("group_size=1", "group_size=1 with algorithm.advantage_estimator='gigpo'"),
        ("env_config.action_format=xml", "action_format='xml'"),
        ("seed", "override 'seed' is not key=value"),
    ],
)
def test_bad_config_fails_before_anything_starts_naming_the_key(tmp_path, override, message):
    out = run_cli("train", override, f"run_dir={tmp_path}")
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not (tmp_path / "model").exists()  # no model, engine or rank was started


KILL_TEST_SETTINGS = ["num_groups=4", "group_size=4", "stop_success=null", "seed=4", "iterations=5", "save_every=2",
                      "val_every=0", "samples_every=0"]


@pytest.fixture(scope="module")
def clean_dir(tmp_path_factory):
    """The uninterrupted run both SIGKILL tests compare with (the same settings), run once."""
    run_dir = tmp_path_factory.mktemp("clean")
    clean = run_cli("train", f"run_dir={run_dir}", *KILL_TEST_SETTINGS)
    assert clean.returncode == 0, clean.stderr
    return run_dir


def _resume_reproduces(run_dir, clean_dir, common: list[str]) -> None:
    """`resume=run_dir` finishes the run; every iteration's metrics equal the clean run's."""
    resumed = run_cli("train", f"run_dir={run_dir}", f"resume={run_dir}", f"model_dir={run_dir / 'model'}", *common)
    assert resumed.returncode == 0, resumed.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in (clean_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(5))
    for a, b in zip(expected, rows):
        for key in ("train/success_rate", "train/episode_return", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["iteration"], key)


def test_sigkill_mid_run_then_resume_reproduces_the_uninterrupted_run(tmp_path, clean_dir):
    common = KILL_TEST_SETTINGS
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_agent.cli", "train", f"run_dir={run_dir}", *common],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its engine process, mid-run
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    _resume_reproduces(run_dir, clean_dir, common)


KILL_INSIDE_THE_SECOND_SAVE = """
import os, signal, sys
from megatron.core import dist_checkpointing
from megatron_agent.cli import main

original, saves = dist_checkpointing.save, []

def save_then_die(*args, **kwargs):  # the tensors are written, the checkpoint is not complete yet
    original(*args, **kwargs)
    saves.append(1)
    if len(saves) == 2:
        os.kill(os.getpid(), signal.SIGKILL)

dist_checkpointing.save = save_then_die
sys.exit(main(["train", *sys.argv[1:]]))
"""


def test_sigkill_inside_a_checkpoint_save_then_resume_from_the_last_complete_one(tmp_path, clean_dir):
    import psutil

    common = KILL_TEST_SETTINGS
    run_dir = tmp_path / "killed"
    with open(tmp_path / "killed.log", "w") as log:
        killed = subprocess.Popen([sys.executable, "-c", KILL_INSIDE_THE_SECOND_SAVE, f"run_dir={run_dir}", *common],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        assert killed.wait(timeout=300) == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "iter_000002" / "megatron_agent.json").exists()
    assert not (checkpoints / "iter_000004").exists() and (checkpoints / ".iter_000004.partial").exists()
    # What the trainer started (its engine, the checkpoint writer's manager) died with it.
    time.sleep(1.0)
    left = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if os.getsid(p.pid) == killed.pid and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(" ".join(p.info["cmdline"] or []))
        except (ProcessLookupError, PermissionError):
            pass
    assert not left, left

    _resume_reproduces(run_dir, clean_dir, common)
    assert (checkpoints / "iter_000004" / "megatron_agent.json").exists()
