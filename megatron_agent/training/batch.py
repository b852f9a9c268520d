"""The training batch the actor consumes, and how it is cut for ranks and micro-batches.

Sequences are prompt + response token ids, right-padded to one length L. Per-token
quantities live on the L-1 *target* positions: position t holds what concerns token
t+1 (its logprob under the policy, its advantage), and `response_mask[:, t]` is 1 when
token t+1 is a response token the loss should see.

Data parallelism: sample i of the whole batch belongs to DP rank i % dp (`shard_rows`).
The leader cuts the batch once (`dp_shards`) and each rank receives only its shard
(`scatter_batch`); a shard knows where its rows sit in the whole batch (`sample_index`)
and the whole batch's size, so the actor can form the same mini-batches on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

# Transformer Engine's FP8 GEMMs want the token dimension in multiples of 16.
FP8_ALIGNMENT = 16


@dataclass
class TrainBatch:
    tokens: torch.Tensor  # [N, L] int64
    response_mask: torch.Tensor  # [N, L-1] float
    advantages: torch.Tensor | None = None  # [N] (per sample) or [N, L-1]
    old_logprobs: torch.Tensor | None = None  # [N, L-1], the policy before this update
    ref_logprobs: torch.Tensor | None = None  # [N, L-1], the frozen reference policy
    rollout_logprobs: torch.Tensor | None = None  # [N, L-1], what the rollout engine reported
    lengths: torch.Tensor | None = None  # [N] real length of each sequence (tokens after it are padding)
    temperature: float = 1.0  # logits are divided by it, as the rollout engine did
    # A data-parallel shard: its rows' positions in the whole batch, and that batch's size
    # (None: this is the whole batch).
    sample_index: torch.Tensor | None = None  # [N] int64
    whole_size: int | None = None

    def __post_init__(self):
        if self.lengths is None:
            self.lengths = torch.full((self.tokens.shape[0],), self.tokens.shape[1], dtype=torch.long)

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
            if value is not None and value.dim() == 2:
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
        index = torch.as_tensor(index, dtype=torch.long)
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            picked[f.name] = value[index] if isinstance(value, torch.Tensor) else value
        return replace(self, **picked)

    @classmethod
    def from_sequences(
        cls,
        prompts: list[list[int]],
        responses: list[list[int]],
        *,
        pad_id: int = 0,
        advantages=None,
        rollout_logprobs: list[list[float]] | None = None,
        temperature: float = 1.0,
    ) -> TrainBatch:
        """Pack prompt/response id lists; rollout logprobs (one per response token) are
        placed on the target positions of their tokens."""
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        width = max(lengths)
        tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), width - 1)
        rollout = torch.zeros(len(prompts), width - 1) if rollout_logprobs is not None else None
        for i, (p, r) in enumerate(zip(prompts, responses)):
            if not p:
                raise ValueError(f"sequence {i} has an empty prompt")
            tokens[i, : len(p) + len(r)] = torch.tensor(list(p) + list(r))
            mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1.0
            if rollout is not None:
                if len(rollout_logprobs[i]) != len(r):
                    raise ValueError(f"sequence {i}: {len(rollout_logprobs[i])} rollout logprobs for {len(r)} tokens")
                rollout[i, len(p) - 1 : len(p) - 1 + len(r)] = torch.tensor(rollout_logprobs[i])
        adv = None if advantages is None else torch.as_tensor(advantages, dtype=torch.float32)
        return cls(tokens, mask, advantages=adv, rollout_logprobs=rollout,
                   lengths=torch.tensor(lengths), temperature=temperature)


PER_TOKEN = ("response_mask", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")
SCALARS = ("temperature", "whole_size")


def shard_rows(n: int, dp_rank: int, dp_size: int) -> list[int]:
    """The whole batch's rows that DP rank `dp_rank` trains on: every dp_size-th one."""
    return list(range(dp_rank, n, dp_size))


def scatter_batch(whole: TrainBatch | None, dp_size: int) -> TrainBatch:
    """The leader's whole batch (None on the other ranks) -> this rank's DP shard; TP, PP
    and CP peers of a DP rank receive the same shard."""
    from megatron_agent.platform.distributed import scatter_to_data_parallel

    parts = [shard.tensors() for shard in whole.dp_shards(dp_size)] if whole is not None else None
    return TrainBatch.from_tensors(scatter_to_data_parallel(parts))


def scatter_rows(whole: dict[str, torch.Tensor] | None, dp_size: int) -> dict[str, torch.Tensor]:
    """The leader's per-sample tensors of the whole batch (None elsewhere) -> this rank's
    shard rows of each, in the shard's order."""
    from megatron_agent.platform.distributed import scatter_to_data_parallel

    parts = None
    if whole is not None:
        n = len(next(iter(whole.values())))
        parts = [{k: v[shard_rows(n, r, dp_size)] for k, v in whole.items()} for r in range(dp_size)]
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


def sequence_multiple(*, tp: int = 1, sequence_parallel: bool = False, fp8: bool = False, cp: int = 1) -> int:
    """What the sequence length of a micro-batch (its input columns) must be a multiple of.

    - sequence parallelism cuts the sequence into `tp` equal slices, one per TP rank;
    - FP8 GEMMs (Transformer Engine) want multiples of 16 tokens;
    - context parallelism cuts it into 2*cp chunks (each CP rank takes two, for causal
      load balance).
    When several apply, their least common multiple; 1 when none does.
    """
    multiple = 1
    if sequence_parallel and tp > 1:
        multiple = math.lcm(multiple, tp)
    if fp8:
        multiple = math.lcm(multiple, FP8_ALIGNMENT)
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
