"""Adam's step count where Megatron's optimizer keeps it, for the actor's checkpoints.

torch's Adam/AdamW (Megatron's on CPU) counts steps in every parameter's state;
Transformer Engine's and Apex's FusedAdam (Megatron's on GPU when either is installed) in
every param group. The actor saves the count beside the distributed optimizer's
checkpoint and restores it where the optimizer reads it (training/actor.py save/load).
"""

from __future__ import annotations

import torch


def torch_optimizers(optimizer) -> list:
    """The torch optimizers under Megatron's (chained: experts and the rest) optimizer."""
    return [inner.optimizer for inner in getattr(optimizer, "chained_optimizers", [optimizer])]


def step_per_parameter(torch_optimizer) -> bool:
    """Where Adam counts its steps. torch's Adam/AdamW (Megatron's on CPU): in every
    parameter's state. Transformer Engine's and Apex's FusedAdam (Megatron's on GPU when
    either is installed): in every param group, with a parameter's state holding only
    exp_avg, exp_avg_sq and master_param (TE's state_dict raises KeyError on any other
    name: transformer_engine/pytorch/optimizers/fused_adam.py, get_unscaled_state)."""
    return isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW))


def materialize_adam_state(optimizer) -> None:
    """Give every parameter of a torch Adam a zero state with its step, as a first step
    would.

    Without Apex/TE, Megatron's distributed optimizer reads "step" from the torch
    optimizer's per-parameter state when it builds its state dict
    (optimizer/distrib_optimizer.py, DistributedOptimizer.state_dict), but its loading
    path only creates exp_avg/exp_avg_sq for a fresh optimizer, so loading into an
    optimizer that never stepped fails. The values are overwritten by the load. A
    FusedAdam needs nothing: Megatron reads its step from the param groups and allocates
    its state itself when loading (DistributedOptimizer.load_state_dict).
    """
    for torch_optimizer in torch_optimizers(optimizer):
        if not step_per_parameter(torch_optimizer):
            continue
        for group in torch_optimizer.param_groups:
            for p in group["params"]:
                state = torch_optimizer.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)


def adam_steps(optimizer) -> int:
    steps = []
    for torch_optimizer in torch_optimizers(optimizer):
        if step_per_parameter(torch_optimizer):
            steps += [float(st["step"]) for st in torch_optimizer.state.values() if "step" in st]
        else:
            steps += [float(group["step"]) for group in torch_optimizer.param_groups if "step" in group]
    return int(max(steps, default=0))


def set_adam_steps(optimizer, steps: int) -> None:
    """Restore Adam's step count (its bias correction) from the count saved beside the
    distributed optimizer's "dp_reshardable" checkpoint. Without Apex/TE that checkpoint
    does not restore torch Adam's per-parameter step (it travels in the runtime param
    groups, optimizer/distrib_optimizer.py load_state_dict), and the bias correction would
    restart; a FusedAdam gets its param groups' step from the same saved count."""
    for torch_optimizer in torch_optimizers(optimizer):
        if step_per_parameter(torch_optimizer):
            for state in torch_optimizer.state.values():
                state["step"] = torch.tensor(float(steps))
        else:
            for group in torch_optimizer.param_groups:
                group["step"] = steps
