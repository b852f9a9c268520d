"""Vision-language models on Megatron against transformers: one 2-rank job loads the tiny
VLM's HF weights at each layout, compares the logits on a batch with 0, 1 and 2 images per
row and padding, and exports the weights back (bit-identical to the safetensors file);
the replicated vision tower's gradients agree over TP; a pipeline layout that parts
Qwen3-VL's deepstack layers from the vision tower is refused."""

from __future__ import annotations

import pytest
import torch

from megatron_agent.platform.launch import run_on_ranks
from tests.multirank.exports import assert_round_trip, layout_name
from tests.vlm_batch import vlm_batch

pytestmark = pytest.mark.multirank

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
LAYOUTS = [dict(), dict(tp=2), dict(tp=2, sequence_parallel=True), dict(pp=2)]
MOE_LAYOUTS = [dict(), dict(tp=2, sequence_parallel=True), dict(pp=2), dict(ep=2)]


def _layouts(family: str) -> list[dict]:
    return MOE_LAYOUTS if "moe" in family else LAYOUTS



def _worker(model_dirs: dict) -> dict:
    from transformers import AutoModelForImageTextToText

    from megatron_agent.models import UnsupportedModelError, build_model, read_hf_config
    from megatron_agent.models.bridge import export_hf_weights, load_hf_weights
    from megatron_agent.models.vision_inputs import vision_micro_batches
    from megatron_agent.platform import (
        ParallelConfig,
        destroy_model_parallel,
        init_distributed,
        initialize_model_parallel,
        set_seed,
    )
    from megatron_agent.training.schedule import micro_batch_logits, run_schedule

    ctx = init_distributed(ParallelConfig(), seed=3)
    destroy_model_parallel()
    out = {}
    for family, model_dir in model_dirs.items():
        hf = read_hf_config(model_dir)
        batch = vlm_batch(model_dir)
        real = batch["attention_mask"].bool()
        with torch.no_grad():
            hf_logits = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)(**batch).logits
        micro_batches = vision_micro_batches(batch["input_ids"], batch["pixel_values"], batch["image_grid_thw"], hf)
        results = out[family] = {}
        for layout in _layouts(family):
            parallel = ParallelConfig(**layout)
            initialize_model_parallel(parallel, ctx.world_size)
            set_seed(3)
            chunks = build_model(model_dir, parallel, training=False)
            load_hf_weights(chunks, model_dir)
            logits = micro_batch_logits(chunks, micro_batches, hf["vocab_size"])
            results[layout_name(layout)] = {
                "exported": {k: v.clone() for k, v in export_hf_weights(chunks, hf)},
                "logit_diff": None if logits is None else float((logits - hf_logits)[real].abs().max()),
            }
            if layout.get("sequence_parallel"):
                # The replicated tower's gradients must come out the same on every TP rank.
                for chunk in chunks:
                    chunk.train()
                run_schedule(chunks, [dict(mb, labels=torch.roll(mb["input_ids"], -1, 1),
                                           loss_mask=torch.ones(mb["input_ids"].shape)) for mb in micro_batches])
                results["vision grads"] = {n: p.grad.clone() for n, p in chunks[0].named_parameters()
                                           if n.startswith("vision.")}
            destroy_model_parallel()
        if family == "qwen3_vl":
            # Three deepstack maps need LM layers 0-2 on the vision tower's stage; PP=2 gives it 0-1.
            deeper = dict(hf, vision_config=dict(hf["vision_config"], deepstack_visual_indexes=[0, 1, 1]))
            initialize_model_parallel(ParallelConfig(pp=2), ctx.world_size)
            try:
                build_model(deeper, ParallelConfig(pp=2), training=False, meta=True)
                results["pp=2 deepstack refusal"] = None
            except UnsupportedModelError as err:
                results["pp=2 deepstack refusal"] = str(err)
            destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def vlm_results(tiny_model_dir):
    dirs = {f: str(tiny_model_dir(f)) for f in FAMILIES}
    return dirs, run_on_ranks(_worker, 2, dirs, timeout_s=600)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(vlm_results, family):
    _, per_rank = vlm_results
    for layout in _layouts(family):
        diffs = [r[family][layout_name(layout)]["logit_diff"] for r in per_rank]
        diffs = [d for d in diffs if d is not None]
        assert diffs and max(diffs) < 1e-4, (family, layout, diffs)


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_identical(vlm_results, family):
    dirs, per_rank = vlm_results
    assert_round_trip(dirs[family], per_rank, family, _layouts(family))


def test_deepstack_split_from_the_vision_tower_is_refused(vlm_results):
    _, per_rank = vlm_results
    errors = [r["qwen3_vl"]["pp=2 deepstack refusal"] for r in per_rank]
    assert all(e and "layers 0-2" in e and "first pipeline stage" in e for e in errors), errors


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_tower_gradients_agree_over_tp(vlm_results, family):
    _, (first, second) = vlm_results
    grads = first[family]["vision grads"]
    assert grads and all(g.abs().sum() > 0 for g in grads.values())
    assert all(torch.equal(g, second[family]["vision grads"][n]) for n, g in grads.items())
