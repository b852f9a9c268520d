"""The training batch the actor consumes, and how it is cut for ranks and micro-batches.

Sequences are prompt + response token ids, right-padded to one length L. Per-token
quantities live on the L-1 *target* positions: position t holds what concerns token
t+1 (its logprob under the policy, its advantage), and `response_mask[:, t]` is 1 when
token t+1 is a response token the loss should see.

Data parallelism: sample i of the whole batch belongs to DP rank i % dp (`shard_rows`).
The leader cuts the batch once (`dp_shards`) and each rank receives only its shard
(`scatter_batch`); a shard knows where its rows sit in the whole batch (`sample_index`)
and the whole batch's size, so the actor can form the same mini-batches on every rank.

Images (vision-language models): `pixel_values` [P, D] holds every sample's image patches,
sample after sample and each sample's images in text order; `image_grid_thw` [M, 3] the
(t, h, w) patch grid of each image, in the same order; `images_per_sample` [N] how many of
them are each sample's. An image of grid (t, h, w) is t*h*w rows of `pixel_values`, and
its t*h*w/merge**2 image tokens are already in the sample's prompt ids. Every cut of the
batch (`select`, `dp_shard`, `scatter_batch`) keeps each sample's images with it. A text
batch leaves all three None.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

# What FP8 GEMMs want the token dimension a multiple of, by recipe (megatron-core 0.16.1's
# `get_fp8_align_size`, fp8_utils.py: 32 for MXFP8's 1x32 scaling blocks, 16 otherwise).
FP8_ALIGNMENT = 16
MXFP8_ALIGNMENT = 32
DEFAULT_FP8_RECIPE = "delayed"  # TransformerConfig.fp8_recipe's default


@dataclass
class TrainBatch:
    tokens: torch.Tensor  # [N, L] int64
    response_mask: torch.Tensor  # [N, L-1] float
    advantages: torch.Tensor | None = None  # [N] (per sample) or [N, L-1]
    old_logprobs: torch.Tensor | None = None  # [N, L-1], the policy before this update
    ref_logprobs: torch.Tensor | None = None  # [N, L-1], the frozen reference policy
    rollout_logprobs: torch.Tensor | None = None  # [N, L-1], what the rollout engine reported
    lengths: torch.Tensor | None = None  # [N] real length of each sequence (tokens after it are padding)
    step_index: torch.Tensor | None = None  # [N] int64, each sample's step in its episode (0-based)
    # MoE routing replay: row t holds the expert ids the engine routed input token t to in
    # each decoder layer (training/routing_replay.py); padding rows hold 0..k-1.
    routed_experts: torch.Tensor | None = None  # [N, L-1, layers, k] uint8 (<= 256 experts) or int16
    temperature: float = 1.0  # logits are divided by it, as the rollout engine did
    # A data-parallel shard: its rows' positions in the whole batch, and that batch's size
    # (None: this is the whole batch).
    sample_index: torch.Tensor | None = None  # [N] int64
    whole_size: int | None = None
    # Images (module docstring): all three, or none.
    pixel_values: torch.Tensor | None = None  # [P, D] float
    image_grid_thw: torch.Tensor | None = None  # [M, 3] int64
    images_per_sample: torch.Tensor | None = None  # [N] int64

    def __post_init__(self):
        if self.lengths is None:
            self.lengths = torch.full((self.tokens.shape[0],), self.tokens.shape[1], dtype=torch.long)
        given = [name for name in IMAGE_FIELDS if getattr(self, name) is not None]
        if given and len(given) != len(IMAGE_FIELDS):
            raise ValueError(f"a batch with images needs all of {IMAGE_FIELDS}; got only {given}")
        if given:
            check_images(self.pixel_values, self.image_grid_thw, self.images_per_sample, self.size)

    @property
    def has_images(self) -> bool:
        return self.image_grid_thw is not None

    def images_of(self, rows: torch.Tensor | list[int]) -> dict[str, torch.Tensor] | None:
        """The images of samples `rows`, in that order: {"pixel_values", "image_grid_thw",
        "images_per_sample"}; None for a text batch."""
        if not self.has_images:
            return None
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        first_image = _starts(self.images_per_sample)
        patches = self.image_grid_thw.prod(-1)
        first_patch = _starts(patches)
        images = [torch.arange(int(first_image[r]), int(first_image[r] + self.images_per_sample[r]))
                  for r in rows.tolist()]
        images = torch.cat(images) if images else torch.zeros(0, dtype=torch.long)
        pixel_rows = [torch.arange(int(first_patch[i]), int(first_patch[i] + patches[i])) for i in images.tolist()]
        pixel_rows = torch.cat(pixel_rows) if pixel_rows else torch.zeros(0, dtype=torch.long)
        return {"pixel_values": self.pixel_values[pixel_rows], "image_grid_thw": self.image_grid_thw[images],
                "images_per_sample": self.images_per_sample[rows]}

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def is_shard(self) -> bool:
        return self.sample_index is not None

    def positions(self) -> torch.Tensor:
        """Where the rows sit in the whole batch."""
        return self.sample_index if self.is_shard else torch.arange(self.size)

    def whole_batch_size(self) -> int:
        return self.whole_size if self.is_shard else self.size

    def dp_shard(self, dp_rank: int, dp_size: int) -> TrainBatch:
        """The rows of DP rank `dp_rank`, cut to their own longest sequence."""
        if self.is_shard:
            raise ValueError("dp_shard cuts a whole batch, not a shard")
        rows = shard_rows(self.size, dp_rank, dp_size)
        shard = self.select(rows)
        width = int(shard.lengths.max()) if shard.size else 2
        return shard.trimmed(width).with_place(torch.tensor(rows, dtype=torch.long), self.size)

    def dp_shards(self, dp_size: int) -> list[TrainBatch]:
        return [self.dp_shard(r, dp_size) for r in range(dp_size)]

    def trimmed(self, width: int) -> TrainBatch:
        """Tokens cut to `width` columns, per-token tensors to width - 1."""
        cut = {"tokens": self.tokens[:, :width]}
        for name in PER_TOKEN:
            value = getattr(self, name)
            if value is not None and value.dim() >= 2:
                cut[name] = value[:, : width - 1]
        return replace(self, **cut)

    def with_place(self, sample_index: torch.Tensor, whole_size: int) -> TrainBatch:
        return replace(self, sample_index=sample_index, whole_size=whole_size)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The batch as named tensors (scalars as 0-dim ones), for sending."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            out[f.name] = value.contiguous() if isinstance(value, torch.Tensor) else torch.tensor(value)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> TrainBatch:
        values = dict(tensors)
        for name in SCALARS:
            if name in values:
                values[name] = values[name].item()
        return cls(**values)

    def select(self, index: torch.Tensor | list[int]) -> TrainBatch:
        """Rows `index`, in that order, with their images."""
        index = torch.as_tensor(index, dtype=torch.long)
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in IMAGE_FIELDS:
                picked[f.name] = value[index] if isinstance(value, torch.Tensor) else value
        return replace(self, **picked, **(self.images_of(index) or {}))

    @classmethod
    def from_sequences(
        cls,
        prompts: list,
        responses: list,
        *,
        pad_id: int = 0,
        advantages=None,
        rollout_logprobs: list | None = None,
        temperature: float = 1.0,
        images: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
        routed_experts: list | None = None,
    ) -> TrainBatch:
        """Pack prompt/response ids (per sequence a list of ints or a 1-D integer array);
        rollout logprobs (per sequence a list or array, one per response token) are placed
        on the target positions of their tokens. `images`: per sequence, None or
        (pixel_values [p, D], image_grid_thw [n, 3]) of its prompt's images in text order.
        `routed_experts`: per sequence the engine's [prompt + response - 1, layers, k] expert
        ids (one array dtype for all), placed on the rows of the tokens they routed. All ids go into one array, then into the padded tensor where a mask of the real
        positions says (row-major, so in sequence order); the logprobs likewise."""
        n = len(prompts)
        if len(responses) != n or (rollout_logprobs is not None and len(rollout_logprobs) != n):
            raise ValueError(f"{n} prompts, {len(responses)} responses"
                             + (f", {len(rollout_logprobs)} rollout logprob lists" if rollout_logprobs is not None else ""))
        if n == 0:
            raise ValueError("no sequences to pack")
        prompt_lengths = np.fromiter(map(len, prompts), np.int64, n)
        response_lengths = np.fromiter(map(len, responses), np.int64, n)
        bad = prompt_lengths == 0
        if rollout_logprobs is not None:
            bad |= np.fromiter(map(len, rollout_logprobs), np.int64, n) != response_lengths
        if bad.any():  # the first bad sequence, as a sequence-by-sequence check would find it
            i = int(np.argmax(bad))
            if prompt_lengths[i] == 0:
                raise ValueError(f"sequence {i} has an empty prompt")
            raise ValueError(f"sequence {i}: {len(rollout_logprobs[i])} rollout logprobs for {response_lengths[i]} tokens")
        lengths = prompt_lengths + response_lengths
        width = int(lengths.max())
        tokens = torch.full((n, width), pad_id, dtype=torch.long)
        tokens.numpy()[np.arange(width) < lengths[:, None]] = _one_after_another(
            [seq for pair in zip(prompts, responses) for seq in pair], np.int64)
        # target positions of the response tokens: prompt length - 1 onwards
        columns = np.arange(width - 1)
        response = torch.from_numpy((columns >= prompt_lengths[:, None] - 1) & (columns < lengths[:, None] - 1))
        mask = torch.zeros(n, width - 1)
        mask[response] = 1.0
        rollout = None
        if rollout_logprobs is not None:
            rollout = torch.zeros(n, width - 1)
            rollout[response] = torch.from_numpy(_one_after_another(list(rollout_logprobs), np.float64)).to(rollout.dtype)
        adv = None if advantages is None else torch.as_tensor(advantages, dtype=torch.float32)
        routes = None if routed_experts is None else pack_routes(routed_experts, lengths, width)
        return cls(tokens, mask, advantages=adv, rollout_logprobs=rollout, routed_experts=routes,
                   lengths=torch.tensor(lengths), temperature=temperature, **pack_images(images, n))


def pack_routes(routes: list, lengths: np.ndarray, width: int) -> torch.Tensor:
    """Per sequence [length - 1, layers, k] expert ids -> [n, width - 1, layers, k], each
    sequence's rows from column 0, padding rows 0..k-1 (distinct, as a top-k is)."""
    routes = [np.asarray(r) for r in routes]
    if len(routes) != len(lengths):
        raise ValueError(f"routed experts for {len(routes)} sequences, {len(lengths)} sequences")
    shapes = {r.shape[1:] for r in routes}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"routed experts must be [tokens, layers, k] alike; got shapes {sorted(shapes)}")
    for i, (r, length) in enumerate(zip(routes, lengths)):
        if r.shape[0] != length - 1:
            raise ValueError(f"sequence {i}: routed experts for {r.shape[0]} tokens, it feeds {length - 1}")
    layers, k = shapes.pop()
    out = torch.arange(k, dtype=torch.from_numpy(routes[0][:0]).dtype).expand(len(routes), width - 1, layers, k)
    out = out.clone()
    out[torch.from_numpy(np.arange(width - 1) < lengths[:, None] - 1)] = torch.from_numpy(np.concatenate(routes))
    return out


def _one_after_another(sequences: list, list_dtype) -> np.ndarray:
    """The sequences' values in one 1-D array: arrays concatenated as they are (their
    dtype), lists (Python numbers) read as `list_dtype`."""
    if all(isinstance(s, np.ndarray) for s in sequences):
        return np.concatenate(sequences)
    return np.fromiter(itertools.chain.from_iterable(sequences), list_dtype, sum(map(len, sequences)))


PER_TOKEN = ("response_mask", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs", "routed_experts")
SCALARS = ("temperature", "whole_size")
IMAGE_FIELDS = ("pixel_values", "image_grid_thw", "images_per_sample")


def _starts(counts: torch.Tensor) -> torch.Tensor:
    """Where each of consecutive blocks of `counts` rows starts."""
    return torch.cumsum(counts, 0) - counts


def check_images(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, images_per_sample: torch.Tensor,
                 samples: int) -> None:
    """Raise ValueError naming the problem when the image tensors do not fit together."""
    if images_per_sample.shape != (samples,):
        raise ValueError(f"images_per_sample has shape {tuple(images_per_sample.shape)}, want ({samples},)")
    if image_grid_thw.dim() != 2 or image_grid_thw.shape[1] != 3:
        raise ValueError(f"image_grid_thw has shape {tuple(image_grid_thw.shape)}, want [images, 3]")
    if int(images_per_sample.sum()) != image_grid_thw.shape[0]:
        raise ValueError(f"images_per_sample counts {int(images_per_sample.sum())} images, "
                         f"image_grid_thw has {image_grid_thw.shape[0]}")
    patches = int(image_grid_thw.prod(-1).sum())
    if pixel_values.dim() != 2 or pixel_values.shape[0] != patches:
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; the image grids need "
                         f"[{patches}, patch_dim]")


def pack_images(images: list[tuple[torch.Tensor, torch.Tensor] | None] | None, samples: int) -> dict:
    """Per-sample (pixel_values, image_grid_thw) or None -> the batch's image fields ({}
    when no sample has an image: a text batch)."""
    if images is None or all(im is None for im in images):
        return {}
    if len(images) != samples:
        raise ValueError(f"images given for {len(images)} samples, the batch has {samples}")
    for i, im in enumerate(images):
        if im is not None and (im[0] is None or im[1] is None):
            raise ValueError(f"sample {i} has pixel_values or image_grid_thw without the other")
    images = [None if im is None else (torch.as_tensor(im[0]), torch.as_tensor(im[1])) for im in images]
    dims = {im[0].shape[-1] for im in images if im is not None}
    if len(dims) != 1:
        raise ValueError(f"the samples' pixel_values have different patch sizes {sorted(dims)}")
    dim = dims.pop()
    pixels = [im[0].float() if im is not None else torch.zeros(0, dim) for im in images]
    grids = [im[1].long().reshape(-1, 3) if im is not None else torch.zeros(0, 3, dtype=torch.long) for im in images]
    for i, (p, g) in enumerate(zip(pixels, grids)):
        if p.shape[0] != int(g.prod(-1).sum()):
            raise ValueError(f"sample {i}: {p.shape[0]} pixel rows for image grids {g.tolist()} "
                             f"({int(g.prod(-1).sum())} patches)")
    return {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids),
            "images_per_sample": torch.tensor([g.shape[0] for g in grids], dtype=torch.long)}


def micro_batch_images(batch: TrainBatch, rows: torch.Tensor, input_ids: torch.Tensor, hf: dict) -> dict:
    """What a vision-language model's micro-batch carries besides its ids (rows `rows` of
    the batch): the MRoPE positions [3, b, s], which every pipeline stage needs, and for
    the first stage the image-token mask (`image_token_mask`: image tokens the policy
    generated are text) and, when its samples have any, their images."""
    from megatron_agent.models.vision_inputs import image_token_mask, mrope_position_ids

    if "image_token_id" not in hf or "vision_config" not in hf:
        raise ValueError("the batch has images but the model is not a vision-language model")
    images = batch.images_of(rows)
    grids = images["image_grid_thw"] if images is not None and images["image_grid_thw"].shape[0] else None
    per_row = images["images_per_sample"].tolist() if images is not None else [0] * len(rows)
    token, merge = hf["image_token_id"], hf["vision_config"]["spatial_merge_size"]
    mask = image_token_mask(input_ids, grids, per_row, image_token_id=token, spatial_merge_size=merge)
    out = {"position_ids": mrope_position_ids(input_ids, grids, image_token_id=token, spatial_merge_size=merge,
                                              image_mask=mask),
           "image_mask": mask}
    if grids is not None:
        out.update(pixel_values=images["pixel_values"], image_grid_thw=grids)
    return out


def shard_rows(n: int, dp_rank: int, dp_size: int) -> list[int]:
    """The whole batch's rows that DP rank `dp_rank` trains on: every dp_size-th one."""
    return list(range(dp_rank, n, dp_size))


def scatter_batch(whole: TrainBatch | None, dp_size: int) -> TrainBatch:
    """The leader's whole batch (None on the other ranks) -> this rank's DP shard; TP, PP
    and CP peers of a DP rank receive the same shard."""
    from megatron_agent.platform.distributed import scatter_to_data_parallel

    parts = [shard.tensors() for shard in whole.dp_shards(dp_size)] if whole is not None else None
    return TrainBatch.from_tensors(scatter_to_data_parallel(parts))


def scatter_rows(whole: dict[str, torch.Tensor] | None, dp_size: int,
                 rows: list | None = None) -> dict[str, torch.Tensor]:
    """The leader's per-sample tensors of the whole batch (None elsewhere) -> this rank's
    shard rows of each, in the shard's order. `rows` (the leader's): each DP rank's
    positions in the whole batch, when not `shard_rows`' (rollout workers assign by tokens)."""
    from megatron_agent.platform.distributed import scatter_to_data_parallel

    parts = None
    if whole is not None:
        n = len(next(iter(whole.values())))
        rows = rows if rows is not None else [shard_rows(n, r, dp_size) for r in range(dp_size)]
        parts = [{k: v[torch.as_tensor(rows[r], dtype=torch.long)] for k, v in whole.items()} for r in range(dp_size)]
    return scatter_to_data_parallel(parts)


def gather_rows(rows: torch.Tensor, batch: TrainBatch) -> torch.Tensor | None:
    """Each DP rank's per-sample `rows` [n, ...] of its shard -> the whole batch's
    [N, ...] on the leader (None on the other ranks)."""
    from megatron_agent.platform.distributed import gather_from_data_parallel

    parts = gather_from_data_parallel({"rows": rows, "index": batch.positions()})
    if parts is None:
        return None
    whole = rows.new_zeros((batch.whole_batch_size(), *rows.shape[1:]))
    for part in parts:
        whole[part["index"]] = part["rows"]
    return whole


def fp8_alignment(recipe: str) -> int:
    """The token multiple FP8 GEMMs want under `recipe` (a name of
    models/transformer_config.FP8_RECIPES)."""
    return MXFP8_ALIGNMENT if recipe == "mxfp8" else FP8_ALIGNMENT


def sequence_multiple(*, tp: int = 1, sequence_parallel: bool = False, fp8: bool = False,
                      fp8_recipe: str = DEFAULT_FP8_RECIPE, cp: int = 1) -> int:
    """What the sequence length of a micro-batch (its input columns) must be a multiple of.

    - sequence parallelism cuts the sequence into `tp` equal slices, one per TP rank;
    - FP8 GEMMs want multiples of `fp8_alignment(fp8_recipe)` tokens (16; 32 for mxfp8);
    - context parallelism cuts it into 2*cp chunks (each CP rank takes two, for causal
      load balance).
    When several apply, their least common multiple; 1 when none does.
    """
    multiple = 1
    if sequence_parallel and tp > 1:
        multiple = math.lcm(multiple, tp)
    if fp8:
        multiple = math.lcm(multiple, fp8_alignment(fp8_recipe))
    if cp > 1:
        multiple = math.lcm(multiple, 2 * cp)
    return multiple


def padded_length(columns: int, multiple: int) -> int:
    """`columns` rounded up to a multiple of `multiple`."""
    return -(-columns // multiple) * multiple


def micro_batches_by_tokens(lengths: torch.Tensor, max_tokens: int, *, min_count: int = 1,
                            multiple: int = 1) -> list[list[int]]:
    """Group sample indices into micro-batches whose padded size (count x longest) stays
    within `max_tokens` (dynamic batch size). Longest first, so similar lengths share a
    micro-batch; at least `min_count` micro-batches (pipeline schedules want >= pp).

    With `multiple` > 1 the longest sequence counts with the padding the layout adds
    (its L-1 input columns rounded up to the multiple, plus the last target); a single
    sequence within the budget is never refused for its padding."""
    order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
    groups: list[list[int]] = []
    for i in order:
        if groups:
            current = groups[-1]
            longest = padded_length(int(lengths[current[0]]) - 1, multiple) + 1
            if (len(current) + 1) * longest <= max_tokens:
                current.append(i)
                continue
        if int(lengths[i]) > max_tokens:
            raise ValueError(f"a sequence of {int(lengths[i])} tokens exceeds the micro-batch budget {max_tokens}")
        groups.append([i])
    while len(groups) < min(min_count, len(order)):
        biggest = max(range(len(groups)), key=lambda g: len(groups[g]))
        half = len(groups[biggest]) // 2
        groups.append(groups[biggest][half:])
        groups[biggest] = groups[biggest][:half]
    return groups
