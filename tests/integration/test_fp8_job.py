"""The CPU main job with FP8 rollout weights (`weight_sync.quantize=fp8`): the engines start
from the block-FP8 checkpoint, every sync sends FP8, the loss is corrected by the engines'
logprobs (here IcePop: token TIS and a token mask), and every iteration reports the
rollout-vs-trainer logprob gap over the whole batch, within the fp8 bound of the
served-vs-trained check, and per step of the episode. On the tiny MoE with
routing_replay=recompute (R2): the two epochs' updates route as the old-logprob pass did."""

from __future__ import annotations

import json
import os

import pytest

from megatron_agent.platform.launch import run_on_ranks

pytestmark = pytest.mark.multirank  # a spawned trainer rank plus an engine process


def _fp8_iterations(model_dir: str, run_dir: str) -> list[dict]:
    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    config = load_run_config([f"run_dir={run_dir}", f"model_dir={model_dir}", "num_groups=2", "group_size=2",
                              "iterations=2", "loop.max_steps=3", "stop_success=null", "weight_sync.quantize=fp8",
                              "algorithm.tis_cap=1.02", "algorithm.rollout_mask=token",
                              "algorithm.rollout_mask_low=0.98", "algorithm.rollout_mask_high=1.02",
                              "algorithm.routing_replay=recompute", "actor.ppo_epochs=2"])
    return train(config)


def test_fp8_rollout_job_reports_the_gap_each_iteration(tiny_model_dir, tmp_path):
    from megatron_agent.training.checks import QUANTIZED_MEAN_BOUND

    model_dir = tiny_model_dir("qwen3_moe")
    history = run_on_ranks(_fp8_iterations, 1, str(model_dir), str(tmp_path), timeout_s=300)[0]
    assert [row["iteration"] for row in history] == [0, 1]
    resolved = json.loads((tmp_path / "config.json").read_text())
    assert resolved["algorithm"]["rollout_mask"] == "token" and resolved["weight_sync"]["quantize"] == "fp8"
    engine_config = json.loads((tmp_path / "engine_model_fp8" / "config.json").read_text())
    assert engine_config["quantization_config"]["weight_block_size"] == [128, 128]
    for row in history:
        # FP8 shows (fp32 on both sides agrees to ~1e-6) and stays within the check's bound
        assert 1e-5 < row["fp8/rollout_logprob_mean_abs_diff"] < QUANTIZED_MEAN_BOUND["fp8"], row
        assert row["fp8/rollout_logprob_max_abs_diff"] >= row["fp8/rollout_logprob_mean_abs_diff"]
        assert 0 < row["rollout_correction/weight_mean"] <= 1.02
        turns = [k for k in range(3) if f"mismatch/turn_{k}/kl_k3" in row]
        assert turns[0] == 0 and all(row[f"mismatch/turn_{k}/kl_k3"] > 0 for k in turns)
        # the steps' worst gaps are the batch's worst, measured apart
        assert max(row[f"mismatch/turn_{k}/max_abs_diff"] for k in turns) == pytest.approx(
            row["fp8/rollout_logprob_max_abs_diff"], rel=1e-5)
        assert all(0 <= row[f"mismatch/turn_{k}/masked_fraction"] <= 1 for k in turns)
        assert 0 < row["weight_sync/bytes"] < os.path.getsize(model_dir / "model.safetensors")  # 1 byte a weight
