"""The actor's checkpoints: what they hold and how they are written and read.

    save_checkpoint(actor, "runs/x/checkpoints/iter_000010")   # every rank (Actor.save)
    load_checkpoint(actor, "runs/x/checkpoints/iter_000010")   # every rank (Actor.load)

A checkpoint is a dist_checkpointing directory (any TP/PP/EP layout reads it back) with the
model (with LoRA: the adapters alone, the base staying the model directory), the optimizer,
the scheduler, the RNG states and the step, plus `megatron_agent.json` (family, dtype, the
layout it was saved at, LoRA settings) and the model's HF side files under `hf/`. It is
written into a temporary sibling and renamed once every rank is done.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_agent.models.checkpoint import copy_hf_side_files, model_state, read_mcore_metadata
from megatron_agent.models.families import family_of
from megatron_agent.models.lora import lora_mismatch, lora_sharded_state
from megatron_agent.platform.distributed import control_group
from megatron_agent.training.adam_steps import adam_steps, materialize_adam_state, set_adam_steps


def saved_layout(parallel) -> dict:
    """The layout a checkpoint records (sequence parallelism changes no tensor of it)."""
    return {k: v for k, v in vars(parallel).items() if k != "sequence_parallel"}


def checkpoint_state(actor, is_loading: bool) -> dict:
    """What a checkpoint of `actor` holds, as dist_checkpointing's sharded state."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    # With LoRA the base stays the model directory: the checkpoint holds the adapters.
    state = {"lora": lora_sharded_state(actor.chunks)} if actor.lora else model_state(actor.chunks)
    # The distributed optimizer's checkpoint reshards over DP only ("dp_reshardable";
    # its fully reshardable format needs Apex/TE's Adam). The plain optimizer's state is
    # keyed by parameter, reshardable to any layout, without the chained-optimizer
    # prefix (a MoE model has one optimizer for experts, one for the rest).
    metadata = ({"distrib_optim_sharding_type": "dp_reshardable"} if actor.distributed_optimizer
                else {"chained_optim_avoid_prefix": True})
    state["optimizer"] = actor.optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    state["rng_state"] = ShardedObject(
        "rng_state", rng, (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )
    state["scheduler"] = actor.scheduler.state_dict()
    state["step"] = actor.step
    state["adam_steps"] = adam_steps(actor.optimizer)
    return state


def save_checkpoint(actor, directory: str | Path) -> Path:
    """Write a checkpoint atomically (temporary dir, renamed when every rank is done);
    keep the last `keep_checkpoints` siblings."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.partial")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=control_group())
    _writer_results_queue_dies_with_us()
    dist_checkpointing.save(checkpoint_state(actor, is_loading=False), str(tmp))
    dist.barrier(group=control_group())
    if dist.get_rank() == 0:
        copy_hf_side_files(actor.model_dir, tmp / "hf")
        (tmp / "megatron_agent.json").write_text(json.dumps({
            "format": "megatron-agent mcore checkpoint", "family": family_of(actor.hf).name,
            "dtype": actor.config.params_dtype, "saved_at_layout": saved_layout(actor.parallel), "step": actor.step,
            **({"lora": asdict(actor.lora), "base_model": str(actor.model_dir.resolve())} if actor.lora else {}),
        }, indent=2))
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
        siblings = sorted(p for p in directory.parent.iterdir() if p.is_dir() and not p.name.startswith("."))
        for old in siblings[: max(0, len(siblings) - actor.config.keep_checkpoints)]:
            shutil.rmtree(old)
    dist.barrier(group=control_group())
    return directory


def load_checkpoint(actor, directory: str | Path) -> None:
    """Restore model, optimizer, scheduler and step; RNG too when the layout is the same."""
    import warnings

    from megatron.core import dist_checkpointing

    directory = Path(directory)
    metadata = read_mcore_metadata(directory)
    saved = metadata["saved_at_layout"]
    mismatch = lora_mismatch(str(directory), metadata.get("lora"), actor.lora)
    if mismatch:
        raise ValueError(mismatch)
    if (saved.get("ep", 1) > 1) != (actor.parallel.ep > 1) and family_of(actor.hf).moe:
        # Megatron keeps expert and dense optimizer states in separate optimizers when
        # ep > 1 and in one when ep == 1; their checkpoints do not map onto each other.
        raise ValueError(
            f"{directory} was saved at ep={saved.get('ep', 1)}; resuming its optimizer at "
            f"ep={actor.parallel.ep} is not supported (export the weights with megatron-agent-convert "
            "and start a new optimizer, or resume with ep on the same side of 1)"
        )
    if actor.distributed_optimizer:
        materialize_adam_state(actor.optimizer)
    state = checkpoint_state(actor, is_loading=True)
    same_layout = saved == saved_layout(actor.parallel)
    # the parameters behind the adapters' keys (load rewrites the state's entries)
    params = {key: sharded.data for key, sharded in state.get("lora", {}).items()}
    if not same_layout:
        state.pop("rng_state")
    with warnings.catch_warnings():
        # Megatron-Core 0.16's torch_dist reader calls torch's deprecated load_state_dict
        # on ShardedTensors; torch's FutureWarnings about it name nothing a user can change.
        warnings.filterwarnings("ignore", message="`load_state_dict` is deprecated", category=FutureWarning,
                                module=r"megatron\.core\.dist_checkpointing\.")
        warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating "
                                "ShardedTensor", category=FutureWarning, module=r"torch\.distributed\.checkpoint\.")
        loaded = dist_checkpointing.load(state, str(directory))
    if actor.lora:
        with torch.no_grad():
            for key, tensor in loaded["lora"].items():
                params[key].copy_(tensor)
    else:
        for i, chunk in enumerate(actor.chunks):
            chunk.load_state_dict(loaded[f"model{i}"])
    with torch.no_grad():  # fp32 distributed optimizer: its shards are views of the params
        actor.optimizer.load_state_dict(loaded["optimizer"])
    if actor.distributed_optimizer:
        set_adam_steps(actor.optimizer, int(loaded["adam_steps"]))
    actor.scheduler.load_state_dict(loaded["scheduler"])
    actor.step = int(loaded["step"])
    if same_layout:
        rng = loaded["rng_state"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])


def _writer_results_queue_dies_with_us() -> None:
    """dist_checkpointing's file writer collects results through a multiprocessing Manager
    that it starts once and never stops (strategies/filesystem_async.py,
    _get_write_results_queue). A trainer killed with SIGKILL would leave that server
    process behind, holding the trainer's stdout; start it ourselves, set to die with us."""
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_agent.platform.distributed import die_with_parent

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=die_with_parent)
        filesystem_async._results_queue = manager.Queue()
