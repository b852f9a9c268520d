"""The converter's routines: HF checkpoints <-> Megatron dist checkpoints (torch_dist),
through the bridge, and a logits check of one against the other.

`cli.py` parses arguments and calls these; the checkpoint directory format and the
primitives shared with the trainer are in `megatron_agent.models.checkpoint`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import torch

from megatron_agent.models.checkpoint import (
    DTYPE_NAMES,
    DTYPES,
    atomic_directory,
    copy_hf_side_files,
    hf_config_dtype,
    load_mcore_checkpoint,
    read_mcore_metadata,
)
from megatron_agent.models.families import family_of
from megatron_agent.models.transformer_config import read_hf_config, validate_layout_for_model
from megatron_agent.platform.parallel import ParallelConfig

log = logging.getLogger(__name__)


def world_size_for(parallel: ParallelConfig) -> int:
    """The fewest ranks that hold one copy of the model at this layout."""
    per_stage = math.lcm(parallel.tp * parallel.cp, parallel.ep * parallel.expert_tp)
    return per_stage * parallel.pp


def _under_ranks(fn, world_size: int, *args):
    """Run `fn` on `world_size` ranks: inline when already launched that way (torchrun)."""
    from megatron_agent.platform.launch import run_on_ranks

    if int(os.environ.get("WORLD_SIZE", "1")) == world_size and (world_size > 1 or "RANK" in os.environ):
        return [fn(*args)]
    if world_size == 1:
        os.environ.setdefault("WORLD_SIZE", "1")
        return [fn(*args)]
    return run_on_ranks(fn, world_size, *args, timeout_s=24 * 3600)


def target_dtype(source: str, requested: str | None) -> str:
    """The dtype a conversion writes: the checkpoint's own unless asked otherwise; a
    change is said in one line."""
    if requested is not None and requested not in DTYPES:
        raise ValueError(f"dtype={requested!r}; choose one of {sorted(DTYPES)}")
    target = requested or source
    if target != source:
        print(f"converting {source} -> {target} (--dtype {target})", flush=True)
    return target


def _stored_dtype(ckpt) -> str:
    floating = (ckpt.entry(n, "the checkpoint's dtype").dtype for n in sorted(ckpt.file_of))
    dtype = next((d for d in floating if d.is_floating_point), torch.float32)
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"{ckpt.source} stores {dtype}; choose --dtype from {sorted(DTYPES)}")
    return DTYPE_NAMES[dtype]


def _checkpoint_layout(hf: dict, dtype: torch.dtype):
    """The dist checkpoint's tensors for this model (built on the meta device at
    TP=PP=EP=1), each with its bridge rule."""
    from megatron_agent.models.bridge import Bridge
    from megatron_agent.models.builder import build_model
    from megatron_agent.models.checkpoint_stream import checkpoint_layout
    from megatron_agent.platform import init_distributed, shutdown_distributed

    if torch.distributed.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("a conversion runs in one process of its own, not under torchrun or beside an "
                           "initialised torch.distributed")
    os.environ.setdefault("WORLD_SIZE", "1")
    init_distributed(ParallelConfig())
    try:
        (model,) = build_model(hf, ParallelConfig(), params_dtype=dtype, training=False, init_weights=False, meta=True)
        layout = checkpoint_layout(model)
        bridge = Bridge(hf)
        return layout, {p.name: bridge.mapping(model, p.name) for p in layout.params}
    finally:
        shutdown_distributed()


class _HFParams:
    """The full Megatron tensors of an HF checkpoint's parameters (TP=1 names), one at a
    time; a layer's fused expert tensor is read once for all its experts."""

    def __init__(self, ckpt, mappings: dict, dims):
        self.ckpt, self.mappings, self.dims = ckpt, mappings, dims
        self.held: dict[tuple, torch.Tensor] = {}  # the fused expert tensors of the layer being read

    def _hf(self, name: str, read) -> list[torch.Tensor]:
        m = self.mappings[name]
        return [read(n, name) for n in m.hf_names(m.local_expert)]

    def check_shapes(self, params) -> None:
        from megatron_agent.models.bridge import full_from_hf, shape_mismatch

        for param in params:
            m, metas = self.mappings[param.name], self._hf(param.name, self.ckpt.meta)
            if tuple(full_from_hf(m, param.name, metas, self.dims, self.ckpt.source, m.local_expert).shape) != param.shape:
                raise shape_mismatch(m, param.name, param.shape, metas, self.ckpt.source, m.local_expert)

    def _expert_of_fused(self, name: str) -> torch.Tensor:
        from megatron_agent.models.bridge import full_from_hf

        m = self.mappings[name]
        key = (m.layer, *m.hf_names())
        if key not in self.held:
            for other in [k for k in self.held if k[0] != m.layer]:  # a new layer: the last one's are done
                del self.held[other]
            self.held[key] = self.ckpt.get(key[1], name)
        return full_from_hf(m, name, [self.held[key]], self.dims, self.ckpt.source, m.local_expert)

    def rows(self, name: str) -> list[torch.Tensor]:
        """The full tensor as consecutive blocks of rows (views of the HF tensors where they can be)."""
        from megatron_agent.models.bridge import fused_rows
        from megatron_agent.models.families.common import FUSED_EXPERTS

        if self.mappings[name].rule.fuse == FUSED_EXPERTS:
            return [self._expert_of_fused(name).contiguous()]
        return fused_rows(self.mappings[name].rule.fuse, self._hf(name, self.ckpt.get), self.dims)

    def full(self, name: str) -> torch.Tensor:
        rows = self.rows(name)
        return rows[0] if len(rows) == 1 else torch.cat(rows)


# --- HF -> Megatron ---------------------------------------------------------------------


def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, parallel: ParallelConfig | None = None,
                dtype: str | None = None) -> Path:
    """Convert an HF checkpoint to a Megatron dist checkpoint (torch_dist), one parameter
    at a time in one process.

    Megatron loads the result at any TP/PP/VPP/EP/ETP; `parallel`, when given, is checked
    against the model (the layout it will be loaded at). `dtype` (fp32, bf16, fp16)
    defaults to the checkpoint's own (config.json, else its tensors').
    """
    from tqdm import tqdm

    from megatron_agent.models.bridge import Dims, SafetensorsCheckpoint
    from megatron_agent.models.checkpoint_stream import write_checkpoint

    hf_dir = Path(hf_dir)
    hf = read_hf_config(hf_dir)
    family = family_of(hf)  # an unsupported family fails here, before anything is written
    if parallel is not None:
        parallel.validate(world_size_for(parallel))
        validate_layout_for_model(hf, parallel, training=False)
    ckpt = SafetensorsCheckpoint(hf_dir)  # a missing index or shard fails here too
    dtype = target_dtype(hf_config_dtype(hf) or _stored_dtype(ckpt), dtype)
    layout, mappings = _checkpoint_layout(hf, DTYPES[dtype])
    base = _HFParams(ckpt, mappings, Dims.from_hf(hf, 1))
    base.check_shapes(layout.params)  # every tensor present, every shape right, before writing
    progress = tqdm(total=len(layout.params), desc="hf -> mcore", unit="param")

    def param_rows(param) -> list[torch.Tensor]:
        progress.update()
        return [block.to(param.dtype) for block in base.rows(param.name)]

    with atomic_directory(out_dir) as tmp:
        write_checkpoint(tmp, layout, param_rows)
        progress.close()
        copy_hf_side_files(hf_dir, tmp / "hf")
        (tmp / "megatron_agent.json").write_text(json.dumps({
            "format": "megatron-agent mcore checkpoint",
            "family": family.name,
            "dtype": dtype,
            "saved_at_layout": _layout_dict(ParallelConfig()),
            "megatron_core": _version("megatron-core"),
        }, indent=2))
    log.info("wrote %s (%s, %s)", out_dir, family.name, dtype)
    return Path(out_dir)


def _layout_dict(parallel: ParallelConfig) -> dict:
    return {k: v for k, v in vars(parallel).items() if k != "sequence_parallel"}


def _version(dist_name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(dist_name)


# --- Megatron -> HF ---------------------------------------------------------------------


def mcore_to_hf(
    mcore_dir: str | Path,
    out_dir: str | Path,
    *,
    hf_config_dir: str | Path | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    base_dir: str | Path | None = None,
) -> Path:
    """Convert a Megatron dist checkpoint (written at any layout) to an HF directory:
    safetensors shards of at most `max_shard_bytes`, config and tokenizer.

    Reads one parameter at a time, splits it with the bridge's rules and appends its HF
    tensors to shards laid out beforehand; experts stored fused per layer are gathered
    into their HF tensor (published layout), which is written after its last expert.
    `dtype` defaults to the checkpoint's own. A checkpoint of LoRA adapters (the actor's
    with `actor.lora`) is written merged: each base tensor, read from the base model's HF
    directory (`base_dir`, default: the one the checkpoint names), plus scale·B·A.
    """
    from tqdm import tqdm

    from megatron_agent.models.bridge import Dims, SafetensorsCheckpoint, hf_tensors_gathering_experts
    from megatron_agent.models.checkpoint_stream import read_params
    from megatron_agent.models.lora import LoraConfig
    from megatron_agent.models.safetensors_io import TensorSpec, write_streamed_shards
    from megatron_agent.models.transformer_config import num_experts

    mcore_dir = Path(mcore_dir)
    meta = read_mcore_metadata(mcore_dir)
    side = Path(hf_config_dir) if hf_config_dir else mcore_dir / "hf"
    hf = read_hf_config(side)
    out_dtype = DTYPES[target_dtype(meta["dtype"], dtype)]
    layout, mappings = _checkpoint_layout(hf, DTYPES[meta["dtype"]])
    dims = Dims.from_hf(hf, 1)
    exported = [p for p in layout.params if mappings[p.name].rule.export]

    def hf_tensors(params_and_fulls):
        fulls = ((mappings[p.name], mappings[p.name].local_expert, full.to(out_dtype)) for p, full in params_and_fulls)
        return hf_tensors_gathering_experts(fulls, dims, num_experts(hf) or 0)

    specs = [TensorSpec(n, tuple(t.shape), t.dtype)
             for n, t in hf_tensors((p, torch.empty(p.shape, device="meta")) for p in exported)]
    if "lora" in meta:
        base = _lora_base(mcore_dir, meta, base_dir)
        merged = _merged_with_adapters(mcore_dir, LoraConfig(**meta["lora"]),
                                       _HFParams(SafetensorsCheckpoint(base), mappings, dims), exported)
    else:
        merged = read_params(mcore_dir, exported)
    params = tqdm(merged, desc="mcore -> hf", total=len(exported), unit="param")
    tensors = hf_tensors(params)
    with atomic_directory(out_dir) as tmp:
        written = write_streamed_shards(specs, tensors, tmp, max_shard_bytes)
        copy_hf_side_files(side, tmp)
        config = json.loads((tmp / "config.json").read_text())
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = str(out_dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    log.info("wrote %s: %d shard(s), %.1f MB", out_dir, written["shards"], written["total_size"] / 1e6)
    return Path(out_dir)


def _lora_base(mcore_dir: Path, meta: dict, base_dir) -> Path:
    base = Path(base_dir or meta.get("base_model", ""))
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"{mcore_dir} holds LoRA adapters of the base model {str(base)!r}, which has no "
                                "config.json here: give the base model's HF directory (--base DIR)")
    return base


def read_adapters(mcore_dir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{linear's TP=1 name: (A, B)} of a LoRA checkpoint, whole (its keys are layout-free)."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_agent.models.checkpoint_stream import Chunk, ParamChunks, read_params

    stored = FileSystemReader(str(mcore_dir)).read_metadata().state_dict_metadata
    params = []
    for key, md in stored.items():
        if key.startswith("lora.") and hasattr(md, "size"):
            shape = tuple(md.size)
            whole = Chunk(key, shape, (0,) * len(shape), shape, tuple(slice(0, n) for n in shape))
            params.append(ParamChunks(key, shape, md.properties.dtype, (whole,)))
    tensors = {p.name: t for p, t in read_params(mcore_dir, params)}
    linears = {key.removeprefix("lora.").rsplit(".", 1)[0] for key in tensors}
    return {name: (tensors[f"lora.{name}.a"], tensors[f"lora.{name}.b"]) for name in linears}


def _merged_with_adapters(mcore_dir: Path, lora, base: _HFParams, exported):
    """(param, full tensor) in turn: the base's, plus scale·B·A where the linear has an adapter."""
    from megatron_agent.models.lora import merge

    adapters = read_adapters(mcore_dir)
    for param in exported:
        full = base.full(param.name)
        adapter = adapters.pop(param.name.removesuffix(".weight"), None)
        yield param, full if adapter is None else merge(full, *adapter, lora.scale)
    if adapters:
        raise ValueError(f"{mcore_dir}: adapters of linears the model does not have: {sorted(adapters)[:3]}")


# --- LoRA -> PEFT ---------------------------------------------------------------------------

def lora_to_peft(mcore_dir: str | Path, out_dir: str | Path) -> Path:
    """The adapters of a LoRA checkpoint as a PEFT adapter directory (adapter_config.json,
    adapter_model.safetensors) for the base model the checkpoint names."""
    from megatron_agent.models.lora import LoraConfig, peft_config, peft_tensors, write_peft_dir

    mcore_dir = Path(mcore_dir)
    meta = read_mcore_metadata(mcore_dir)
    if "lora" not in meta:
        raise ValueError(f"{mcore_dir} holds a whole model, no LoRA adapters: mcore-to-hf exports it")
    lora = LoraConfig(**meta["lora"])
    hf = read_hf_config(mcore_dir / "hf")
    tensors = peft_tensors(hf, read_adapters(mcore_dir))
    config = peft_config(hf, lora, meta.get("base_model"))
    write_peft_dir(out_dir, config, tensors)
    log.info("wrote %s: %d adapter tensors on %s", out_dir, len(tensors),
             ", ".join([*(config["target_modules"] or []), *config.get("target_parameters", [])]))
    return Path(out_dir)


# --- verify ---------------------------------------------------------------------------------


def _verify_rank(hf_dir: str, mcore_dir: str, layout: dict, seq_len: int, seed: int) -> dict | None:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from megatron_agent.models.builder import build_model
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.schedule import forward_logits

    meta = read_mcore_metadata(Path(mcore_dir))
    dtype = DTYPES[meta["dtype"]]
    hf = read_hf_config(hf_dir)
    ctx = init_distributed(ParallelConfig(**layout))
    chunks = build_model(hf, ctx.parallel, params_dtype=dtype, training=False, init_weights=False)
    load_mcore_checkpoint(chunks, mcore_dir)
    ids = torch.randint(0, hf["vocab_size"], (2, seq_len), generator=torch.Generator().manual_seed(seed))
    if family_of(hf).vision_tower:  # text only: no image or video placeholder may be drawn
        ids[(ids == hf["image_token_id"]) | (ids == hf.get("video_token_id", -1))] = 0
    logits = forward_logits(chunks, ids, hf["vocab_size"])
    if logits is None or ctx.rank != ctx.world_size - 1:
        return None
    auto = AutoModelForImageTextToText if family_of(hf).vision_tower else AutoModelForCausalLM
    reference = auto.from_pretrained(hf_dir, dtype=dtype)(ids).logits.detach()
    a, b = logits.double().flatten(), reference.double().flatten()
    return {
        "max_abs_diff": float((a - b).abs().max()),
        "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
        "dtype": meta["dtype"],
    }


def verify(hf_dir: str | Path, mcore_dir: str | Path, parallel: ParallelConfig, *, seq_len: int = 32,
           seed: int = 0) -> dict:
    """Logits of the HF model and the Megatron checkpoint on the same random tokens."""
    hf = read_hf_config(hf_dir)
    family_of(hf)
    world = world_size_for(parallel)
    parallel.validate(world)
    validate_layout_for_model(hf, parallel, training=False)
    layout = _layout_dict(parallel)
    results = _under_ranks(_verify_rank, world, str(hf_dir), str(mcore_dir), layout, seq_len, seed)
    return next(r for r in results if r is not None)
