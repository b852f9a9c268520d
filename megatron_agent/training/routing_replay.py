"""Routing replay for MoE (`algorithm.routing_replay`): `rollout` (R3) routes every forward
of a sample as the rollout engine routed it; `recompute` (R2) routes the updates as the
old-logprob pass did.

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

`RoutingWatch` counts, per sample, the decisions where the trainer's own top-k differs from
the engine's, replayed or not (a model built without replay takes the routes only for it);
`RoutingRecord` writes down the experts a pass routed each token to (R2's routes).
"""

from __future__ import annotations

import contextlib

import torch


def routers(chunk, replaying: bool = False) -> dict[int, object]:
    """This chunk's TopKRouters (with `replaying`, those that can replay) by global 0-based layer."""
    from megatron.core.transformer.moe.router import TopKRouter

    return {router.layer_number - 1: router for router in chunk.modules()
            if isinstance(router, TopKRouter) and (router.router_replay is not None or not replaying)}


def replaying_routers(chunk) -> dict[int, object]:
    return routers(chunk, replaying=True)


def pad_routes(routes: torch.Tensor, width: int) -> torch.Tensor:
    """[b, s, layers, k] -> [b, width, layers, k]: the padded columns get experts 0..k-1
    (distinct, as a top-k must be; padding reaches no loss)."""
    b, s, layers, k = routes.shape
    if width <= s:
        return routes
    filler = torch.arange(k, dtype=routes.dtype, device=routes.device).expand(b, width - s, layers, k)
    return torch.cat([routes, filler], dim=1)


def in_router_order(grid: torch.Tensor, *, tp_rank: int = 0, tp_size: int = 1,
                    sequence_parallel: bool = False) -> torch.Tensor:
    """A [b, s, ...] grid in a router's token order, [tokens, ...]: its input is [s, b, h]
    flattened s-major, and under sequence parallelism TP rank r holds the contiguous s-block r
    of s / tp_size."""
    grid = grid.transpose(0, 1)  # [s, b, ...]
    if sequence_parallel and tp_size > 1:
        block = grid.shape[0] // tp_size
        grid = grid[tp_rank * block:(tp_rank + 1) * block]
    return grid.reshape(-1, *grid.shape[2:])


def router_ids(routes: torch.Tensor, layer: int, *, tp_rank: int = 0, tp_size: int = 1,
               sequence_parallel: bool = False) -> torch.Tensor:
    """The int64 [tokens, k] a router of layer `layer` routes, from [b, s, layers, k] ids."""
    return in_router_order(routes[:, :, layer, :], tp_rank=tp_rank, tp_size=tp_size,
                           sequence_parallel=sequence_parallel).long()


def arm(chunk, routes: torch.Tensor | None, rows: torch.Tensor | None = None) -> None:
    """Before a micro-batch's forward. A model built for replay routes by `routes` ([b, s,
    layers, k] ids; REPLAY_FORWARD), or naturally without them (what is queued for backward
    stays). Every router also keeps, in its token order, its layer's ids and each token's
    place (`rows` [b, s]: the token's shard row, -1 where no token was fed; and its column)
    for a `RoutingWatch` or a `RoutingRecord`."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    from megatron.core.utils import get_model_config

    config = get_model_config(chunk)
    if config.num_moe_experts is None:
        if routes is not None:
            raise ValueError("routed_experts given to a model without experts")
        return
    order = dict(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                 sequence_parallel=config.sequence_parallel)
    places = (None, None)
    if rows is not None:
        rows = rows.cpu()
        columns = torch.arange(rows.shape[1]).expand_as(rows)
        places = (in_router_order(rows, **order), in_router_order(columns, **order))
    for layer, router in routers(chunk).items():
        ids = None
        if routes is not None:
            if layer >= routes.shape[2]:
                raise ValueError(f"routes for {routes.shape[2]} layers, the model routes layer {layer}")
            ids = router_ids(routes, layer, **order)
        router.routed_tokens = (ids, *places)
        if router.router_replay is None:
            continue
        if ids is None:
            router.router_replay.clear_router_replay_action()
        else:
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
        for router in routers(chunk).values():
            router.routed_tokens = None
            if router.router_replay is not None:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()


@contextlib.contextmanager
def on_every_router(chunks, hook):
    """`hook(router, inputs, output)` after every router forward of `chunks`, within the block."""
    handles = [router.register_forward_hook(hook) for chunk in chunks for router in routers(chunk).values()]
    try:
        yield hook
    finally:
        for handle in handles:
            handle.remove()


class RoutingWatch:
    """Called after each router forward (`on_every_router`): compares the router's own top-k
    (by its weights) with the engine's ids of every fed token it routes, `counts[row]` =
    (decisions that differ, decisions) per shard row, over this rank's layers and tokens. A
    router that replays must have routed exactly by the engine's ids: otherwise RuntimeError."""

    def __init__(self, rows: int):
        self.counts = torch.zeros(rows, 2, dtype=torch.float64)

    @torch.no_grad()
    def __call__(self, router, inputs, output) -> None:
        engine, rows, _ = getattr(router, "routed_tokens", None) or (None, None, None)
        if engine is None or rows is None:
            return
        fed = rows >= 0
        engine = engine.to(output[1].device)
        own = router.gating(inputs[0]).reshape(-1, router.config.num_moe_experts).topk(engine.shape[1]).indices
        differ = (own.sort(-1).values != engine.sort(-1).values).any(-1).cpu()
        self.counts.index_add_(0, rows[fed], torch.stack([differ[fed].double(), torch.ones(int(fed.sum()),
                                                          dtype=torch.float64)], dim=1))
        if router.router_replay is not None:
            used = torch.zeros_like(output[1]).scatter(1, engine, True)
            otherwise = int(((used != output[1]).any(-1).cpu() & fed).sum())
            if otherwise:
                raise RuntimeError(f"layer {router.layer_number}: {otherwise} replayed decisions did not follow "
                                   "the engine's experts")


class RoutingRecord:
    """Called after each router forward (`on_every_router`): writes the experts the router
    sent every fed token to into `routes` [rows, columns, layers, k] int32 and marks the place
    in `written` (this rank's tokens and layers: sum both over the ranks that hold the others,
    then `finished_routes`)."""

    def __init__(self, rows: int, columns: int, layers: int, k: int):
        self.routes = torch.zeros(rows, columns, layers, k, dtype=torch.int32)
        self.written = torch.zeros(rows, columns, layers, dtype=torch.int32)

    @torch.no_grad()
    def __call__(self, router, _inputs, output) -> None:
        _, rows, columns = getattr(router, "routed_tokens", None) or (None, None, None)
        if rows is None:
            return
        fed = rows >= 0
        k = self.routes.shape[-1]
        ids = output[1].float().topk(k, dim=-1).indices.cpu()  # the k experts of each token's routing map
        layer = router.layer_number - 1
        self.routes[rows[fed], columns[fed], layer] = ids[fed].int()
        self.written[rows[fed], columns[fed], layer] = 1


def finished_routes(routes: torch.Tensor, written: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Recorded routes with every unwritten place routed to experts 0..k-1, in the batch's
    dtype (uint8 up to 256 experts, else int16)."""
    k = routes.shape[-1]
    routes = torch.where(written[..., None] > 0, routes, torch.arange(k, dtype=routes.dtype))
    return routes.to(torch.uint8 if num_experts <= 256 else torch.int16)
