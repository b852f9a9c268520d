"""The parallel layout: a typed config, its validation, and Megatron's process groups.

Every check runs on plain integers before a process group or a model exists, so a bad
layout fails at once with the numbers that do not fit.
"""

from __future__ import annotations

from dataclasses import dataclass


class ParallelLayoutError(ValueError):
    """A parallel layout that does not fit the world size or the model."""


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron's parallel sizes. Data parallel is derived from the world size.

    tp: tensor, pp: pipeline, vpp: virtual pipeline chunks per stage (None = off),
    cp: context (only 1: context parallelism is refused by `validate`), ep: expert,
    etp: expert tensor (None = same as tp).
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = False

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)

    def expert_data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.expert_tp * self.ep * self.pp)

    def validate(self, world_size: int) -> int:
        """Check the layout against the world size; return the data-parallel size."""
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ParallelLayoutError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if self.etp is not None and self.etp < 1:
            raise ParallelLayoutError(f"parallel.etp={self.etp} must be >= 1")
        if self.cp > 1:
            # Megatron's local attention refuses it (only Transformer Engine's attention
            # splits a sequence over CP ranks) and the trainer does not cut batches for it.
            raise ParallelLayoutError(
                f"parallel.cp={self.cp}: context parallelism is not supported; set parallel.cp=1 "
                "and fit long sequences with tensor + sequence parallelism (parallel.tp > 1, "
                "parallel.sequence_parallel=true) or more pipeline stages (parallel.pp)"
            )
        if self.vpp is not None:
            if self.vpp < 1:
                raise ParallelLayoutError(f"parallel.vpp={self.vpp} must be >= 1 (or unset)")
            if self.pp < 2 and self.vpp > 1:
                raise ParallelLayoutError(
                    f"parallel.vpp={self.vpp} needs pipeline parallelism, but pp={self.pp}"
                )
        dense = self.tp * self.pp * self.cp
        if world_size % dense:
            raise ParallelLayoutError(
                f"tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {dense} does not divide "
                f"the world size {world_size}"
            )
        expert = self.expert_tp * self.ep * self.pp
        if world_size % expert:
            raise ParallelLayoutError(
                f"etp*ep*pp = {self.expert_tp}*{self.ep}*{self.pp} = {expert} does not divide "
                f"the world size {world_size}"
            )
        ranks_per_stage = world_size // self.pp
        if ranks_per_stage % (self.expert_tp * self.ep):
            raise ParallelLayoutError(
                f"etp*ep = {self.expert_tp}*{self.ep} does not divide the {ranks_per_stage} "
                f"ranks of a pipeline stage (world size {world_size} / pp {self.pp})"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ParallelLayoutError("parallel.sequence_parallel needs tp > 1")
        return self.data_parallel_size(world_size)

    def validate_model(
        self,
        *,
        num_layers: int,
        num_attention_heads: int,
        num_query_groups: int,
        num_experts: int | None = None,
        moe_ffn_hidden_size: int | None = None,
        ffn_hidden_size: int | None = None,
        training: bool = True,
    ) -> None:
        """Check that the model's dimensions split over this layout (for training, or
        for inference only: conversion, logits)."""
        if num_attention_heads % self.tp:
            raise ParallelLayoutError(
                f"num_attention_heads={num_attention_heads} is not divisible by tp={self.tp}"
            )
        if num_query_groups % self.tp:
            raise ParallelLayoutError(
                f"num_key_value_heads={num_query_groups} is not divisible by tp={self.tp}"
            )
        if ffn_hidden_size is not None and ffn_hidden_size % self.tp:
            raise ParallelLayoutError(
                f"intermediate_size={ffn_hidden_size} is not divisible by tp={self.tp}"
            )
        stages = self.pp * (self.vpp or 1)
        if num_layers % stages:
            raise ParallelLayoutError(
                f"num_hidden_layers={num_layers} is not divisible by pp*vpp = "
                f"{self.pp}*{self.vpp or 1} = {stages}"
            )
        if num_experts:
            if num_experts % self.ep:
                raise ParallelLayoutError(
                    f"num_experts={num_experts} is not divisible by ep={self.ep}"
                )
            if moe_ffn_hidden_size is not None and moe_ffn_hidden_size % self.expert_tp:
                raise ParallelLayoutError(
                    f"moe_intermediate_size={moe_ffn_hidden_size} is not divisible by "
                    f"etp={self.expert_tp}"
                )
            if training and self.tp > 1 and not self.sequence_parallel:
                raise ParallelLayoutError(
                    f"a MoE model with tp={self.tp} trains only with sequence parallelism "
                    "(Megatron's MoE layer requires it): set parallel.sequence_parallel=true"
                )
        elif self.ep > 1:
            raise ParallelLayoutError(f"ep={self.ep} but the model has no experts")


def initialize_model_parallel(parallel: ParallelConfig, world_size: int) -> None:
    """Create Megatron's parallel groups (torch.distributed must be initialised)."""
    from megatron.core import parallel_state

    parallel.validate(world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
    )


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
