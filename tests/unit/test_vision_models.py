"""Tiny vision-language models made on the spot load in transformers and run with images;
MRoPE positions and the image-embedding merge, as pure functions, against transformers."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_agent.models.vision_inputs import (
    ImageTokenMismatch,
    merge_image_embeddings,
    mrope_position_ids,
    vision_micro_batches,
)
from tests.vlm_batch import vlm_batch

VLM_FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
# The checkpoint's on-disk prefixes (published Qwen2.5-VL / Qwen3-VL checkpoints).
PREFIXES = {
    "qwen2_5_vl": ("visual.", "model.layers.", "model.embed_tokens.", "model.norm.", "lm_head."),
    "qwen3_vl": ("model.visual.", "model.language_model."),
    "qwen3_vl_moe": ("model.visual.", "model.language_model.", "lm_head."),
}


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def loaded(request, tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    path = tiny_model_dir(request.param)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    return request.param, path, model, vlm_batch(path)


def test_transformers_runs_each_vlm_with_images(loaded):
    from safetensors import safe_open

    family, path, model, batch = loaded
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == family
    with safe_open(path / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert all(n.startswith(PREFIXES[family]) for n in names), [n for n in names if not n.startswith(PREFIXES[family])]
    with safe_open(path / "model.safetensors", "pt") as f:
        experts = {n.rsplit(".", 1)[-1]: f.get_slice(n).get_shape() for n in names if ".experts." in n}
    if experts:  # the published layout: [E, H, 2I] and [E, I, H]
        text = config["text_config"]
        h, i = text["hidden_size"], text["moe_intermediate_size"]
        assert experts == {"gate_up_proj": [4, h, 2 * i], "down_proj": [4, i, h]} and len({h, i, 2 * i}) == 3
    assert batch["image_grid_thw"].shape[0] == 3
    with torch.no_grad():
        logits = model(**batch).logits
        blind = model(**{k: v for k, v in batch.items() if k != "pixel_values"} | {
            "pixel_values": torch.zeros_like(batch["pixel_values"])}).logits
    assert logits.shape[:2] == batch["input_ids"].shape and torch.isfinite(logits).all()
    assert torch.equal(logits[0], blind[0]) and not torch.allclose(logits[2], blind[2])  # row 0 has no image


def test_mrope_positions_match_transformers(loaded):
    _, _, model, batch = loaded
    ours = mrope_position_ids(batch["input_ids"], batch["image_grid_thw"], image_token_id=model.config.image_token_id,
                              spatial_merge_size=2)
    ref, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"],
                                        attention_mask=batch["attention_mask"])
    real = batch["attention_mask"].bool()
    assert torch.equal(ours[:, real], ref[:, real])
    assert torch.equal(ours[:, 0], torch.arange(ours.shape[-1]).expand(3, -1))  # no image: 1-D positions


def test_micro_batches_carry_their_own_images(loaded):
    from megatron_agent.models import read_hf_config

    _, path, _, batch = loaded
    hf = read_hf_config(path)
    mbs = vision_micro_batches(batch["input_ids"], batch["pixel_values"], batch["image_grid_thw"], hf)
    assert [mb.get("image_grid_thw", torch.empty(0, 3)).shape[0] for mb in mbs] == [0, 1, 2]
    assert torch.equal(torch.cat([mb["pixel_values"] for mb in mbs[1:]]), batch["pixel_values"])
    assert all(mb["position_ids"].shape == (3, 1, batch["input_ids"].shape[1]) for mb in mbs)


def test_image_count_mismatch_names_both_counts():
    ids = torch.tensor([[1, 9, 9, 2], [9, 9, 3, 4]])
    embeddings = torch.zeros(4, 2, 8)
    with pytest.raises(ImageTokenMismatch, match="4 image tokens.*3 image embeddings"):
        merge_image_embeddings(embeddings, ids, torch.ones(3, 8), image_token_id=9)
    merged = merge_image_embeddings(embeddings, ids, torch.arange(4.0)[:, None].expand(4, 8), image_token_id=9)
    assert merged[:, 0, 0].tolist() == [0, 0, 1, 0] and merged[:, 1, 0].tolist() == [2, 3, 0, 0]  # batch-major
    with pytest.raises(ImageTokenMismatch, match="1 image grids given"):
        mrope_position_ids(ids[:1, :1], torch.tensor([[1, 2, 2]]), image_token_id=9, spatial_merge_size=2)
    with pytest.raises(ImageTokenMismatch, match="needs 3 consecutive image tokens"):
        mrope_position_ids(ids[:1], torch.tensor([[1, 2, 6]]), image_token_id=9, spatial_merge_size=2)


def test_fused_experts_read_from_either_layout_and_refuse_ambiguous_sizes():
    from megatron_agent.models.bridge import Dims, WeightMappingError, fused_experts_in_megatron_layout
    from megatron_agent.models.families.common import COLS, GATE_UP_ROWS

    dims = Dims(4, 2, 16, 64, 64, hidden=8, expert_ffn=3)
    gate_up, down = torch.randn(4, 6, 8), torch.randn(4, 8, 3)  # Megatron's (and transformers' in-memory) layout
    for t, split in ((gate_up, GATE_UP_ROWS), (down, COLS)):
        assert torch.equal(fused_experts_in_megatron_layout(t, split, dims, "x"), t)
        assert torch.equal(fused_experts_in_megatron_layout(t.transpose(1, 2).contiguous(), split, dims, "x"), t)
    with pytest.raises(WeightMappingError, match="expected"):
        fused_experts_in_megatron_layout(torch.randn(4, 5, 8), GATE_UP_ROWS, dims, "x")
    for ambiguous in (Dims(4, 2, 16, 64, 64, hidden=8, expert_ffn=4), Dims(4, 2, 16, 64, 64, hidden=8, expert_ffn=8)):
        with pytest.raises(WeightMappingError, match="cannot tell the layout"):
            fused_experts_in_megatron_layout(torch.randn(4, 8, 8), GATE_UP_ROWS, ambiguous, "x")
