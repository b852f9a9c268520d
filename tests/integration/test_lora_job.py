"""The CPU job with LoRA adapters, as a user runs it: what it prints at start, what its
checkpoints hold, a resume with other settings refused, the merged model `mcore-to-hf` writes
from it, and the same run with the adapters alone synced to the engines.
Layouts, gradients and the merge against transformers: tests/multirank/test_lora.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

SMALL = ("num_groups=2", "group_size=2", "stop_success=null", "val_every=0", "samples_every=0", "save_every=1")


def run(module: str, *args):
    out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


def adapter_parameters_by_hand(config: dict, rank: int) -> int:
    """r·(in + out) for q/k/v fused, o, gate/up fused and down, in every layer."""
    hidden, heads, kv, head_dim = (config["hidden_size"], config["num_attention_heads"],
                                   config["num_key_value_heads"], config["head_dim"])
    ffn = config["intermediate_size"]
    per_layer = (rank * (hidden + (heads + 2 * kv) * head_dim) + rank * (heads * head_dim + hidden)
                 + rank * (hidden + 2 * ffn) + rank * (ffn + hidden))
    return per_layer * config["num_hidden_layers"]


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_lora_run_prints_saves_adapters_and_exports(tmp_path):
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    # the README's line, on a short warm start; an entropy term, so that every update moves
    # every adapter whatever the few episodes' rewards
    job = ("+experiment=maze", "actor.lora.rank=8", "iterations=3", "tiny_model.warm_start.episodes=8",
           "loop.max_steps=6", "algorithm.entropy_coef=0.01", *SMALL)
    first = run("megatron_agent.cli", "train", f"run_dir={run_dir}", *job)
    config = json.loads((run_dir / "model" / "config.json").read_text())
    trainable = adapter_parameters_by_hand(config, 8)
    assert f"actor: {trainable:,} trainable parameters (LoRA rank 8 on linear_qkv, linear_proj, linear_fc1, " \
           "linear_fc2)" in first.stdout
    assert f"Adam state {trainable * 8 / 1000:.1f} kB" in first.stdout  # fp32: two moments

    checkpoint = run_dir / "checkpoints" / "iter_000002"
    meta = json.loads((checkpoint / "megatron_agent.json").read_text())
    assert meta["lora"]["rank"] == 8 and meta["base_model"] == str((run_dir / "model").resolve())
    keys = load_tensors_metadata(str(checkpoint))
    assert {k.split(".")[0] for k in keys} == {"lora", "optimizer"}
    assert sum(math.prod(keys[k].global_shape) for k in keys if k.startswith("lora.")) == trainable

    # resumed without the adapters' settings (the resume itself: tests/multirank/test_lora.py)
    refused = subprocess.run([sys.executable, "-m", "megatron_agent.cli", "train", "+experiment=maze",
                              f"run_dir={run_dir}", f"resume={run_dir}", "iterations=4", *SMALL],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr  # before any process starts, naming both settings
    assert "error: bad configuration:" in refused.stderr and "holds LoRA adapters {'rank': 8" in refused.stderr
    assert "this run has no adapters (actor.lora.rank=0)" in refused.stderr

    merged_dir = tmp_path / "merged"
    run("tools.checkpoint_convert.cli", "mcore-to-hf", "--mcore", str(checkpoint),
        "--out", str(merged_dir))
    base, merged = load_file(run_dir / "model" / "model.safetensors"), load_file(merged_dir / "model.safetensors")
    assert merged.keys() == base.keys()
    for name, tensor in base.items():
        moved = not torch.equal(merged[name], tensor)
        assert moved == name.endswith(("_proj.weight",)), name  # the adapted linears alone

    adapter = tmp_path / "adapter"
    run("tools.checkpoint_convert.cli", "lora-to-peft", "--mcore", str(checkpoint), "--out", str(adapter))
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(f"{p}_proj" for p in ("q", "k", "v", "o", "gate", "up", "down"))
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert sum(t.numel() for t in tensors.values()) > trainable  # each fused linear's A once per HF module

    # the adapters alone to the engines: the engines serve what the merged weights served, token
    # for token (the same fp32 merge), the served-vs-trained check holds at every iteration, and
    # a sync carries the PEFT adapter's bytes instead of the model's
    adapters_dir = tmp_path / "adapters-run"
    run("megatron_agent.cli", "train", f"run_dir={adapters_dir}", "weight_sync.lora=adapters", *job)
    merged_rows, adapter_rows = rows(run_dir), rows(adapters_dir)
    def picked(prefixes):
        return [k for k in merged_rows[0] if k.startswith(prefixes) and not any(
            t in k for t in ("seconds", "per_s", "time"))]

    served, trained = picked(("train/", "gigpo/")), picked(("actor/", "check/"))
    assert len(served) > 10 and len(trained) > 10
    for merged, adapted in zip(merged_rows, adapter_rows, strict=True):
        assert {k: adapted[k] for k in served} == {k: merged[k] for k in served}  # the same tokens and rewards
        # the trainer's side to its own run-to-run noise (gloo's sums, ~1e-8)
        assert {k: adapted[k] for k in trained} == pytest.approx({k: merged[k] for k in trained}, rel=1e-4, abs=1e-6)
        assert adapted["check/rollout_logprob_max_abs_diff"] < 1e-5 and adapted["train/policy_staleness"] == 0
    assert merged_rows[-1]["actor/entropy"] != merged_rows[0]["actor/entropy"]  # the adapters moved
    kept = sorted(p.name for p in (adapters_dir / "adapters").iterdir())
    assert kept == ["policy-v2", "policy-v3"]  # the two newest versions; older ones unloaded and removed
    sent = load_file(adapters_dir / "adapters" / "policy-v3" / "adapter_model.safetensors")
    assert adapter_rows[-1]["weight_sync/bytes"] == sum(t.numel() * 4 for t in sent.values())
    assert merged_rows[-1]["weight_sync/bytes"] > 7 * adapter_rows[-1]["weight_sync/bytes"]

    # colocated: the adapters go by tensor handles, and the engines keep their base weights
    # while the actor trains (they release the KV cache alone: no sync would send the base back)
    colocated_dir = tmp_path / "colocated-run"
    run("megatron_agent.cli", "train", f"run_dir={colocated_dir}", "weight_sync.lora=adapters",
        "placement.colocate=true", *job[:2], "iterations=2", *job[3:])
    for merged, adapted in zip(merged_rows, rows(colocated_dir)):
        assert {k: adapted[k] for k in served} == {k: merged[k] for k in served}
        assert adapted["check/rollout_logprob_max_abs_diff"] < 1e-5
    assert not (colocated_dir / "adapters").exists()
