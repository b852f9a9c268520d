"""A batch for the tiny vision-language models: rows with 0, 1 and 2 images of different
sizes, right-padded, as the processor would make it (image pads expanded per image)."""

from __future__ import annotations

import numpy as np
import torch

# Image sizes in pixels (height, width): one square, one wide.
IMAGE_SIZES = [(56, 56), (60, 120)]


def vlm_batch(model_dir, images_per_row=(0, 1, 2), seed: int = 0) -> dict:
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    rng = np.random.default_rng(seed)
    pad_id, image_id = tok.pad_token_id, tok.convert_tokens_to_ids("<|image_pad|>")
    rows, images = [], []
    for row, n in enumerate(images_per_row):
        parts = [{"type": "image"} for _ in range(n)] + [{"type": "text", "text": f"what is in room {row} push"}]
        ids = tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        row_images = [Image.fromarray(rng.integers(0, 256, (*IMAGE_SIZES[i % 2], 3), dtype=np.uint8))
                      for i in range(n)]
        if row_images:
            grids = processor(images=row_images, return_tensors="pt")["image_grid_thw"]
            counts = iter((grids.prod(-1) // processor.merge_size**2).tolist())
            ids = [t for i in ids for t in ([image_id] * next(counts) if i == image_id else [i])]
        rows.append(ids + [tok.convert_tokens_to_ids("<|im_end|>")] * (row + 1))
        images += row_images
    width = max(len(r) for r in rows) + 2  # every row gets some padding
    input_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    out = processor(images=images, return_tensors="pt")
    return dict(input_ids=input_ids, attention_mask=attention_mask, pixel_values=out["pixel_values"],
                image_grid_thw=out["image_grid_thw"], mm_token_type_ids=(input_ids == image_id).int())


def perturbed_checkpoint(model_dir, out_dir) -> dict[str, torch.Tensor]:
    """A copy of a tiny VLM's checkpoint with some vision and language tensors changed
    (under their on-disk names: a vision MLP, the merger, the patch embedding, layer 1's
    q_proj and up_proj or fused experts); returns those tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    tensors = load_file(str(out_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    picked = [n for n in tensors if "visual.blocks.0.mlp." in n and tensors[n].dim() == 2][:1]
    picked += [n for n in tensors if "visual" in n and "merger" in n][:1]
    picked += [n for n in tensors if "visual" in n and "patch_embed" in n][:1]
    picked += [n for n in tensors if "layers.1." in n and n.endswith(("q_proj.weight", "experts.gate_up_proj",
                                                                      "mlp.up_proj.weight"))]
    assert len(picked) == 5 and sum("visual" in n for n in picked) == 3, picked
    changed = {}
    for n in picked:
        changed[n] = tensors[n] + 0.05 * torch.randn(tensors[n].shape, generator=gen)
        tensors[n] = changed[n]
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return changed
