"""The CPU job with colocated engines (placement.colocate=true, launcher=local): after each
rollout the engine releases its memory (it then reports it and refuses to generate),
the sync resumes it and hands the weights over as shared-memory tensor handles, and the
next rollout's logprobs equal the actor's (the driver's served-vs-trained check). The
same against the real SGLang server: tests/integration/rollout/test_sglang.py."""

from __future__ import annotations

import math

import pytest

from megatron_agent.platform.launch import run_on_ranks

pytestmark = pytest.mark.multirank  # a spawned trainer rank plus an engine process


def _train_probing_the_release(overrides: list[str]) -> list[dict]:
    """The run's rows, each with what the engine said right after its release: the memory
    it reports released and the answer to a generation."""
    from megatron_agent.driver import train
    from megatron_agent.engine_fleet import EngineFleet
    from megatron_agent.run_config import load_run_config
    from rollout.engine_client import EngineError

    release, probes = EngineFleet.release_memory, []

    def release_and_probe(self):
        release(self)
        refused = None
        try:
            self.client.generate([[1, 2, 3]], {"temperature": 0.0, "max_new_tokens": 2})
        except EngineError as err:
            refused = str(err)
        probes.append({"released": self.client.model_info()[0]["memory_released"], "refused": refused})

    EngineFleet.release_memory = release_and_probe
    return train(load_run_config(overrides), on_iteration=lambda row: row.update(probe=probes[-1]))


def test_colocated_cpu_job_releases_resumes_and_serves_the_synced_weights(tiny_model_dir, tmp_path):
    overrides = [f"run_dir={tmp_path}", f"model_dir={tiny_model_dir('qwen3')}", "placement.colocate=true",
                 "num_groups=2", "group_size=2", "iterations=3", "loop.max_steps=3", "stop_success=null",
                 "val_every=0", "save_every=0", "samples_every=0", "check.every=1",
                 "weight_sync.check=true"]  # the engines' checksums of every tensor, compared after each sync
    history = run_on_ranks(_train_probing_the_release, 1, overrides, timeout_s=600)[0]
    assert [row["iteration"] for row in history] == [0, 1, 2]
    for row in history:
        assert row["probe"]["released"] == ["kv_cache", "weights"]
        assert "HTTP 400" in row["probe"]["refused"] and "memory is released" in row["probe"]["refused"]
        assert row["engine/memory_released"] == 1.0  # this iteration's sync resumed it
        assert row["weight_sync/bytes"] > 0 and row["weight_sync/buckets"] >= 1
        # the rollout ran on the weights the last sync handed over (iteration 0: the disk's)
        assert row["check/rollout_logprob_max_abs_diff"] < 1e-4, row
        assert math.isfinite(row["actor/pg_loss"])
