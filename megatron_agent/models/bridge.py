"""The HF <-> Megatron-Core parameter bridge.

- `load_hf_weights(chunks, hf_dir)`: every rank fills exactly its own shard of every
  parameter of its model chunks, reading only the HF tensors it needs, one at a time.
- `export_hf_weights(chunks, hf)`: a generator of `(hf_name, full tensor)`. Every rank
  of the model must iterate it (TP and EP gathers are collectives); the source rank of
  each pipeline stage (data-parallel rank 0, tensor-parallel rank 0) yields its stage's
  tensors, the other ranks yield nothing. It holds one parameter's full tensors at a
  time, so a consumer that buckets them bounds memory by its bucket.
- `hf_tensors_gathering_experts(fulls, dims, E)`: the same for full tensors that arrive
  one at a time in one process (the converter), gathering fused experts per layer.

The mapping itself is data: one table of `Rule`s per family (models/families/). This
module only knows the few layouts a rule can name: QKV interleaved per query group,
gate/up stacked per TP shard, vocabulary padding, row/column splits, layer offsets per
pipeline stage and global expert indices per EP rank.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megatron_agent.models.families import Rule, family_of
from megatron_agent.models.families.common import (
    COLS,
    FUSED_EXPERTS,
    GATE_UP,
    GATE_UP_ROWS,
    IDENTITY,
    PREFIX,
    QKV,
    REPLICATED,
    ROWS,
    VOCAB,
)
from megatron_agent.models.safetensors_io import TensorEntry, read_header, read_tensor
from megatron_agent.models.transformer_config import num_experts, padded_vocab_size, read_hf_config


class WeightMappingError(ValueError):
    """A checkpoint that does not fit the model: missing tensor or file, wrong shape."""


@dataclass(frozen=True)
class Dims:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab: int
    hidden: int = 0
    expert_ffn: int = 0

    @classmethod
    def from_hf(cls, hf: dict, tp: int) -> Dims:
        heads = hf["num_attention_heads"]
        return cls(
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab_size=hf["vocab_size"],
            padded_vocab=padded_vocab_size(hf["vocab_size"], tp),
            hidden=hf["hidden_size"],
            expert_ffn=hf.get("moe_intermediate_size") or 0,
        )


def fused_experts_in_megatron_layout(t: torch.Tensor, split: str, dims: Dims, name: str) -> torch.Tensor:
    """A fused expert tensor [E, ...] as [E, rows, cols] of Megatron's per-expert layout.

    Published checkpoints hold gate_up_proj [E, H, 2I] and down_proj [E, I, H]; transformers
    5 holds (and writes, for a model it made) [E, 2I, H] and [E, H, I], Megatron's layout.
    """
    h, i = dims.hidden, dims.expert_ffn
    if h in (i, 2 * i):
        raise WeightMappingError(f"cannot tell the layout of {name!r}: hidden size {h} equals the expert "
                                 f"size {i} or twice it, so [E, H, 2I] and [E, 2I, H] look alike")
    megatron = (2 * i, h) if split == GATE_UP_ROWS else (h, i)
    if tuple(t.shape[1:]) == megatron:
        return t
    if tuple(t.shape[1:]) == megatron[::-1]:
        return t.transpose(1, 2)
    raise WeightMappingError(f"{name!r} has shape {tuple(t.shape)}; expected [E, {megatron[0]}, {megatron[1]}] "
                             f"or [E, {megatron[1]}, {megatron[0]}]")


# --- HF tensors <-> one full Megatron tensor ------------------------------------------


def fused_rows(kind: str, tensors: list[torch.Tensor], dims: Dims) -> list[torch.Tensor]:
    """The full Megatron tensor as consecutive blocks of rows (views of the HF tensors):
    concatenated along dim 0 they are `fuse(...)`."""
    if kind == IDENTITY:
        return [tensors[0]]
    if kind == QKV:
        groups = dims.num_kv_heads
        per_group = [t.reshape(groups, -1, *t.shape[1:]) for t in tensors]
        return [t[g] for g in range(groups) for t in per_group]
    if kind == GATE_UP:
        return list(tensors)
    if kind == VOCAB:
        (t,) = tensors
        pad = dims.padded_vocab - t.shape[0]
        return [t, t.new_zeros(pad, *t.shape[1:])] if pad else [t]
    raise ValueError(f"unknown fuse kind {kind!r}")


def fuse(kind: str, tensors: list[torch.Tensor], dims: Dims) -> torch.Tensor:
    rows = fused_rows(kind, tensors, dims)
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def unfuse(kind: str, full: torch.Tensor, dims: Dims, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The HF tensors of a full Megatron tensor: views where the layout allows, else copies
    (q/k/v, into `out` when given: the consumer's memory, one copy)."""
    if kind == IDENTITY:
        return [full]
    if kind == QKV:
        groups = dims.num_kv_heads
        q_per_group = dims.num_heads // groups * dims.head_dim
        rest = full.shape[1:]
        grouped = full.reshape(groups, q_per_group + 2 * dims.head_dim, *rest)
        parts = grouped.split([q_per_group, dims.head_dim, dims.head_dim], dim=1)
        if out is None:
            return [t.reshape(-1, *rest).contiguous() for t in parts]
        for t, dest in zip(parts, out):
            dest.view(t.shape).copy_(t)
        return list(out)
    if kind == GATE_UP:
        return [t.contiguous() for t in full.chunk(2, dim=0)]
    if kind == VOCAB:
        return [full[: dims.vocab_size]]
    raise ValueError(f"unknown fuse kind {kind!r}")


# --- one full tensor <-> TP shards ----------------------------------------------------


def shard(kind: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    if kind == REPLICATED or size == 1:
        return full
    if kind == ROWS:
        return full.chunk(size, dim=0)[rank]
    if kind == COLS:
        return full.chunk(size, dim=1)[rank]
    if kind == GATE_UP_ROWS:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    raise ValueError(f"unknown split kind {kind!r}")


def unshard(kind: str, shards: list[torch.Tensor]) -> torch.Tensor:
    if kind == REPLICATED or len(shards) == 1:
        return shards[0]
    if kind == ROWS:
        return torch.cat(shards, dim=0)
    if kind == COLS:
        return torch.cat(shards, dim=1)
    if kind == GATE_UP_ROWS:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    raise ValueError(f"unknown split kind {kind!r}")


# --- Megatron parameter names -> rules ------------------------------------------------

# Transformer Engine's layer spec fuses the pre-attention / pre-MLP norms into the next
# linear and keeps grouped experts in one module; map its names to the local spec's.
_TE_NAMES = [
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
    (re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)$"), r"mlp.experts.local_experts.\2.\1.weight"),
]
# A Megatron name's layer index (in its chunk) and local expert index.
LAYER_INDEX = re.compile(r"^decoder\.layers\.(\d+)\.")
EXPERT_INDEX = re.compile(r"\.local_experts\.(\d+)\.")


def local_spec_name(name: str) -> str:
    for pattern, replacement in _TE_NAMES:
        name = pattern.sub(replacement, name)
    return name


@dataclass(frozen=True)
class ParamMapping:
    rule: Rule
    layer: int | None  # global layer index
    local_expert: int | None
    is_expert: bool

    def hf_names(self, expert: int | None = None) -> list[str]:
        return [t.format(L=self.layer, E=expert) for t in self.rule.hf]


class Bridge:
    """The weight table of one model, resolved against one rank's layout."""

    def __init__(self, hf: dict):
        self.hf = hf
        rules = family_of(hf).rules(hf)
        self.rules = {r.mcore: r for r in rules if not r.mcore.endswith(PREFIX)}
        self.prefix_rules = [r for r in rules if r.mcore.endswith(PREFIX)]
        self.num_experts = num_experts(hf) or 0

    def mapping(self, chunk, name: str) -> ParamMapping:
        name = local_spec_name(name)
        template, layer, expert = name, None, None
        m = LAYER_INDEX.match(name)
        if m:
            local_layer = int(m.group(1))
            layer = chunk.decoder.layers[local_layer].layer_number - 1
            template = LAYER_INDEX.sub("decoder.layers.{L}.", template)
        e = EXPERT_INDEX.search(template)
        if e:
            expert = int(e.group(1))
            template = EXPERT_INDEX.sub(".local_experts.{E}.", template)
        rule = self.rules.get(template) or self._by_prefix(name)
        if rule is None:
            raise WeightMappingError(f"no HF mapping for Megatron parameter {name!r} ({self.hf['model_type']})")
        return ParamMapping(rule, layer, expert, is_expert=expert is not None)

    def _by_prefix(self, name: str) -> Rule | None:
        for r in self.prefix_rules:
            mcore, hf = r.mcore[: -len(PREFIX)] + ".", r.hf[0][: -len(PREFIX)] + "."
            if name.startswith(mcore):
                return replace(r, mcore=name, hf=(hf + name[len(mcore):],))
        return None


def _parallel_ranks(is_expert: bool) -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    if is_expert:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _tp_group(is_expert: bool):
    from megatron.core import parallel_state as ps

    return ps.get_expert_tensor_parallel_group() if is_expert else ps.get_tensor_model_parallel_group()


# --- reading HF checkpoints -------------------------------------------------------------


class SafetensorsCheckpoint:
    """Tensors of an HF checkpoint by name (single file or sharded), each read on demand
    by byte offset (no memory map stays open)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self._entries: dict[str, TensorEntry] = {}
        self._headers_read: set[str] = set()
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.file_of = json.loads(index.read_text())["weight_map"]
            self.source = index
        elif (self.dir / "model.safetensors").is_file():
            single = self.dir / "model.safetensors"
            self._entries = read_header(single)
            self._headers_read.add(single.name)
            self.file_of = {k: single.name for k in self._entries}
            self.source = single
        else:
            raise WeightMappingError(f"no model.safetensors or model.safetensors.index.json in {self.dir}")
        for file in sorted(set(self.file_of.values())):
            if not (self.dir / file).is_file():
                raise WeightMappingError(f"{self.source} lists shard {file}, which is missing from {self.dir}")

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def entry(self, name: str, wanted_by: str) -> TensorEntry:
        if name not in self.file_of:
            raise WeightMappingError(f"{self.source} has no tensor {name!r} (needed for Megatron {wanted_by!r})")
        file = self.file_of[name]
        if file not in self._headers_read:
            self._entries.update(read_header(self.dir / file))
            self._headers_read.add(file)
        if name not in self._entries:
            raise WeightMappingError(f"{self.source} puts {name!r} in {file}, which has no such tensor")
        return self._entries[name]

    def get(self, name: str, wanted_by: str) -> torch.Tensor:
        return read_tensor(self.entry(name, wanted_by))

    def meta(self, name: str, wanted_by: str) -> torch.Tensor:
        """A tensor with the stored shape and dtype and no data (to check shapes first)."""
        entry = self.entry(name, wanted_by)
        return torch.empty(entry.shape, dtype=entry.dtype, device="meta")


def full_from_hf(m: ParamMapping, megatron_name: str, tensors: list[torch.Tensor], dims: Dims, source,
                 expert: int | None = None) -> torch.Tensor:
    """The full (unsharded) Megatron tensor made of its HF tensors (real or meta)."""
    if m.rule.fuse == FUSED_EXPERTS:
        return fused_experts_in_megatron_layout(tensors[0], m.rule.split, dims, m.hf_names(expert)[0])[expert]
    try:
        return fuse(m.rule.fuse, tensors, dims)
    except RuntimeError as err:
        shapes = {n: tuple(t.shape) for n, t in zip(m.hf_names(expert), tensors)}
        raise WeightMappingError(f"cannot build Megatron {megatron_name!r} from {shapes} in {source}: {err}") from None


def shape_mismatch(m: ParamMapping, megatron_name: str, expected: tuple, tensors: list[torch.Tensor], source,
                   expert: int | None = None) -> WeightMappingError:
    shapes = {n: tuple(t.shape) for n, t in zip(m.hf_names(expert), tensors)}
    return WeightMappingError(
        f"shape mismatch for Megatron {megatron_name!r}: expected {tuple(expected)} on this rank, "
        f"{source} gives {shapes} (does config.json match the weights?)"
    )


# out(hf_name, shape, dtype): memory for a tensor the export rebuilds (q/k/v), or None
Destination = Callable[[str, tuple[int, ...], torch.dtype], "torch.Tensor | None"]


def qkv_rows(dims: Dims) -> list[int]:
    """Rows of q, k and v (HF's tensors) in a full fused QKV tensor."""
    return [dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim]


def hf_from_full(m: ParamMapping, full: torch.Tensor, dims: Dims, expert: int | None = None,
                 out: Destination | None = None):
    """(HF name, tensor) pairs a full Megatron tensor splits into; rebuilt ones in `out`'s
    memory where it gives some."""
    names = m.hf_names(expert)
    dests = None
    if out is not None and m.rule.fuse == QKV:
        dests = [out(n, (rows, *full.shape[1:]), full.dtype) for n, rows in zip(names, qkv_rows(dims))]
        dests = None if any(d is None for d in dests) else dests
    return list(zip(names, unfuse(m.rule.fuse, full, dims, dests)))


def hf_tensors_gathering_experts(fulls: Iterable[tuple[ParamMapping, int | None, torch.Tensor]], dims: Dims,
                                 num_experts: int, out: Destination | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of full Megatron tensors arriving one at a time, each with
    its global expert index (None: not an expert). A fused expert tensor is filled, in the
    published layout, as its experts arrive (in any order) and yielded after its last: it
    holds one fused tensor per HF name being filled, never the experts twice."""
    filling: dict[str, tuple[torch.Tensor, set[int]]] = {}
    for m, expert, full in fulls:
        if m.rule.fuse != FUSED_EXPERTS:
            yield from hf_from_full(m, full, dims, expert, out)
            continue
        (hf_name,) = m.hf_names(expert)
        fused, seen = filling.setdefault(hf_name, (full.new_empty(num_experts, *full.shape[::-1]), set()))
        if expert in seen or tuple(fused.shape[1:]) != tuple(full.shape[::-1]):
            raise WeightMappingError(f"{hf_name!r}: expert {expert} of shape {tuple(full.shape)} does not "
                                     f"fit the experts gathered so far ({sorted(seen)}, {tuple(fused.shape)})")
        fused[expert].copy_(full.T)
        seen.add(expert)
        if len(seen) == num_experts:
            del filling[hf_name]
            yield hf_name, fused
    if filling:
        missing = {n: sorted(set(range(num_experts)) - seen) for n, (_, seen) in filling.items()}
        raise WeightMappingError(f"fused expert tensors left without some of their experts: {missing}")


def load_hf_weights(chunks: list, hf_dir: str | Path, *, progress: bool = False, skip=None) -> int:
    """Copy this rank's shard of every parameter of `chunks` from the HF checkpoint.

    Returns the number of parameters filled. A missing tensor or a shape that does not
    match raises WeightMappingError naming the file and the parameter. `skip(name)`
    leaves parameters out (a critic's value head has no HF counterpart).
    """
    from megatron.core import parallel_state as ps

    hf = read_hf_config(hf_dir)
    bridge = Bridge(hf)
    ckpt = SafetensorsCheckpoint(hf_dir)
    dims = Dims.from_hf(hf, ps.get_tensor_model_parallel_world_size())
    experts_per_rank = bridge.num_experts // ps.get_expert_model_parallel_world_size() if bridge.num_experts else 0
    ep_rank = ps.get_expert_model_parallel_rank()
    params = [(chunk, name, p) for chunk in chunks for name, p in chunk.named_parameters()
              if skip is None or not skip(name)]
    if progress:
        from tqdm import tqdm

        params = tqdm(params, desc="loading HF weights", unit="param")
    fused: tuple[str | None, torch.Tensor | None] = (None, None)
    for chunk, name, param in params:
        m = bridge.mapping(chunk, name)
        expert = ep_rank * experts_per_rank + m.local_expert if m.is_expert else None
        if m.rule.fuse == FUSED_EXPERTS:  # one read per layer, not one per expert
            (hf_name,) = m.hf_names(expert)
            if fused[0] != hf_name:
                fused = (hf_name, ckpt.get(hf_name, name))
            hf_tensors = [fused[1]]
        else:
            hf_tensors = [ckpt.get(n, name) for n in m.hf_names(expert)]
        rank, size = _parallel_ranks(m.is_expert)
        full = full_from_hf(m, name, hf_tensors, dims, ckpt.source, expert)
        try:
            local = shard(m.rule.split, full, rank, size)
        except RuntimeError:
            raise shape_mismatch(m, name, param.shape, hf_tensors, ckpt.source, expert) from None
        if local.shape != param.shape:
            raise shape_mismatch(m, name, param.shape, hf_tensors, ckpt.source, expert)
        with torch.no_grad():
            param.copy_(local)
    return len(params)


# --- laying parameters out for the export -----------------------------------------------


def exported_as_views(m: ParamMapping, tp_size: int, expert_tp_size: int, ep_size: int) -> bool:
    """Whether the export yields this parameter's HF tensors as views of its own memory:
    nothing to gather (replicated, or a group of one) and nothing to rebuild (q/k/v are
    copied out of their interleaved groups, fused experts are gathered)."""
    if not m.rule.export or m.rule.fuse not in (IDENTITY, GATE_UP, VOCAB):
        return False
    split_over = expert_tp_size if m.is_expert else tp_size
    return (m.rule.split == REPLICATED or split_over == 1) and not (m.is_expert and ep_size > 1)


def pack_parameters(chunks: list, hf: dict) -> None:
    """Lay each chunk's parameters out in one storage per dtype: first, in `named_parameters`
    order, those the export yields as views of themselves, then the rest. The export then
    yields long runs of back-to-back tensors, which the weight sync sends straight from
    memory (weight_sync/buckets.py). Values are kept. Call before DDP and the optimizer see
    the parameters (the distributed optimizer lays them out in its own buffer instead)."""
    from megatron.core import parallel_state as ps

    bridge = Bridge(hf)
    sizes = (ps.get_tensor_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size(),
             ps.get_expert_model_parallel_world_size())
    for chunk in chunks:
        views, rest = [], []
        for name, param in chunk.named_parameters():
            try:
                as_view = exported_as_views(bridge.mapping(chunk, name), *sizes)
            except WeightMappingError:  # not exported (a critic's value head)
                as_view = False
            (views if as_view else rest).append(param)
        groups: dict[tuple, list[torch.nn.Parameter]] = {}
        for param in views + rest:
            groups.setdefault((param.dtype, param.device), []).append(param)
        for (dtype, device), params in groups.items():
            flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
            offset = 0
            with torch.no_grad():
                for p in params:
                    flat[offset:offset + p.numel()].copy_(p.reshape(-1))
                    p.data = flat[offset:offset + p.numel()].view(p.shape)
                    offset += p.numel()


# --- exporting HF tensors -------------------------------------------------------------


def all_gather_shards(t: torch.Tensor, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def exported_parameters(chunk) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a chunk's parameters as an HF export sees them: a linear carrying a
    LoRA adapter (`.lora`, models/lora.py) gives its merged weight under the weight's name,
    and the adapter's own parameters nothing."""
    adapters = {f"{name}.weight": module.lora for name, module in chunk.named_modules() if hasattr(module, "lora")}
    for name, param in chunk.named_parameters():
        if ".lora." in name:
            continue
        adapter = adapters.get(name)
        yield name, adapter.merged(param) if adapter is not None else param.detach()


def is_export_source() -> bool:
    """DP rank 0 and TP rank 0 of each pipeline stage yields the stage's tensors."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0


def export_hf_weights(chunks: list, hf: dict, out: Destination | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full tensor)` for this pipeline stage on its source rank.

    Every rank of the model must iterate the generator to the end: TP (or expert-TP)
    shards are all-gathered per parameter, experts are all-gathered over EP and renamed
    with their global index (local index + ep_rank * experts per rank). The tensors are
    views of the parameters where the layout allows; q/k/v are copied out of their
    groups, into `out(hf_name, shape, dtype)`'s memory where it gives some (a bucket).
    A linear with a LoRA adapter is exported merged (models/lora.py).
    """
    from megatron.core import parallel_state as ps

    bridge = Bridge(hf)
    dims = Dims.from_hf(hf, ps.get_tensor_model_parallel_world_size())
    source = is_export_source()
    experts_per_rank = bridge.num_experts // ps.get_expert_model_parallel_world_size() if bridge.num_experts else 0

    def fulls():
        for chunk in chunks:
            for name, local in exported_parameters(chunk):
                m = bridge.mapping(chunk, name)
                if not m.rule.export:
                    continue
                if m.rule.split != REPLICATED:
                    local = unshard(m.rule.split, all_gather_shards(local, _tp_group(m.is_expert)))
                if m.is_expert:
                    for ep_rank, full in enumerate(all_gather_shards(local, ps.get_expert_model_parallel_group())):
                        if source:
                            yield m, ep_rank * experts_per_rank + m.local_expert, full
                elif source:
                    yield m, None, local

    yield from hf_tensors_gathering_experts(fulls(), dims, bridge.num_experts, out)
