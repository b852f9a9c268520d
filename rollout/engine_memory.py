"""The embedded engine's memory release and resume (SGLang's `/release_memory_occupation`
and `/resume_memory_occupation`), for colocated runs: the engine gives its memory back
while the trainer on the same devices trains.

Tags, as SGLang's: "weights" frees every parameter's memory (an empty tensor stands in
until resumed; tied parameters are one object, freed once); "kv_cache" is the KV cache, which
this engine keeps only while a batch runs, so releasing it just refuses generation;
"cuda_graph" has nothing to free here. No tags means all of them. Resuming "weights"
allocates them again, zero-filled: the trainer then sends every weight
(`/update_weights_from_tensor`); until both are resumed, generation is refused.
"""

from __future__ import annotations

import torch

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def memory_tags(tags) -> list[str]:
    """The tags of a request (None or empty: all); ValueError names an unknown one."""
    tags = list(tags or MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; use {list(MEMORY_TAGS)}")
    return tags


def free_parameters(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.Size]]:
    """Point every parameter at an empty tensor (its memory goes; a tied parameter is one
    object, freed once); return what `reallocate_parameters` needs."""
    freed = []
    for p in model.parameters():
        freed.append((p, p.shape))
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return freed


def reallocate_parameters(freed: list[tuple[torch.nn.Parameter, torch.Size]]) -> None:
    for p, shape in freed:
        p.data = torch.zeros(shape, dtype=p.dtype, device=p.device)


def released_problem(released: set[str]) -> str | None:
    """Why generation is refused with these tags released (None: it is not)."""
    blocking = sorted(released & {"weights", "kv_cache"})
    if not blocking:
        return None
    return (f"the engine's memory is released ({', '.join(blocking)}): generation is refused until "
            "POST /resume_memory_occupation (and, after resuming weights, a weight update)")
