"""Images in prompts and engine requests (Qwen-VL style vision-language models).

A prompt's chat template renders each image as one `<|image_pad|>` between
`<|vision_start|>` and `<|vision_end|>`; the model sees that pad repeated once per image
token. An image the processor cuts into a grid of (t, h, w) patches is t*h*w rows of
`pixel_values` and t*h*w / merge**2 image tokens (the vision tower merges merge x merge
patches). So every image prompt has two id lists:

- the *engine ids*, one pad per image: what an SGLang server takes with `image_data`
  (it expands each pad itself, from the grid its own processor computes);
- the *expanded ids*, each pad repeated its image's token count: what the model runs on
  and the trainer trains on (and what `meta_info.prompt_tokens` counts).

Images travel to engines as SGLang's `image_data` accepts them: PNG data URLs.
Multimodal RoPE positions (`mrope_positions`) are the (temporal, height, width)
positions the Qwen-VL language models take: text counts up on all three axes; an image
whose first token is at p takes p + (frame, row, column) of its merged grid; the next
token after an image takes the largest position so far + 1.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

IMAGE_PAD = "<|image_pad|>"
DATA_URL_PREFIX = "data:image/"


class ImageTokenMismatch(ValueError):
    """The image pads of a prompt's ids and its images do not agree."""


def is_vision_model(model_dir: str | Path) -> bool:
    """Whether the HF model directory holds a vision-language model (its config.json has
    a `vision_config`)."""
    path = Path(model_dir) / "config.json"
    return path.is_file() and "vision_config" in json.loads(path.read_text())


def load_image_processor(model_dir: str | Path):
    """The model's image processor (transformers' AutoImageProcessor); None for a text model."""
    if not is_vision_model(model_dir):
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(model_dir))


def merge_size(processor) -> int:
    return int(getattr(processor, "merge_size", None) or getattr(processor, "spatial_merge_size", 2))


def to_pil(image: Any):
    """An HxWx3 uint8 array (or a PIL image) as an RGB PIL image."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    array = np.asarray(image)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise ValueError(f"an image must be HxWx3 uint8, got {array.dtype} of shape {array.shape}")
    return Image.fromarray(np.ascontiguousarray(array), mode="RGB")


def process_images(processor, images: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values float32 [patches, dim], image_grid_thw long [n, 3]) of `images` in
    order (each processed on its own, so any subset's rows are the concatenation of its
    images' rows)."""
    if not images:
        raise ValueError("process_images needs at least one image")
    pixels, grids = [], []
    for image in images:
        out = processor(images=[to_pil(image)], return_tensors="pt")
        pixels.append(torch.as_tensor(out["pixel_values"]).float())
        grids.append(torch.as_tensor(out["image_grid_thw"]).long())
    return torch.cat(pixels), torch.cat(grids)


def image_token_counts(image_grid_thw: torch.Tensor | None, merge: int) -> list[int]:
    """Image tokens per image: t*h*w / merge**2 of each grid row (None: no images)."""
    if image_grid_thw is None:
        return []
    return [int(t * h * w) // merge**2 for t, h, w in image_grid_thw.tolist()]


def expand_image_pads(ids: list[int], pad_id: int, counts: list[int]) -> list[int]:
    """`ids` with one pad per image, each pad repeated its image's token count."""
    pads = sum(1 for t in ids if t == pad_id)
    if pads != len(counts):
        raise ImageTokenMismatch(f"the prompt has {pads} image pad token(s) (id {pad_id}) but {len(counts)} image(s); "
                               "each image needs exactly one pad in the unexpanded ids")
    out, k = [], 0
    for t in ids:
        if t == pad_id:
            out.extend([pad_id] * counts[k])
            k += 1
        else:
            out.append(t)
    return out


def mrope_positions(ids: list[int], pad_id: int, image_grid_thw: torch.Tensor | None, merge: int) -> torch.Tensor:
    """Multimodal RoPE positions [3, len(ids)] of one prompt's expanded ids, its images'
    grids in order (each image one block of its token count of pads)."""
    grids = [] if image_grid_thw is None else image_grid_thw.tolist()
    positions, used = image_positions([t == pad_id for t in ids], grids, merge)
    if used != len(grids):
        raise ImageTokenMismatch(f"{len(grids)} image grid(s) given, the ids hold image tokens for {used}")
    return positions


def image_positions(is_image: list[bool], grids: list[list[int]], merge: int) -> tuple[torch.Tensor, int]:
    """Multimodal RoPE positions [3, n] of one sequence whose image tokens are `is_image`,
    its images taken from `grids` in order, and how many of them it holds. Text counts up
    on all three axes; an image starting at position p takes p + (frame, row, column) of
    its merged grid (each image one block of t * h * w / merge**2 tokens); the token after
    it takes the largest position so far + 1 (p + max(t, h, w)), as transformers'
    `get_rope_index` and SGLang do. The trainer's copy of the rule is
    models/vision_inputs.py `mrope_position_ids` (the floors keep megatron_agent.models
    and rollout apart); both are tested against transformers'."""
    n_tokens = len(is_image)
    out = torch.empty(3, n_tokens, dtype=torch.long)
    image_at = [i for i, flag in enumerate(is_image) if flag] + [n_tokens]
    i, pos, used, k = 0, 0, 0, 0
    while i < n_tokens:
        j = image_at[k]  # the next image token (n_tokens: none)
        out[:, i:j] = torch.arange(pos, pos + j - i)
        pos, i = pos + j - i, j
        if i == n_tokens:
            break
        if used == len(grids):
            raise ImageTokenMismatch(f"image tokens at position {i} beyond the {len(grids)} image(s) given")
        t, h, w = grids[used]
        h, w = h // merge, w // merge
        n = t * h * w
        if i + n > n_tokens or not all(is_image[i:i + n]):
            raise ImageTokenMismatch(f"image {used} (grid {grids[used]}) needs {n} consecutive image tokens "
                                     f"at position {i}")
        frame = torch.arange(t).view(t, 1, 1).expand(t, h, w).reshape(-1)
        row = torch.arange(h).view(1, h, 1).expand(t, h, w).reshape(-1)
        column = torch.arange(w).view(1, 1, w).expand(t, h, w).reshape(-1)
        out[:, i:i + n] = pos + torch.stack([frame, row, column])
        pos, i, used, k = pos + max(t, h, w), i + n, used + 1, k + n
    return out, used


def encode_image_data(image: Any) -> str:
    """An image as a PNG data URL (SGLang's `image_data` form); the same pixels always
    give the same string."""
    buffer = io.BytesIO()
    to_pil(image).save(buffer, format="PNG", optimize=False, compress_level=6)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_image_data(item: object):
    """A `data:image/...;base64,` string -> an RGB PIL image; ValueError naming the problem."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(item, str):
        raise ValueError(f"an image_data item must be a 'data:image/...;base64,...' string, got {type(item).__name__}")
    head, sep, payload = item.partition(",")
    if not (item.startswith(DATA_URL_PREFIX) and sep and head.endswith(";base64")):
        raise ValueError(f"an image_data item must be a 'data:image/...;base64,...' URL (got {item[:40]!r}); "
                         "this engine loads no files or remote URLs")
    try:
        raw = base64.b64decode(payload, validate=True)
        with Image.open(io.BytesIO(raw)) as image:
            return image.convert("RGB")
    except (ValueError, UnidentifiedImageError, OSError) as err:
        raise ValueError(f"an image_data item is not a readable base64 image: {type(err).__name__}: {err}") from None
