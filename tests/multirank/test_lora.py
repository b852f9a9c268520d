"""LoRA on the actor across layouts, against transformers and against itself at TP=1.

One 2-rank job per family runs each layout in turn on the same batches (dense: TP=2,
PP=2, DP=2 with the adapters in the distributed optimizer; MoE: TP=2 with SP, EP=2), with
adapters of rank 4 on every linear (experts included) and a KL loss to the base:
- after two updates (B starts at zero, so the second is the first to move A), the
  merged weights and the logprobs equal TP=1's (1e-5), and transformers with the
  merged weights gives the same logprobs (1e-4);
- the base never moves, and the KL reference (the adapters switched off) is the base;
- the trainable parameters are the adapters' alone, as many as counted by hand;
- the checkpoint holds only adapters and their optimizer state; saved at the layout,
  loaded at TP=1, it continues to the same weights as the run that never stopped;
- `mcore-to-hf` of it writes the merged model the actor exports;
- the adapters gathered whole for an adapter-only weight sync are TP=1's at every layout,
  and the checkpoint's `lora-to-peft` gives the same PEFT adapter.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from megatron_agent.models import read_hf_config
from megatron_agent.platform.launch import run_on_ranks
from tests.multirank.test_actor import TEMPERATURE, _batch, _max_diff, _merged_weights, _name, actor_maker

pytestmark = pytest.mark.multirank

# DISTRIBUTED: DP=2 with the adapters in the distributed optimizer (the others keep Adam whole)
DISTRIBUTED = "distributed_optimizer"
LAYOUTS = {"qwen3": [dict(tp=2), dict(pp=2), {DISTRIBUTED: True}],
           "qwen3_moe": [dict(tp=2, sequence_parallel=True), dict(ep=2)]}
RANK, ALPHA = 4, 8.0


def _worker(model_dir: str, ckpt_root: str, layouts: list[dict]) -> dict:
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import load_tensors_metadata

    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.models.lora import LoraConfig, adapters, adapters_off
    from megatron_agent.platform import destroy_model_parallel
    from megatron_agent.training.actor import ActorConfig

    hf = read_hf_config(model_dir)
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01)
    config = ActorConfig(lr=1e-3, max_tokens_per_micro_batch=32, use_distributed_optimizer=False,
                         lora=LoraConfig(rank=RANK, alpha=ALPHA))
    make = actor_maker(model_dir, algorithm)
    results = {}

    def weights(actor):
        return {k: v.clone() for k, v in actor.named_hf_weights()}

    def update(actor, seed_batch):
        batch = seed_batch()
        batch.old_logprobs = actor.compute_logprobs(batch)["logprobs"]
        return actor.update(batch)

    for layout in [dict()] + layouts:
        actor = make(parallel_of(layout), replace(config, use_distributed_optimizer=DISTRIBUTED in layout))
        batch = _batch(hf["vocab_size"])
        out = {"before": actor.compute_logprobs(batch)["logprobs"], "trainable": actor.trainable_parameters,
               "held": sum(a.a.numel() + a.b.numel() for a in adapters(actor.chunks)),  # this rank's
               "optimized": sum(p.numel() for g in actor.optimizer.param_groups for p in g["params"])}
        update(actor, lambda: _batch(hf["vocab_size"]))
        out["after_1"] = actor.compute_logprobs(batch)["logprobs"]
        if layout:
            actor.save(f"{ckpt_root}/{_name(layout)}/iter_1")
        metrics = update(actor, lambda: _batch(hf["vocab_size"]))
        out.update(after=actor.compute_logprobs(batch)["logprobs"], metrics=metrics, weights=weights(actor),
                   reference=actor.compute_logprobs(batch, reference=True)["logprobs"],
                   peft=actor.lora_adapter())  # what an adapter-only weight sync sends (rank 0)
        with adapters_off(actor.chunks):
            out["base"] = weights(actor)
        if not layout:  # for megatron-agent-convert mcore-to-hf
            actor.save(f"{ckpt_root}/tp=1/iter_2")
        results[_name(layout)] = out
        del actor
        destroy_model_parallel()

    for layout in resumable(layouts):  # each checkpoint resumed at TP=1 (DP=2) for the second update
        actor = make(dict(), config)
        actor.load(f"{ckpt_root}/{_name(layout)}/iter_1")
        update(actor, lambda: _batch(hf["vocab_size"]))
        results["resumed " + _name(layout)] = {"weights": weights(actor)}
        del actor
        destroy_model_parallel()
    results["checkpoint keys"] = sorted(load_tensors_metadata(f"{ckpt_root}/{_name(layouts[0])}/iter_1"))
    dist.barrier()
    return results


def resumable(layouts):
    """An optimizer saved at ep > 1 does not load at ep = 1 (refused: tests/multirank/test_actor.py),
    nor a distributed optimizer's into a whole one."""
    return [layout for layout in layouts if layout.get("ep", 1) == 1 and DISTRIBUTED not in layout]


def parallel_of(layout: dict) -> dict:
    return {k: v for k, v in layout.items() if k != DISTRIBUTED}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def lora_results(request, tiny_model_dir, tmp_path_factory):
    family = request.param
    model_dir = tiny_model_dir(family)
    ckpt_root = tmp_path_factory.mktemp(f"lora_{family}")
    results = run_on_ranks(_worker, 2, str(model_dir), str(ckpt_root), LAYOUTS[family], timeout_s=900)
    return family, model_dir, results, ckpt_root


def test_updates_match_tp1_and_transformers_with_the_merged_weights(lora_results, tmp_path):
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    family, model_dir, per_rank, _ = lora_results
    reference = per_rank[0]["tp=1"]
    batch = _batch(read_hf_config(model_dir)["vocab_size"])
    mask = batch.response_mask.bool()
    assert (reference["after"] - reference["before"])[mask].mean() > 0.01  # every advantage is positive
    merged = _merged_weights(per_rank, "tp=1", "weights")
    shutil.copytree(model_dir, tmp_path / "merged")
    save_file(merged, tmp_path / "merged" / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    logits = hf(batch.tokens).logits[:, :-1] / TEMPERATURE
    teacher = torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    assert (reference["after"] - teacher)[mask].abs().max() < 1e-4
    for layout in LAYOUTS[family]:
        assert _max_diff(_merged_weights(per_rank, _name(layout), "weights"), merged) < 1e-5, layout
        for rank in per_rank:
            assert (rank[_name(layout)]["after"] - reference["after"])[mask].abs().max() < 1e-5, layout
        assert per_rank[0][_name(layout)]["metrics"]["actor/grad_norm"] == pytest.approx(
            reference["metrics"]["actor/grad_norm"], rel=1e-5), layout


def test_the_base_stays_and_is_the_kl_reference(lora_results):
    from safetensors.torch import load_file

    family, model_dir, per_rank, _ = lora_results
    initial = load_file(f"{model_dir}/model.safetensors")
    mask = _batch(read_hf_config(model_dir)["vocab_size"]).response_mask.bool()
    for layout in [dict()] + LAYOUTS[family]:
        base = _merged_weights(per_rank, _name(layout), "base")
        assert _max_diff({k: initial[k] for k in base}, base) == 0.0, layout
        merged = _merged_weights(per_rank, _name(layout), "weights")
        assert _max_diff({k: initial[k] for k in merged}, merged) > 1e-4, layout  # the adapters moved it
        for rank in per_rank:
            got = rank[_name(layout)]
            assert torch.equal(got["reference"][mask], got["before"][mask]), layout


def test_only_the_adapters_train_and_are_saved(lora_results):
    from megatron_agent.models.lora import LoraConfig
    from megatron_agent.models.memory import lora_parameters
    from megatron_agent.platform import ParallelConfig

    family, model_dir, per_rank, _ = lora_results
    hf = read_hf_config(model_dir)
    by_hand = sum(lora_parameters(hf, LoraConfig(rank=RANK, alpha=ALPHA)))
    for layout in [dict()] + LAYOUTS[family]:
        assert per_rank[0][_name(layout)]["trainable"] == by_hand, layout
        # what memory.py counts on the first stage's GPU at this layout
        held = sum(lora_parameters(hf, LoraConfig(rank=RANK, alpha=ALPHA), ParallelConfig(**parallel_of(layout))))
        assert per_rank[0][_name(layout)]["held"] == held, layout
    assert sum(r["tp=1"]["optimized"] for r in per_rank) == 2 * by_hand  # DP=2: each rank all of them
    keys = per_rank[0]["checkpoint keys"]
    model_keys = [k for k in keys if not k.startswith("optimizer.")]
    assert model_keys and all(k.startswith("lora.decoder.layers.") for k in model_keys), model_keys[:5]
    layers = hf["num_hidden_layers"]
    assert f"lora.decoder.layers.{layers - 1}.self_attention.linear_qkv.a" in model_keys  # global layer index


def test_resume_at_tp1_continues_exactly(lora_results):
    family, _, per_rank, _ = lora_results
    for layout in resumable(LAYOUTS[family]):
        uninterrupted = _merged_weights(per_rank, _name(layout), "weights")
        resumed = _merged_weights(per_rank, "resumed " + _name(layout), "weights")
        assert _max_diff(resumed, uninterrupted) < 1e-5, layout


def test_mcore_to_hf_writes_the_merged_model(lora_results, tmp_path):
    """The converter's merge (the base read from its HF directory, the adapters from the
    checkpoint) gives the tensors the actor exported merged."""
    from safetensors.torch import load_file

    from tools.checkpoint_convert.convert import mcore_to_hf

    family, model_dir, per_rank, ckpt_root = lora_results
    out = mcore_to_hf(ckpt_root / "tp=1" / "iter_2", tmp_path / "merged")
    converted = {}
    for shard in out.glob("*.safetensors"):
        converted.update(load_file(shard))
    assert _max_diff(converted, _merged_weights(per_rank, "tp=1", "weights")) < 1e-6


def _peft_logprobs(model_dir, adapter_dir, batch) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.tokens).logits[:, :-1] / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None])[..., 0]


def test_the_peft_export_gives_the_actors_logprobs(lora_results, tmp_path):
    """PEFT's own loader puts the exported adapter on the HF base (dense, and MoE with each
    expert's adapter on transformers' fused experts): the actor's logprobs, from a checkpoint
    saved at TP=1 (after two updates) and at the first layout (TP=2, after one)."""
    from tools.checkpoint_convert.convert import lora_to_peft

    family, model_dir, per_rank, ckpt_root = lora_results
    batch = _batch(read_hf_config(model_dir)["vocab_size"])
    mask = batch.response_mask.bool()
    layout = _name(LAYOUTS[family][0])
    for checkpoint, actor in ((ckpt_root / "tp=1" / "iter_2", per_rank[0]["tp=1"]["after"]),
                              (ckpt_root / layout / "iter_1", per_rank[0][layout]["after_1"])):
        adapter = lora_to_peft(checkpoint, tmp_path / checkpoint.parent.name)
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["r"] == RANK and config["lora_alpha"] == ALPHA and config["base_model_name_or_path"]
        assert (_peft_logprobs(model_dir, adapter, batch) - actor)[mask].abs().max() < 1e-5, checkpoint


def test_the_adapters_gathered_for_the_engines_are_the_same_at_every_layout(lora_results, tmp_path):
    """`Actor.lora_adapter` (the adapter-only weight sync's payload, on rank 0 alone): at
    TP=2 (+SP), PP=2 and EP=2 the tensors TP=1 gives; equal to lora-to-peft of TP=1's
    checkpoint after the same two updates."""
    from safetensors.torch import load_file

    from tools.checkpoint_convert.convert import lora_to_peft

    family, model_dir, per_rank, ckpt_root = lora_results
    assert per_rank[1]["tp=1"]["peft"] is None
    config, tensors = per_rank[0]["tp=1"]["peft"]
    exported = load_file(lora_to_peft(ckpt_root / "tp=1" / "iter_2", tmp_path / "peft") / "adapter_model.safetensors")
    assert _max_diff(exported, tensors) == 0.0 and exported.keys() == tensors.keys()
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA
    for layout in LAYOUTS[family]:
        got_config, got = per_rank[0][_name(layout)]["peft"]
        assert got.keys() == tensors.keys() and got_config == config, layout
        # factors to 1e-4: Adam's first steps (m/sqrt(v)) magnify the summation order's fp32
        # differences in near-zero gradients; their products, the merged weights, agree to 1e-5 (above)
        assert _max_diff(got, tensors) < 1e-4, layout
