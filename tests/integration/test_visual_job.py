"""The visual CPU job (`+experiment=visual-quiz`): a tiny Qwen2.5-VL made on the spot,
VisualQuiz images through the prompts, the embedded engine, the step samples and the
Megatron actor. After every weight sync the engine's logprobs of what it sampled equal
the actor's recomputed ones (fp32 on both sides) within 1e-4, images included."""

from __future__ import annotations

import json

import pytest

from megatron_agent.platform.launch import run_on_ranks

pytestmark = pytest.mark.multirank  # a spawned trainer rank plus an engine process


def _visual_iterations(run_dir: str) -> list[dict]:
    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    config = load_run_config(["+experiment=visual-quiz", f"run_dir={run_dir}", "num_groups=4", "group_size=4",
                              "iterations=3", "stop_success=null", "val_every=2", "loop.validation.num_episodes=4",
                              "samples_every=1"])
    return train(config)


def test_visual_job_serves_and_trains_the_same_images(tmp_path):
    history = run_on_ranks(_visual_iterations, 1, str(tmp_path), timeout_s=300)[0]
    assert [row["iteration"] for row in history] == [0, 1, 2]
    resolved = json.loads((tmp_path / "config.json").read_text())
    assert resolved["env"] == "visual_quiz" and resolved["tiny_model"]["family"] == "qwen2_5_vl"
    assert resolved["env_config"]["render_image"] is True and resolved["loop"]["prompt"]["max_images"] == 1
    model = json.loads((tmp_path / "model" / "config.json").read_text())
    assert model["model_type"] == "qwen2_5_vl" and "vision_config" in model
    for row in history:  # iterations 1 and 2 run on synced weights
        assert row["check/rollout_logprob_max_abs_diff"] <= 1e-4, row
        assert row["train/num_samples"] == 16 and row["train/response_length"] == 1.0
    assert "val/success_rate" in history[1]
    episodes = "".join(path.read_text() for path in (tmp_path / "samples").glob("*.txt"))
    assert "images: 56x56x3" in episodes  # the observation's image reached the step samples
