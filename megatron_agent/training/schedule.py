"""Megatron's forward/backward schedules over a list of micro-batches.

`run_schedule` is the one entry for every pass the trainer makes (logprob recompute,
policy update, language-model steps): it picks Megatron's schedule for the layout (no
pipelining, 1F1B, interleaved), feeds every model chunk the same micro-batches, and
returns what the loss function reported for each micro-batch on the last stage.

Sequence lengths are padded here, on the way into the model, to what the layout needs
(`batch.sequence_multiple`: TP with sequence parallelism, FP8, CP); the model's output
is cut back to the micro-batch's own width before the loss function sees it, so losses,
logprobs, metrics and token counts are those of the unpadded micro-batch.

A micro-batch with "routed_experts" ([b, s, layers, k], the rollout engine's expert ids)
is routed by them in every MoE layer (training/routing_replay.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from megatron_agent.training import routing_replay
from megatron_agent.training.batch import padded_length, sequence_multiple

MicroBatch = dict[str, torch.Tensor]
# What a vision-language model's first stage takes besides the ids (models/vision_inputs.py).
VISION_INPUTS = ("pixel_values", "image_grid_thw", "image_mask")
# loss_fn(micro_batch, output) -> (loss, metrics). `output` is what the last stage's
# GPTModel returns: per-token cross entropy [b, s] when the micro-batch has "labels".
LossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict]]


def wrap_with_ddp(chunks: list, *, use_distributed_optimizer: bool = False, grad_reduce_in_fp32: bool = True):
    """Megatron DDP around each model chunk (gradient buffers, DP/EDP reductions)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return [
        DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def attach_grad_finalization(chunks: list) -> None:
    """Have the schedules reduce gradients over DP (and tied embeddings over PP) at the end."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    config.finalize_model_grads_func = finalize_model_grads
    if hasattr(chunks[0], "no_sync"):
        config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync


def language_model_loss(micro_batch: MicroBatch, token_losses: torch.Tensor):
    """Token-mean cross entropy over `loss_mask` (the plain LM objective)."""
    mask = micro_batch["loss_mask"].to(token_losses.dtype)
    loss = (token_losses * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"loss": loss.detach().clone()}


def layout_multiple(chunks: list) -> int:
    """The sequence multiple (`batch.sequence_multiple`) of the model's layout and FP8 recipe."""
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    return sequence_multiple(tp=config.tensor_model_parallel_size, sequence_parallel=config.sequence_parallel,
                             fp8=config.fp8 is not None,
                             fp8_recipe=config.fp8_recipe,
                             cp=config.context_parallel_size)


def pad_model_inputs(micro_batch: MicroBatch, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """input_ids, position_ids and labels right-padded to `width` columns: token 0, and
    positions that keep counting. The padded columns come after every real one, so under
    the causal mask no real position attends to them. Positions are [b, s], or [3, b, s]
    for multimodal RoPE."""
    input_ids, positions, labels = micro_batch["input_ids"], micro_batch["position_ids"], micro_batch.get("labels")
    extra = width - input_ids.shape[1]
    if extra <= 0:
        return input_ids, positions, labels
    pad = partial(torch.nn.functional.pad, pad=(0, extra))
    more = positions[..., -1:] + torch.arange(1, extra + 1, device=positions.device)
    return (pad(input_ids, value=0), torch.cat([positions, more], dim=-1),
            None if labels is None else pad(labels, value=0))


def _forward_step(loss_fn: LossFn, multiple: int, data_iterator, model):
    from megatron.core.utils import get_attr_wrapped_model

    micro_batch = next(data_iterator)
    if not get_attr_wrapped_model(model, "pre_process"):  # only the first stage encodes images
        micro_batch = {k: v for k, v in micro_batch.items() if k not in VISION_INPUTS}
    device = next(model.parameters()).device
    micro_batch = {k: v.to(device, non_blocking=True) for k, v in micro_batch.items()}
    columns = micro_batch["input_ids"].shape[1]
    width = padded_length(columns, multiple)
    input_ids, positions, labels = pad_model_inputs(micro_batch, width)
    images = {k: micro_batch[k] for k in VISION_INPUTS if k in micro_batch}
    if "image_mask" in images:  # the padding columns are text
        images["image_mask"] = torch.nn.functional.pad(images["image_mask"], (0, width - columns), value=False)
    routes, rows = micro_batch.get("routed_experts"), micro_batch.get("route_rows")
    if routes is not None:
        routes = routing_replay.pad_routes(routes, width)
    if rows is not None:
        rows = torch.nn.functional.pad(rows, (0, width - columns), value=-1)
    routing_replay.arm(model, routes, rows)
    output = model(input_ids, positions, attention_mask=None, labels=labels, **images)
    if routes is not None:
        routing_replay.forward_done(model)

    def loss(output_tensor):
        # Last stage only: [b, s_padded, ...] back to the micro-batch's own columns, so
        # the padding reaches no loss, logprob, entropy, metric or token count.
        return loss_fn(micro_batch, output_tensor[:, :columns])

    return output, loss


def run_schedule(
    chunks: list,
    micro_batches: Sequence[MicroBatch],
    loss_fn: LossFn = language_model_loss,
    *,
    forward_only: bool = False,
) -> list[dict]:
    """Forward (and backward unless forward_only) every micro-batch through the chunks.

    Gradients accumulate in the chunks (the loss of each micro-batch is divided by
    their number, so the result is the mean). Returns the loss function's metrics per
    micro-batch on the last pipeline stage, an empty list elsewhere.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("run_schedule needs at least one micro-batch")
    shape = micro_batches[0]["input_ids"].shape
    multiple = layout_multiple(chunks)
    data = [iter(micro_batches) for _ in chunks]
    try:
        return get_forward_backward_func()(
            forward_step_func=partial(_forward_step, loss_fn, multiple),
            data_iterator=data if len(chunks) > 1 else data[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=max(padded_length(mb["input_ids"].shape[1], multiple) for mb in micro_batches),
            micro_batch_size=shape[0],
            forward_only=forward_only,
        )
    finally:
        if any("routed_experts" in mb or "route_rows" in mb for mb in micro_batches):
            routing_replay.disarm(chunks)


def language_model_micro_batch(tokens: torch.Tensor) -> MicroBatch:
    """Next-token prediction on a [b, s+1] block of token ids."""
    input_ids = tokens[:, :-1].contiguous()
    b, s = input_ids.shape
    return {
        "input_ids": input_ids,
        "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": torch.ones(b, s),
    }


def forward_logits(chunks: list, input_ids: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor | None:
    """Full-vocabulary logits [b, s, V] for a batch, on last-stage ranks (None elsewhere).

    One micro-batch per sequence (the interleaved schedule needs at least pp of them).
    TP shards of the vocabulary are gathered; padded vocabulary rows are dropped when
    `vocab_size` is given.
    """
    s = input_ids.shape[1]
    positions = torch.arange(s).unsqueeze(0)
    micro_batches = [{"input_ids": row.unsqueeze(0), "position_ids": positions} for row in input_ids]
    return micro_batch_logits(chunks, micro_batches, vocab_size)


def micro_batch_logits(chunks: list, micro_batches: Sequence[MicroBatch], vocab_size: int | None = None):
    """`forward_logits` over given micro-batches (e.g. a VLM's, with their images and
    MRoPE positions), concatenated over the batch dimension."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    captured = []

    def keep_logits(_mb, logits):
        captured.append(gather_from_tensor_model_parallel_region(logits))
        return logits.sum() * 0.0, {}

    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        run_schedule(chunks, micro_batches, keep_logits, forward_only=True)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    logits = torch.cat(captured)
    return logits[..., :vocab_size] if vocab_size else logits
