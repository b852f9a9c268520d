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
    DTYPES,
    atomic_directory,
    copy_hf_side_files,
    load_mcore_checkpoint,
    model_state,
    read_mcore_metadata,
    write_safetensors_shards,
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


# --- HF -> Megatron ---------------------------------------------------------------------


def _hf_to_mcore_rank(hf_dir: str, tmp_dir: str, layout: dict, dtype_name: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_agent.models.bridge import load_hf_weights
    from megatron_agent.models.builder import build_model
    from megatron_agent.platform import ParallelConfig, init_distributed

    ctx = init_distributed(ParallelConfig(**layout))
    chunks = build_model(hf_dir, ctx.parallel, params_dtype=DTYPES[dtype_name], training=False, init_weights=False)
    load_hf_weights(chunks, hf_dir, progress=ctx.rank == 0)
    dist_checkpointing.save(model_state(chunks), tmp_dir)
    dist.barrier()


def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, parallel: ParallelConfig, dtype: str = "bf16") -> Path:
    """Convert an HF checkpoint to a Megatron dist checkpoint written at `parallel`."""
    from megatron_agent.models.bridge import SafetensorsCheckpoint

    hf_dir = Path(hf_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {sorted(DTYPES)}")
    hf = read_hf_config(hf_dir)
    family = family_of(hf)  # an unsupported family fails here, before any process starts
    family.rules(hf)
    world = world_size_for(parallel)
    parallel.validate(world)
    validate_layout_for_model(hf, parallel, training=False)
    SafetensorsCheckpoint(hf_dir)  # a missing index or shard fails here too
    layout = {k: v for k, v in vars(parallel).items() if k != "sequence_parallel"}
    with atomic_directory(out_dir) as tmp:
        _under_ranks(_hf_to_mcore_rank, world, str(hf_dir), str(tmp), layout, dtype)
        copy_hf_side_files(hf_dir, tmp / "hf")
        (tmp / "megatron_agent.json").write_text(json.dumps({
            "format": "megatron-agent mcore checkpoint",
            "family": family.name,
            "dtype": dtype,
            "saved_at_layout": layout,
            "megatron_core": _version("megatron-core"),
        }, indent=2))
    log.info("wrote %s (%s, %s at %s)", out_dir, family.name, dtype, layout)
    return Path(out_dir)


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
) -> Path:
    """Convert a Megatron dist checkpoint to an HF directory (safetensors + config + tokenizer).

    Loads the checkpoint at TP=PP=EP=1 in this process (dist_checkpointing reshards) and
    streams the bridge's export into shards of at most `max_shard_bytes`.
    """
    from tqdm import tqdm

    from megatron_agent.models.bridge import export_hf_weights
    from megatron_agent.models.builder import build_model
    from megatron_agent.platform import ParallelConfig, init_distributed, shutdown_distributed

    mcore_dir = Path(mcore_dir)
    meta = read_mcore_metadata(mcore_dir)
    side = Path(hf_config_dir) if hf_config_dir else mcore_dir / "hf"
    hf = read_hf_config(side)
    family_of(hf)
    out_dtype = DTYPES[dtype or meta["dtype"]]
    os.environ.setdefault("WORLD_SIZE", "1")
    ctx = init_distributed(ParallelConfig())
    try:
        chunks = build_model(hf, ctx.parallel, params_dtype=DTYPES[meta["dtype"]], training=False, init_weights=False)
        load_mcore_checkpoint(chunks, mcore_dir)
        with atomic_directory(out_dir) as tmp:
            tensors = ((n, t.to(out_dtype)) for n, t in export_hf_weights(chunks, hf))
            count = sum(1 for _ in chunks[0].parameters())
            written = write_safetensors_shards(tqdm(tensors, desc="writing HF shards", total=count, unit="param"),
                                               tmp, max_shard_bytes)
            copy_hf_side_files(side, tmp)
            config = json.loads((tmp / "config.json").read_text())
            config["torch_dtype" if "torch_dtype" in config else "dtype"] = str(out_dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
    finally:
        shutdown_distributed()
    log.info("wrote %s: %d shard(s), %.1f MB", out_dir, written["shards"], written["total_size"] / 1e6)
    return Path(out_dir)


# --- verify ---------------------------------------------------------------------------------


def _verify_rank(hf_dir: str, mcore_dir: str, layout: dict, seq_len: int, seed: int) -> dict | None:
    from transformers import AutoModelForCausalLM

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
    logits = forward_logits(chunks, ids, hf["vocab_size"])
    if logits is None or ctx.rank != ctx.world_size - 1:
        return None
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)(ids).logits.detach()
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
    layout = {k: v for k, v in vars(parallel).items() if k != "sequence_parallel"}
    results = _under_ranks(_verify_rank, world, str(hf_dir), str(mcore_dir), layout, seq_len, seed)
    return next(r for r in results if r is not None)
