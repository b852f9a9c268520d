"""The Megatron-Core training actor: one object per rank.

    actor = Actor(model_dir, parallel, ActorConfig(...), AlgorithmConfig(...))
    out = actor.compute_logprobs(batch)            # {"logprobs", "entropy"} [N, L-1] on every rank
    metrics = actor.update(batch)                  # PPO-style epochs over mini-batches
    actor.save(dir); actor.load(dir)               # dist checkpoint: model, optimizer, scheduler, RNG, step
    for name, tensor in actor.named_hf_weights():  # HF names, full tensors (weight sync, export)

A rank works on its data-parallel shard (training/batch.py: sample i belongs to DP rank
i % dp): the driver sends each rank only its shard; given the whole batch, a rank cuts
its shard itself. Per-token results come back for the rows given (a whole batch: all of
them, on every rank); metrics come back identical on every rank. Micro-batches are cut by a token budget
(dynamic batch size) and run through Megatron's pipeline schedule; a vision-language
model's micro-batch also carries its samples' images and MRoPE positions
(`batch.micro_batch_images`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_agent.algorithms import AlgorithmConfig, actor_loss
from megatron_agent.models.bridge import export_hf_weights, load_hf_weights, pack_parameters
from megatron_agent.models.builder import build_model
from megatron_agent.models.checkpoint import DTYPES
from megatron_agent.models.lora import (
    LoraConfig,
    adapters_off,
    add_lora,
    describe_trainable,
    peft_config,
    peft_tensors,
    whole_adapters,
)
from megatron_agent.models.transformer_config import num_experts, read_hf_config
from megatron_agent.platform.collectives import all_reduce, broadcast
from megatron_agent.platform.distributed import control_group
from megatron_agent.platform.parallel import ParallelConfig
from megatron_agent.training.actor_checkpoint import load_checkpoint, save_checkpoint
from megatron_agent.training.batch import TrainBatch, micro_batch_images, micro_batches_by_tokens
from megatron_agent.training.logprobs import token_logprobs, token_logprobs_and_entropy
from megatron_agent.training.routing_replay import (
    RoutingRecord,
    RoutingWatch,
    finished_routes,
    on_every_router,
)
from megatron_agent.training.schedule import (
    attach_grad_finalization,
    layout_multiple,
    run_schedule,
    wrap_with_ddp,
)

log = logging.getLogger(__name__)

# Metrics normalised by the mini-batch's global count (partial sums of one global mean).
GLOBALLY_NORMALISED = frozenset({"pg_loss", "kl_loss", "actor_loss", "value_loss"})


@dataclass
class ActorConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_steps: int | None = None  # None: constant after warm-up
    lr_decay_style: str = "cosine"  # used when lr_decay_steps is set: linear | cosine
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    ppo_epochs: int = 1
    num_mini_batches: int = 1
    shuffle: bool = True
    max_tokens_per_micro_batch: int = 8192
    params_dtype: str = "fp32"  # fp32 on CPU; bf16 (fp32 main params in the optimizer) on GPU
    use_distributed_optimizer: bool | None = None  # None: when data parallel > 1
    layer_spec: str = "auto"
    fp8_recipe: str | None = None
    keep_checkpoints: int = 2
    seed: int = 1234
    # Low-rank adapters: the base frozen, only they train and are checkpointed (models/lora.py).
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self) -> None:
        self.lora.validate()
        for name in ("lr", "max_tokens_per_micro_batch", "ppo_epochs", "num_mini_batches"):
            if not getattr(self, name) > 0:
                raise ValueError(f"actor.{name}={getattr(self, name)} must be > 0")
        if self.params_dtype not in DTYPES:
            raise ValueError(f"actor.params_dtype={self.params_dtype!r}; choose one of {sorted(DTYPES)}")
        if self.lr_decay_style not in ("linear", "cosine", "constant"):
            raise ValueError(f"actor.lr_decay_style={self.lr_decay_style!r}; choose linear, cosine or constant")


class Actor:
    # algorithm.routing_replay=rollout routes this model's forwards (and its reference's) by
    # the engines' expert ids, the batch's routed_experts (training/routing_replay.py)
    REPLAYS_ROUTING = True
    HAS_REFERENCE = True  # a frozen initial policy for the KL loss, when it is active

    def __init__(
        self,
        model_dir: str | Path,
        parallel: ParallelConfig,
        config: ActorConfig,
        algorithm: AlgorithmConfig,
    ):
        from megatron.core import parallel_state as ps
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        config.validate()
        algorithm.validate()
        self.model_dir = Path(model_dir)
        self.hf = read_hf_config(model_dir)
        self.parallel, self.config, self.algorithm = parallel, config, algorithm
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        dtype = DTYPES[config.params_dtype]
        self.replays_routing = self.REPLAYS_ROUTING and algorithm.routing_replay != "none"
        build = dict(params_dtype=dtype, layer_spec=config.layer_spec, fp8_recipe=config.fp8_recipe,
                     init_weights=False, routing_replay=self.replays_routing)

        chunks = self._build_chunks(build)
        self.lora = config.lora if config.lora.enabled else None
        if self.lora:
            add_lora(chunks, self.lora, seed=config.seed)
        self.chunks = chunks  # unwrapped, for checkpoints and export
        distributed = config.use_distributed_optimizer
        if distributed is None:
            distributed = self.dp_size > 1
        self.distributed_optimizer = distributed
        if not distributed:  # the distributed optimizer lays the parameters out in its own buffer
            pack_parameters(chunks, self.hf)
        self.model = wrap_with_ddp(chunks, use_distributed_optimizer=distributed)
        attach_grad_finalization(self.model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=config.lr, min_lr=config.min_lr, weight_decay=config.weight_decay,
                adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
                clip_grad=config.clip_grad, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                params_dtype=dtype, use_distributed_optimizer=distributed,
            ),
            self.model,
        )
        decay = config.lr_decay_steps
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if config.lr_warmup_steps else config.lr, max_lr=config.lr,
            min_lr=config.min_lr, lr_warmup_steps=config.lr_warmup_steps,
            lr_decay_steps=decay if decay else config.lr_warmup_steps + 1,
            lr_decay_style=config.lr_decay_style if decay else "constant",
            start_wd=config.weight_decay, end_wd=config.weight_decay, wd_incr_steps=1, wd_incr_style="constant",
        )
        # With LoRA the reference is the actor with its adapters off: no second model.
        self.has_reference = algorithm.kl_loss_active and self.HAS_REFERENCE
        self.reference = self._build_reference(build) if self.has_reference and not self.lora else None
        self.step = 0
        self._report_trainable()

    def _report_trainable(self) -> None:
        """Log, once, the trainable parameters of the whole model and the optimizer's bytes for them."""
        trainable, total = _count_once(self.chunks)
        self.trainable_parameters = trainable
        if dist.get_rank() == 0:
            model = total - trainable if self.lora else total  # the adapters are not the model's
            log.info("%s: %s", type(self).__name__.lower(),
                     describe_trainable(trainable, model, self.lora, self.config.params_dtype))

    def _build_chunks(self, build: dict) -> list:
        chunks = build_model(self.hf, self.parallel, **build)
        load_hf_weights(chunks, self.model_dir)
        return chunks

    def _build_reference(self, build: dict) -> list | None:
        """A frozen copy of the initial policy, for the KL loss."""
        reference = build_model(self.hf, self.parallel, **build)
        load_hf_weights(reference, self.model_dir)
        for chunk in reference:
            chunk.requires_grad_(False)
        return reference

    # --- forward passes -------------------------------------------------------------------

    def _shard(self, batch: TrainBatch) -> TrainBatch:
        return batch if batch.is_shard else batch.dp_shard(self.dp_rank, self.dp_size)

    def _micro_batches(self, batch: TrainBatch, indices: list[int], **per_token) -> list[dict]:
        groups = micro_batches_by_tokens(batch.lengths[indices], self.config.max_tokens_per_micro_batch,
                                         min_count=self.pp_size, multiple=layout_multiple(self.chunks))
        out = []
        for group in groups:
            idx = torch.tensor([indices[g] for g in group])
            width = int(batch.lengths[idx].max())
            tokens = batch.tokens[idx, :width]
            mb = {
                "input_ids": tokens[:, :-1].contiguous(),
                "position_ids": torch.arange(width - 1).unsqueeze(0).expand(len(idx), -1).contiguous(),
                "targets": tokens[:, 1:].contiguous(),
                "response_mask": batch.response_mask[idx, : width - 1],
                "index": idx,
            }
            if batch.has_images or "vision_config" in self.hf:
                mb.update(micro_batch_images(batch, idx, mb["input_ids"], self.hf))
            if self.algorithm.routing_replay == "rollout" and self.replays_routing and batch.routed_experts is None:
                raise ValueError("algorithm.routing_replay=rollout: the batch carries no routed_experts "
                                 "(the engines' expert ids)")
            if self.REPLAYS_ROUTING and batch.routed_experts is not None:  # replayed, or watched (RoutingWatch)
                mb["routed_experts"] = batch.routed_experts[idx, : width - 1]
            if self.REPLAYS_ROUTING and num_experts(self.hf):  # each token's place, for RoutingWatch / RoutingRecord
                fed = torch.arange(width - 1) < (batch.lengths[idx, None] - 1)
                mb["route_rows"] = torch.where(fed, idx[:, None], -1)
            for name, value in per_token.items():
                if value is not None:
                    mb[name] = value[idx] if value.dim() == 1 else value[idx, : width - 1]
            out.append(mb)
        return out

    def _same_count_as_peers(self, micro: list[dict]) -> list[dict]:
        """With expert parallelism the ranks of an EP group (DP ranks) exchange tokens in
        every micro-batch, so each must run as many micro-batches as the others, whatever
        its shard: one with fewer runs copies of a micro-batch marked "idle" (they count for
        nothing: no row, no loss, no metric)."""
        from megatron.core import parallel_state as ps

        if self.dp_size == 1 or ps.get_expert_model_parallel_world_size() == 1:
            return micro
        count = all_reduce(torch.tensor([len(micro)]), ps.get_data_parallel_group(), op=dist.ReduceOp.MAX)
        if int(count) == len(micro):
            return micro
        filler = micro[-1] if micro else self._micro_batches(_IDLE_BATCH, [0])[0]
        idle = dict(filler, index=torch.zeros(0, dtype=torch.long), idle=torch.tensor(True),
                    response_mask=torch.zeros_like(filler["response_mask"]))
        if "route_rows" in idle:  # its tokens are no row's: no routing watch or record counts them
            idle["route_rows"] = torch.full_like(idle["route_rows"], -1)
        return micro + [idle] * (int(count) - len(micro))

    def _forward_micro_batches(self, shard: TrainBatch) -> list[dict]:
        """The micro-batches of a forward-only pass over the whole shard."""
        micro = self._micro_batches(shard, list(range(shard.size))) if shard.size else []
        return self._same_count_as_peers(micro)

    def _gather_per_token(self, local: dict[int, torch.Tensor], shard: TrainBatch, batch: TrainBatch,
                          per_token: bool = True) -> torch.Tensor:
        """The shard's rows computed on last-stage ranks -> those rows on every stage; for a
        whole `batch`, the whole [N, width] on every rank."""
        from megatron.core import parallel_state as ps

        rows = torch.zeros(shard.size, shard.tokens.shape[1] - 1 if per_token else 1)
        for i, row in local.items():
            rows[i, : row.shape[0]] = row
        if self.pp_size > 1 and rows.numel():
            last = ps.get_pipeline_model_parallel_last_rank()
            broadcast(rows, last, ps.get_pipeline_model_parallel_group())
        if batch.is_shard:
            return rows
        whole = torch.zeros(batch.size, batch.tokens.shape[1] - 1 if per_token else 1)
        whole[shard.positions(), : rows.shape[1]] = rows
        if self.dp_size > 1:
            all_reduce(whole, ps.get_data_parallel_group())  # each row is set on one DP rank
        return whole

    def _over_routing_ranks(self, rows: torch.Tensor, shard: TrainBatch, batch: TrainBatch) -> torch.Tensor:
        """Per-row routing figures (RoutingWatch, RoutingRecord) summed over the ranks that route
        a row's tokens (TP ranks under sequence parallelism; pipeline stages, their layers),
        then placed as `_gather_per_token` places rows (a whole batch: every DP rank's)."""
        from megatron.core import parallel_state as ps

        if self.parallel.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
            all_reduce(rows, ps.get_tensor_model_parallel_group())
        if self.pp_size > 1:
            all_reduce(rows, ps.get_pipeline_model_parallel_group())
        if batch.is_shard:
            return rows
        shape = [batch.size, *rows.shape[1:]]
        if rows.dim() > 2:  # per token: the whole batch's columns
            shape[1] = batch.tokens.shape[1] - 1
        whole = torch.zeros(shape, dtype=rows.dtype)
        whole[shard.positions(), : rows.shape[1]] = rows
        if self.dp_size > 1:
            all_reduce(whole, ps.get_data_parallel_group())
        return whole

    def compute_logprobs(self, batch: TrainBatch, *, reference: bool = False,
                         with_entropy: bool = True, watch_routing: bool = False,
                         record_routing: bool = False) -> dict[str, torch.Tensor]:
        """Per-token logprobs (and entropy) of the batch's targets: [N, L-1] on every rank for a
        whole batch, the shard's rows for a shard. `watch_routing` (an MoE batch with the
        engines' routes): also "routing", per row (decisions where the model's own top-k
        differs from the engine's, decisions), over every layer and fed token.
        `record_routing` (MoE): also "routes", the experts this pass routed every fed token
        to, [N, L-1, layers, k] as `TrainBatch.routed_experts` (routing_replay=recompute)."""
        if reference and not self.has_reference:
            raise RuntimeError("no reference model: the algorithm uses no KL loss")
        base_only = reference and self.reference is None  # LoRA: the actor without its adapters
        chunks = self.model if base_only or not reference else self.reference
        shard = self._shard(batch)
        logprobs, entropy = {}, {}

        def keep(mb, logits):
            if with_entropy:
                lp, ent = token_logprobs_and_entropy(logits, mb["targets"], batch.temperature)
            else:
                lp, ent = token_logprobs(logits, mb["targets"], batch.temperature), None
            for k, i in enumerate(mb["index"].tolist()):
                logprobs[i] = lp[k].detach().cpu()
                if ent is not None:
                    entropy[i] = ent[k].detach().cpu()
            return lp.sum() * 0.0, {}

        for chunk in chunks:
            chunk.eval()
        watch = RoutingWatch(shard.size) if watch_routing else None
        record = (RoutingRecord(shard.size, shard.tokens.shape[1] - 1, self.hf["num_hidden_layers"],
                                self.hf["num_experts_per_tok"]) if record_routing else None)
        with (torch.no_grad(), adapters_off(self.chunks) if base_only else contextlib.nullcontext(),
              on_every_router(chunks, watch) if watch else contextlib.nullcontext(),
              on_every_router(chunks, record) if record else contextlib.nullcontext()):
            if micro := self._forward_micro_batches(shard):
                run_schedule(chunks, micro, keep, forward_only=True)
        out = {"logprobs": self._gather_per_token(logprobs, shard, batch)}
        if watch_routing:
            out["routing"] = self._over_routing_ranks(watch.counts, shard, batch)
        if record_routing:
            out["routes"] = finished_routes(self._over_routing_ranks(record.routes, shard, batch),
                                            self._over_routing_ranks(record.written, shard, batch),
                                            num_experts(self.hf))
        if with_entropy:
            out["entropy"] = self._gather_per_token(entropy, shard, batch)
        return out

    # --- the update -----------------------------------------------------------------------

    def _count(self, response_mask: torch.Tensor) -> float:
        """What the loss is normalised by: response tokens, or sequences for seq-mean modes."""
        if self.algorithm.loss_agg_mode == "token-mean":
            return float(response_mask.sum())
        return float((response_mask.sum(-1) > 0).sum())

    def _global_count(self, response_mask: torch.Tensor) -> float:
        """`_count` over every DP rank's part of a mini-batch."""
        from megatron.core import parallel_state as ps

        count = torch.tensor([self._count(response_mask)], dtype=torch.float64)
        if self.dp_size > 1:
            all_reduce(count, ps.get_data_parallel_group())
        return float(count)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """PPO-style epochs over mini-batches; one optimizer step per mini-batch. The
        mini-batches are drawn from the whole batch (the same on every rank); each rank
        trains on the samples of its shard in them."""
        shard = self._shard(batch)
        self._prepare_update(shard)
        rng = np.random.default_rng(self.config.seed + self.step)
        whole = shard.whole_batch_size()
        steps = []
        for _ in range(self.config.ppo_epochs):
            order = rng.permutation(whole) if self.config.shuffle else np.arange(whole)
            for mini in np.array_split(order, self.config.num_mini_batches):
                steps.append(self._train_step(shard, {int(i) for i in mini}))
        self.step += 1
        metrics = {k: float(np.mean([s[k] for s in steps])) for k in steps[0]}
        metrics[f"{type(self).__name__.lower()}/steps"] = float(len(steps))
        return metrics

    def _prepare_update(self, batch: TrainBatch) -> None:
        if batch.advantages is None:
            raise ValueError("update needs batch.advantages")
        if self.has_reference and batch.ref_logprobs is None:
            batch.ref_logprobs = self.compute_logprobs(batch, reference=True, with_entropy=False)["logprobs"]
        if batch.old_logprobs is None and (self.config.ppo_epochs > 1 or self.config.num_mini_batches > 1):
            raise ValueError("several epochs or mini-batches need batch.old_logprobs (compute_logprobs first)")

    def _loss(self, batch: TrainBatch, mb: dict, logits: torch.Tensor, denominator: float):
        """The policy loss of one micro-batch, normalised by the mini-batch's global count."""
        logprobs, entropy = token_logprobs_and_entropy(logits, mb["targets"], batch.temperature)
        old = mb["old_logprobs"] if "old_logprobs" in mb else logprobs.detach()  # on-policy: ratio 1
        loss, metrics = actor_loss(
            self.algorithm, logprobs, old, mb["advantages"], mb["response_mask"],
            ref_logprobs=mb.get("ref_logprobs"), entropy=entropy,
            rollout_logprobs=mb.get("rollout_logprobs") if self.algorithm.corrects_rollout else None,
            global_denominator=denominator,
        )
        return loss, {k if "/" in k else f"actor/{k}": float(v) for k, v in metrics.items()}

    def _train_step(self, batch: TrainBatch, mini: set[int]) -> dict[str, float]:
        """One optimizer step on the mini-batch `mini` (positions in the whole batch);
        `batch` is this rank's shard."""
        indices = [k for k, i in enumerate(batch.positions().tolist()) if i in mini]
        denominator = self._global_count(batch.response_mask[indices])
        if indices:
            micro = self._micro_batches(
                batch, indices, advantages=batch.advantages, old_logprobs=batch.old_logprobs,
                ref_logprobs=batch.ref_logprobs, rollout_logprobs=batch.rollout_logprobs,
            )
        else:  # this DP rank has no sample in this mini-batch: still join the reductions
            idle = batch if batch.size else _IDLE_BATCH
            micro = [dict(mb, idle=torch.tensor(True)) for mb in self._micro_batches(idle, [0])]
        micro = self._same_count_as_peers(micro)
        # Megatron divides each micro-batch loss by their number and DDP averages over DP;
        # the loss is normalised by the global count instead, so undo both.
        scale = len(micro) * self.dp_size
        collected: list[dict] = []

        def loss_fn(mb, out):
            if "idle" in mb:
                return out.sum() * 0.0, {}
            loss, metrics = self._loss(batch, mb, out, denominator)
            local = self._count(mb["response_mask"])
            # Loss terms are this micro-batch's share of the global mean; make them its
            # own mean, so the weighted average below is the global value again.
            for key in metrics:
                if key.rsplit("/", 1)[-1] in GLOBALLY_NORMALISED:
                    metrics[key] *= denominator / max(local, 1.0)
            collected.append((metrics, local))
            return loss * scale, {}

        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        run_schedule(self.model, micro, loss_fn)
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        prefix = type(self).__name__.lower()
        metrics = self._mean_over_ranks(collected)
        metrics[f"{prefix}/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics[f"{prefix}/lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics[f"{prefix}/update_ok"] = float(bool(ok))
        return metrics

    def _mean_over_ranks(self, collected: list[tuple[dict, float]]) -> dict[str, float]:
        """Metrics are computed on last-stage ranks: their micro-batches' values averaged
        with each micro-batch's weight (tokens or sequences), over DP ranks too, and shared
        with every rank."""
        from megatron.core import parallel_state as ps

        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, collected if ps.is_pipeline_last_stage(ignore_virtual=True) else [],
                               group=control_group())
        entries = [e for rank_entries in gathered for e in rank_entries]
        total = sum(w for _, w in entries) or 1.0
        keys = entries[0][0].keys() if entries else []
        return {k: float(sum(m[k] * w for m, w in entries) / total) for k in keys}

    # --- weights out ----------------------------------------------------------------------

    def lora_adapter(self) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """The adapters as a PEFT adapter (adapter_config.json's dict, its tensors) on global
        rank 0, None on the others; every rank calls it (the adapters are gathered whole)."""
        adapters = whole_adapters(self.chunks, self.hf)
        if adapters is None:
            return None
        tensors = peft_tensors(self.hf, adapters)
        return peft_config(self.hf, self.lora, str(self.model_dir.resolve())), tensors

    def named_hf_weights(self, out=None):
        """(hf_name, full tensor) on each pipeline stage's source rank; every rank iterates.
        `out(hf_name, shape, dtype)`: memory for the tensors the export rebuilds (bridge)."""
        yield from export_hf_weights(self.chunks, self.hf, out)

    # --- checkpoints (training/actor_checkpoint.py) -------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write a checkpoint atomically (temporary dir, renamed when every rank is done);
        keep the last `keep_checkpoints` siblings."""
        return save_checkpoint(self, directory)

    def load(self, directory: str | Path) -> None:
        """Restore model, optimizer, scheduler and step; RNG too when the layout is the same."""
        load_checkpoint(self, directory)


def _count_once(chunks: list) -> tuple[int, int]:
    """(trainable, all) parameters of the whole model (every stage and shard, each once), on every rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    count = torch.zeros(2, dtype=torch.float64)
    for chunk in chunks:
        for p in chunk.parameters():
            if getattr(p, "shared", False):
                continue  # a tied output layer is the embedding's copy
            expert = not getattr(p, "allreduce", True)
            dp_rank = ps.get_expert_data_parallel_rank() if expert else ps.get_data_parallel_rank()
            if dp_rank == 0 and param_is_not_tensor_parallel_duplicate(p):
                count += torch.tensor([p.numel() if p.requires_grad else 0, p.numel()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count, group=control_group())
    return int(count[0]), int(count[1])


# What a rank with no sample runs to join its peers' collectives.
_IDLE_BATCH = TrainBatch(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 1))
