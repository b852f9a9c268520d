"""Vision-language models on Megatron against transformers: one 2-rank job loads the tiny
VLM's HF weights at each layout, compares the logits on a batch with 0, 1 and 2 images per
row and padding, and exports the weights back (bit-identical to the safetensors file);
the replicated vision tower's gradients agree over TP; a pipeline layout that parts
Qwen3-VL's deepstack layers from the vision tower is refused.

The same job trains the actor on that batch (a TrainBatch with images): its logprobs
equal transformers' teacher-forced ones, for Qwen2.5-VL at DP=2 (the batch scattered as
shards), TP=2 with sequence parallelism (padded micro-batches) and PP=2, for Qwen3-VL-MoE
at DP=2 and EP=2, and one update gives the same weights at each. A 4-rank job (slow)
checks logits, export and the actor (logprobs and update) at TP=2 x PP=2."""

from __future__ import annotations

import pytest
import torch

from megatron_agent.models import read_hf_config
from megatron_agent.platform.launch import run_on_ranks
from tests.multirank.exports import assert_round_trip, layout_name
from tests.vlm_batch import vlm_batch

pytestmark = pytest.mark.multirank

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
LAYOUTS = [dict(), dict(tp=2), dict(tp=2, sequence_parallel=True), dict(pp=2)]
MOE_LAYOUTS = [dict(), dict(tp=2, sequence_parallel=True), dict(pp=2), dict(ep=2)]
FOUR_RANK_LAYOUT = dict(tp=2, pp=2)
FOUR_RANK_FAMILIES = FAMILIES


def _layouts(family: str) -> list[dict]:
    return MOE_LAYOUTS if "moe" in family else LAYOUTS


# The actor's layouts, each family's first the reference (DP=2 on 2 ranks).
ACTOR_LAYOUTS = {"qwen2_5_vl": [dict(), dict(tp=2, sequence_parallel=True), dict(pp=2)],
                 "qwen3_vl_moe": [dict(), dict(ep=2)]}
TEMPERATURE = 0.9
RESPONSE_TOKENS = 3  # the last real tokens of each row are the response


def _actor_batch(batch: dict, images_per_row=(0, 1, 2)):
    """vlm_batch's rows (made with `images_per_row`) as a TrainBatch: prompt with the row's
    images, the last RESPONSE_TOKENS real tokens as response."""
    from megatron_agent.training.batch import TrainBatch

    grids, images, image, patch = batch["image_grid_thw"], [], 0, 0
    for n in images_per_row:
        patches = int(grids[image:image + n].prod(-1).sum())
        images.append((batch["pixel_values"][patch:patch + patches], grids[image:image + n]) if n else None)
        image, patch = image + n, patch + patches
    ids = [r[:n].tolist() for r, n in zip(batch["input_ids"], batch["attention_mask"].sum(-1).tolist())]
    return TrainBatch.from_sequences([r[:-RESPONSE_TOKENS] for r in ids], [r[-RESPONSE_TOKENS:] for r in ids],
                                     pad_id=int(batch["input_ids"][0, -1]), advantages=[1.0, -0.5, 1.5],
                                     temperature=TEMPERATURE, images=images)


def _teacher_logprobs(hf_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logprob of each next token [N, L-1] (logits of the padded batch)."""
    logits = hf_logits[:, : tokens.shape[1] - 1] / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


def _actor_runs(model_dir: str, layouts: list[dict], world_size: int, hf_logits: torch.Tensor) -> dict:
    """compute_logprobs and one update at each layout; at DP > 1 the leader scatters the
    batch and each rank works on its shard, as the driver does."""
    import torch.distributed as dist

    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.platform import (
        ParallelConfig,
        destroy_model_parallel,
        initialize_model_parallel,
        set_seed,
    )
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.training.batch import scatter_batch

    whole = _actor_batch(vlm_batch(model_dir))
    results = {"teacher": _teacher_logprobs(hf_logits, whole.tokens), "lengths": whole.lengths,
               "response_mask": whole.response_mask}
    config = ActorConfig(lr=1e-4, max_tokens_per_micro_batch=48, use_distributed_optimizer=False)
    algorithm = AlgorithmConfig(use_kl_loss=False, entropy_coef=0.01)
    for layout in layouts:
        parallel = ParallelConfig(**layout)
        initialize_model_parallel(parallel, world_size)
        set_seed(3)
        actor = Actor(model_dir, parallel, config, algorithm)
        batch = whole
        if actor.dp_size > 1:
            batch = scatter_batch(whole if dist.get_rank() == 0 else None, actor.dp_size)
        logprobs = actor.compute_logprobs(batch, with_entropy=False)["logprobs"]
        batch.old_logprobs = logprobs
        metrics = actor.update(batch)
        results[layout_name(layout)] = {
            "logprobs": logprobs, "rows": batch.positions(), "metrics": metrics,
            "images_per_sample": batch.images_per_sample, "pixel_values": batch.pixel_values,
            "weights": {k: v.clone() for k, v in actor.named_hf_weights()},
        }
        del actor
        destroy_model_parallel()
    return results



def _worker(model_dirs: dict, layouts: dict[str, list[dict]], actor_layouts: dict[str, list[dict]],
            extra_checks: bool = True) -> dict:
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
    hf_logits_of = {}
    for family, model_dir in model_dirs.items():
        hf = read_hf_config(model_dir)
        batch = vlm_batch(model_dir)
        real = batch["attention_mask"].bool()
        with torch.no_grad():
            hf_logits = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)(**batch).logits
        hf_logits_of[family] = hf_logits
        micro_batches = vision_micro_batches(batch["input_ids"], batch["pixel_values"], batch["image_grid_thw"], hf)
        results = out[family] = {}
        for layout in layouts[family]:
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
            if layout.get("sequence_parallel") and extra_checks:
                # The replicated tower's gradients must come out the same on every TP rank.
                for chunk in chunks:
                    chunk.train()
                run_schedule(chunks, [dict(mb, labels=torch.roll(mb["input_ids"], -1, 1),
                                           loss_mask=torch.ones(mb["input_ids"].shape)) for mb in micro_batches])
                results["vision grads"] = {n: p.grad.clone() for n, p in chunks[0].named_parameters()
                                           if n.startswith("vision.")}
            destroy_model_parallel()
        if family == "qwen3_vl" and extra_checks:
            # Three deepstack maps need LM layers 0-2 on the vision tower's stage; PP=2 gives it 0-1.
            deeper = dict(hf, vision_config=dict(hf["vision_config"], deepstack_visual_indexes=[0, 1, 1]))
            initialize_model_parallel(ParallelConfig(pp=2), ctx.world_size)
            try:
                build_model(deeper, ParallelConfig(pp=2), training=False, meta=True)
                results["pp=2 deepstack refusal"] = None
            except UnsupportedModelError as err:
                results["pp=2 deepstack refusal"] = str(err)
            destroy_model_parallel()
    out["actor"] = {family: _actor_runs(model_dirs[family], family_layouts, ctx.world_size, hf_logits_of[family])
                    for family, family_layouts in actor_layouts.items()}
    return out


@pytest.fixture(scope="module")
def vlm_results(tiny_model_dir):
    dirs = {f: str(tiny_model_dir(f)) for f in FAMILIES}
    return dirs, run_on_ranks(_worker, 2, dirs, {f: _layouts(f) for f in FAMILIES}, ACTOR_LAYOUTS, timeout_s=600)


@pytest.fixture(scope="module")
def four_rank_results(tiny_model_dir):
    """TP=2 x PP=2: logits, export and the actor's logprobs, in one 4-rank job."""
    dirs = {f: str(tiny_model_dir(f)) for f in FOUR_RANK_FAMILIES}
    return dirs, run_on_ranks(_worker, 4, dirs, {f: [FOUR_RANK_LAYOUT] for f in dirs},
                              {"qwen2_5_vl": [FOUR_RANK_LAYOUT]},
                              extra_checks=False, timeout_s=600)


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


def _whole_batch(dirs, family):
    return _actor_batch(vlm_batch(dirs[family]))


def _whole_logprobs(per_rank: list[dict], family: str, name: str, whole) -> list[torch.Tensor]:
    """Each rank's logprobs at layout `name` placed in the whole batch's [N, L-1] (a DP
    shard's rows where they sit; the rows a rank did not get stay NaN)."""
    out = []
    for rank in per_rank:
        got = rank["actor"][family][name]
        full = torch.full(whole.response_mask.shape, float("nan"))
        full[got["rows"], : got["logprobs"].shape[1]] = got["logprobs"]
        out.append(full)
    return out


def _real_targets(whole) -> torch.Tensor:
    return torch.arange(whole.tokens.shape[1] - 1) < (whole.lengths - 1).unsqueeze(1)


def test_actor_batch_shards_keep_their_images(vlm_results):
    dirs, (first, second) = vlm_results
    whole = _whole_batch(dirs, "qwen2_5_vl")
    assert whole.images_per_sample.tolist() == [0, 1, 2] and whole.pixel_values.shape[0] == 16 + 16 + 32
    # DP=2: rank 0 holds samples 0 and 2 (images 2 and 3: patches 16-63), rank 1 sample 1 (patches 0-15)
    dp0, dp1 = first["actor"]["qwen2_5_vl"]["tp=1"], second["actor"]["qwen2_5_vl"]["tp=1"]
    assert dp0["rows"].tolist() == [0, 2] and dp0["images_per_sample"].tolist() == [0, 2]
    assert torch.equal(dp0["pixel_values"], whole.pixel_values[16:])
    assert dp1["rows"].tolist() == [1] and torch.equal(dp1["pixel_values"], whole.pixel_values[:16])
    # image tokens are prompt tokens: never a target the loss sees
    image_targets = whole.tokens[:, 1:] == read_hf_config(dirs["qwen2_5_vl"])["image_token_id"]
    assert int(image_targets.sum()) == 4 + 4 + 8 and not whole.response_mask[image_targets].any()


@pytest.mark.parametrize("family", sorted(ACTOR_LAYOUTS))
def test_actor_logprobs_with_images_match_transformers_at_every_layout(vlm_results, family):
    dirs, per_rank = vlm_results
    whole = _whole_batch(dirs, family)
    real = _real_targets(whole)
    teacher = per_rank[0]["actor"][family]["teacher"]
    reference = _whole_logprobs(per_rank, family, "tp=1", whole)
    dp2 = torch.where(reference[0].isnan(), reference[1], reference[0])  # DP=2: each row from its rank
    assert not dp2[real].isnan().any() and (dp2 - teacher)[real].abs().max() < 1e-5
    for layout in ACTOR_LAYOUTS[family][1:]:
        for got in _whole_logprobs(per_rank, family, layout_name(layout), whole):
            if layout.get("ep", 1) > 1:  # EP=2 keeps DP=2: each rank its shard's rows
                got = torch.where(got.isnan(), dp2, got)
            assert (got - teacher)[real].abs().max() < 1e-5, layout
            assert (got - dp2)[real].abs().max() < 1e-5, layout


def _weights(per_rank: list[dict], family: str, name: str) -> dict:
    return {k: v for r in per_rank for k, v in r["actor"][family][name]["weights"].items()}


@pytest.mark.parametrize("family", sorted(ACTOR_LAYOUTS))
def test_actor_update_with_images_is_the_same_at_every_layout(vlm_results, family):
    from safetensors.torch import load_file

    dirs, per_rank = vlm_results
    original = load_file(f"{dirs[family]}/model.safetensors")
    reference = _weights(per_rank, family, "tp=1")
    moved = {k for k, v in reference.items() if not torch.equal(v, original[k])}
    assert any("visual" in k for k in moved) and any("visual" not in k for k in moved)  # images carried gradient
    metrics = per_rank[0]["actor"][family]["tp=1"]["metrics"]
    for layout in ACTOR_LAYOUTS[family][1:]:
        got = _weights(per_rank, family, layout_name(layout))
        assert got.keys() == reference.keys()
        assert max(float((got[k] - reference[k]).abs().max()) for k in got) < 1e-5, layout
        assert per_rank[0]["actor"][family][layout_name(layout)]["metrics"]["actor/grad_norm"] == pytest.approx(
            metrics["actor/grad_norm"], rel=1e-5), layout


@pytest.mark.slow  # a 4-rank job: ~45-60 s on 2 cores, mostly starting the ranks
@pytest.mark.parametrize("family", FOUR_RANK_FAMILIES)
def test_logits_and_round_trip_at_tp2_pp2(four_rank_results, family):
    dirs, per_rank = four_rank_results
    diffs = [d for r in per_rank if (d := r[family][layout_name(FOUR_RANK_LAYOUT)]["logit_diff"]) is not None]
    assert len(diffs) == 2 and max(diffs) < 1e-4, diffs  # the last stage's two TP ranks
    assert_round_trip(dirs[family], per_rank, family, [FOUR_RANK_LAYOUT])


@pytest.mark.slow
def test_actor_with_images_at_tp2_pp2(four_rank_results, vlm_results):
    dirs, per_rank = four_rank_results
    whole = _whole_batch(dirs, "qwen2_5_vl")
    real = _real_targets(whole)
    name = layout_name(FOUR_RANK_LAYOUT)
    for got in _whole_logprobs(per_rank, "qwen2_5_vl", name, whole):
        assert (got - per_rank[0]["actor"]["qwen2_5_vl"]["teacher"])[real].abs().max() < 1e-5
    # the update: the same weights as the 2-rank job's DP=2 run
    got, reference = _weights(per_rank, "qwen2_5_vl", name), _weights(vlm_results[1], "qwen2_5_vl", "tp=1")
    assert got.keys() == reference.keys()
    assert max(float((got[k] - reference[k]).abs().max()) for k in got) < 1e-5
