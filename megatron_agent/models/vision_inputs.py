"""What a vision-language model's micro-batch carries besides token ids, as pure functions.

- `mrope_position_ids`: the (temporal, height, width) positions of multimodal RoPE, from
  the token ids and the image grids alone, computed once per micro-batch and given to
  every pipeline stage (the last stages never see the images);
- `merge_image_embeddings`: image embeddings put at the image-token positions;
- `vision_micro_batches`: a batch cut into micro-batches, each with its own images.

An image of grid (t, h, w) patches is t * h * w rows of `pixel_values` and
t * h * w / merge**2 image tokens (the vision tower merges merge x merge patches).
"""

from __future__ import annotations

import torch


class ImageTokenMismatch(ValueError):
    """Image tokens in the ids and images given do not agree."""


def image_token_counts(image_grid_thw: torch.Tensor | None, merge: int) -> list[int]:
    if image_grid_thw is None:
        return []
    return [int(t * h * w) // merge**2 for t, h, w in image_grid_thw.tolist()]


def image_token_mask(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, images_per_row: list[int], *,
                     image_token_id: int, spatial_merge_size: int) -> torch.Tensor:
    """bool [b, s]: the image tokens that stand for the rows' images (row r has
    `images_per_row[r]` of the grids, in order), i.e. each row's first that many image
    tokens. A policy may *generate* the image token too (a tiny one trained from scratch
    does): the engine embedded such a token as text, and so must the trainer."""
    counts = image_token_counts(image_grid_thw, spatial_merge_size)
    mask = input_ids == image_token_id
    used = 0
    for row, n_images in enumerate(images_per_row):
        wanted = sum(counts[used:used + n_images])
        used += n_images
        found = mask[row].nonzero().flatten()
        if found.numel() < wanted:
            raise ImageTokenMismatch(f"row {row} has {found.numel()} image tokens for its {n_images} images "
                                     f"({wanted} tokens)")
        mask[row, found[wanted:]] = False
    if used != len(counts):
        raise ImageTokenMismatch(f"{len(counts)} image grids given for rows holding {used} images")
    return mask


def mrope_position_ids(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, *, image_token_id: int,
                       spatial_merge_size: int, image_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Positions [3, b, s] for ids [b, s] with the images of the batch in order.

    Text tokens count up on all three axes. An image starting at position p takes
    p + (frame, row, column) of its merged grid, and the text after it resumes at
    p + max(rows, columns). Padding is text: its positions keep counting, after every
    real token. Each image's tokens must be one consecutive block. `image_mask` (bool
    [b, s], `image_token_mask`): which tokens are image tokens (default: every image token
    id; others are text whatever their id).
    """
    b, s = input_ids.shape
    out = torch.empty(3, b, s, dtype=torch.long)
    grids = [] if image_grid_thw is None else image_grid_thw.tolist()
    used = 0
    for row in range(b):
        is_image = (input_ids[row] == image_token_id if image_mask is None else image_mask[row]).tolist()
        i, pos = 0, 0
        while i < s:
            j = i
            while j < s and not is_image[j]:
                j += 1
            out[:, row, i:j] = torch.arange(pos, pos + j - i)
            pos, i = pos + j - i, j
            if i == s:
                break
            if used == len(grids):
                raise ImageTokenMismatch(f"row {row} has image tokens at column {i} beyond the {len(grids)} image grids")
            t, h, w = grids[used]
            h, w = h // spatial_merge_size, w // spatial_merge_size
            n = t * h * w
            if i + n > s or not all(is_image[i:i + n]):
                raise ImageTokenMismatch(
                    f"image {used} (grid {grids[used]}) needs {n} consecutive image tokens at row {row}, column {i}"
                )
            frame, height, width = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            out[:, row, i:i + n] = torch.stack([frame, height, width]).reshape(3, n) + pos
            pos, i, used = pos + max(h, w), i + n, used + 1
    if used != len(grids):
        raise ImageTokenMismatch(f"{len(grids)} image grids given, the ids hold image tokens for {used}")
    return out


def merge_image_embeddings(embeddings: torch.Tensor, input_ids: torch.Tensor, image_embeds: torch.Tensor | None,
                           image_token_id: int, image_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Token embeddings [s, b, h] (Megatron's layout) with the rows of `image_embeds`
    [n, h] at the image tokens of ids [b, s] (or at `image_mask`, `image_token_mask`), in
    batch-major order (sample by sample)."""
    mask = input_ids == image_token_id if image_mask is None else image_mask
    tokens, given = int(mask.sum()), 0 if image_embeds is None else image_embeds.shape[0]
    if tokens != given:
        raise ImageTokenMismatch(f"the ids hold {tokens} image tokens, the vision tower gave {given} image embeddings")
    if tokens == 0:
        return embeddings
    rows, cols = mask.nonzero(as_tuple=True)
    return embeddings.index_put((cols, rows), image_embeds.to(embeddings.dtype))


def vision_micro_batches(input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
                         image_grid_thw: torch.Tensor | None, hf: dict, rows_per_micro_batch: int = 1) -> list[dict]:
    """`input_ids` [b, s] cut into micro-batches of `rows_per_micro_batch` rows, each with
    its MRoPE positions and, when it has images, their pixel rows and grids."""
    merge = hf["vision_config"]["spatial_merge_size"]
    image_token_id = hf["image_token_id"]
    tokens = image_token_counts(image_grid_thw, merge)
    patches = [] if image_grid_thw is None else image_grid_thw.prod(-1).tolist()
    out, image, pixel_row = [], 0, 0
    for start in range(0, input_ids.shape[0], rows_per_micro_batch):
        ids = input_ids[start:start + rows_per_micro_batch]
        wanted, first = int((ids == image_token_id).sum()), image
        while wanted > 0 and image < len(tokens):
            wanted, image = wanted - tokens[image], image + 1
        grids = image_grid_thw[first:image] if image > first else None
        mb = {"input_ids": ids, "position_ids": mrope_position_ids(
            ids, grids, image_token_id=image_token_id, spatial_merge_size=merge)}
        if grids is not None:
            n = sum(patches[first:image])
            mb.update(pixel_values=pixel_values[pixel_row:pixel_row + n], image_grid_thw=grids)
            pixel_row += n
        out.append(mb)
    if image != len(tokens):
        raise ImageTokenMismatch(f"{len(tokens)} images given, the ids hold image tokens for {image}")
    return out
