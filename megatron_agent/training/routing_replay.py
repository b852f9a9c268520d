"""Routing replay for MoE (`algorithm.routing_replay: rollout`): every forward of a sample
routes each token to the experts the rollout engine routed it to.

The engine and the trainer route some tokens to different experts (other kernels, bf16/FP8
rounding, batch composition), so without replay the trainer's logprobs are those of another
network than the one that sampled. The engine returns, per token it fed through the model
(the prompt and every response token but the last), each layer's top-k expert ids; a sample
carries them on the batch's per-token grid, `routed_experts [N, L-1, layers, k]` (row t: the
routing of input token t; `layers` counts every decoder layer, a dense layer's row unused).

Megatron-Core 0.16.1 replays given routing (`TopKRouter.router_replay`, built when
`moe_enable_routing_replay`): in REPLAY_FORWARD its top-k returns the target ids and gathers
their scores, so the router's weights still get gradients through the replayed experts.
Each target set is also queued for REPLAY_BACKWARD, which activation recomputation in
backward pops in order. Routers are found per model chunk by their global `layer_number`,
never through `RouterReplay`'s class-wide list (every model built in the process adds to it).

    arm(chunk, routes)      # before a micro-batch's forward: [b, s, layers, k] ids (None: natural)
    forward_done(chunk)     # after it: recomputation in backward pops the queue
    disarm(chunks)          # after the schedule: natural routing again
"""

from __future__ import annotations

import torch


def replaying_routers(chunk) -> dict[int, object]:
    """This chunk's TopKRouters that can replay, by global 0-based layer index."""
    from megatron.core.transformer.moe.router import TopKRouter

    return {router.layer_number - 1: router for router in chunk.modules()
            if isinstance(router, TopKRouter) and router.router_replay is not None}


def pad_routes(routes: torch.Tensor, width: int) -> torch.Tensor:
    """[b, s, layers, k] -> [b, width, layers, k]: the padded columns get experts 0..k-1
    (distinct, as a top-k must be; padding reaches no loss)."""
    b, s, layers, k = routes.shape
    if width <= s:
        return routes
    filler = torch.arange(k, dtype=routes.dtype, device=routes.device).expand(b, width - s, layers, k)
    return torch.cat([routes, filler], dim=1)


def router_ids(routes: torch.Tensor, layer: int, *, tp_rank: int = 0, tp_size: int = 1,
               sequence_parallel: bool = False) -> torch.Tensor:
    """The int64 [tokens, k] a router of layer `layer` routes, from [b, s, layers, k] ids, in
    the router's token order: its input is [s, b, h] flattened s-major, and under sequence
    parallelism TP rank r holds the contiguous s-block r of s / tp_size."""
    ids = routes[:, :, layer, :].transpose(0, 1)  # [s, b, k]
    if sequence_parallel and tp_size > 1:
        block = ids.shape[0] // tp_size
        ids = ids[tp_rank * block:(tp_rank + 1) * block]
    return ids.reshape(-1, ids.shape[-1]).long()


def arm(chunk, routes: torch.Tensor | None) -> None:
    """Set this micro-batch's target ids on every replaying router of `chunk` (REPLAY_FORWARD);
    with no routes, route naturally (what is queued for backward stays)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    from megatron.core.utils import get_model_config

    config = get_model_config(chunk)
    if not config.moe_enable_routing_replay:
        if routes is not None:
            raise ValueError("routed_experts given to a model built without routing replay "
                             "(algorithm.routing_replay)")
        return
    routers = replaying_routers(chunk)
    if routes is None:
        for router in routers.values():
            router.router_replay.clear_router_replay_action()
        return
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for layer, router in routers.items():
        if layer >= routes.shape[2]:
            raise ValueError(f"routes for {routes.shape[2]} layers, the model routes layer {layer}")
        ids = router_ids(routes, layer, tp_rank=tp_rank, tp_size=tp_size,
                         sequence_parallel=config.sequence_parallel)
        router.router_replay.set_target_indices(ids)
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def forward_done(chunk) -> None:
    """After a micro-batch's forward: its ids wait, queued, for recomputation in backward."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for router in replaying_routers(chunk).values():
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)


def disarm(chunks) -> None:
    """Natural routing again, nothing queued."""
    for chunk in chunks:
        for router in replaying_routers(chunk).values():
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
