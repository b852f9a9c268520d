"""The embedded engine as N weight-update ranks (`--ranks N`), as an SGLang server with
tensor parallelism joins the weight-update group with one rank per TP rank.

Design: N full replicas, one per rank. Rank 0 is the serving process's own `Engine`;
ranks 1..N-1 are spawned processes, each running its own `Engine` and taking commands
over a pipe. Every rank joins the trainer's group itself, at `rank_offset + r`, and
receives every broadcast itself (per tensor and flattened bucket), so the group's world
size is 1 + the sum of all servers' ranks, as with SGLang. (Ranks in threads of one
process cannot be: torch registers process groups by name, once per process.)

Generation is data-parallel inside the engine: the prompts of every `generate` call are
dealt round-robin over the ranks (a global counter, so a batch of N prompts covers every
rank), each rank batches its share with its other requests, and the completions carry
the rank that served them. A rank that missed an update therefore shows in the outputs;
its checksums too: `weight_checksums` raises `RanksDisagree` when the ranks hold
different values. Results for a request and seed do not depend on the rank (same
weights, same code, per-request seeded sampling).

Control calls (pause, begin/end update, versions, loads) go to every rank; collective
ones (`init_group`, `update_from_distributed`) are started on ranks 1.. first and then
run on rank 0, since each blocks until every member takes part. When a rank process
dies, every pending and later call fails, and `on_rank_death` (the server: exit, as an
SGLang server does when a TP worker dies) is called.

Cost: N model copies and N - 1 more processes (torch, transformers and the model
loaded in each); a rank's threads are the server's `--threads`.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future

import torch

from rollout.embedded_engine import DEFAULT_GROUP, BadRequest, Completion, Engine, SamplingParams

log = logging.getLogger("rollout.engine_ranks")


class RanksDisagree(RuntimeError):
    """The ranks of one engine hold different weights (an update that did not land on all)."""


def _peer_main(conn, rank: int, model_path: str, dtype: str, max_batch_size: int, threads: int) -> None:
    """A rank process: its own Engine, serving the coordinator's calls (one thread each)."""
    torch.set_num_threads(threads)
    send_lock = threading.Lock()

    def reply(msg_id: int, ok: bool, payload) -> None:
        with send_lock:
            conn.send((msg_id, ok, payload))

    try:
        engine = Engine(model_path, dtype=dtype, max_batch_size=max_batch_size)
    except Exception:
        reply(0, False, RuntimeError(f"engine rank {rank} did not start:\n{traceback.format_exc()}"))
        return
    reply(0, True, None)

    def run(msg_id: int, method: str, args: tuple, kwargs: dict) -> None:
        try:
            reply(msg_id, True, getattr(engine, method)(*args, **kwargs))
        except BadRequest as err:
            reply(msg_id, False, err)
        except Exception:
            reply(msg_id, False, RuntimeError(f"engine rank {rank}: {traceback.format_exc()}"))

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the serving process is gone
            os._exit(0)
        if msg is None:
            os._exit(0)
        threading.Thread(target=run, args=msg, daemon=True).start()


class _Peer:
    """The coordinator's handle on one rank process: `call` returns a Future."""

    def __init__(self, rank: int, model_path: str, dtype: str, max_batch_size: int, threads: int,
                 on_death: Callable[[str], None] | None):
        ctx = mp.get_context("spawn")
        self.rank = rank
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, rank, model_path, dtype, max_batch_size, threads),
                                name=f"engine-rank-{rank}", daemon=True)
        self.proc.start()
        child.close()
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.ready: Future = Future()
        self.pending: dict[int, Future] = {0: self.ready}
        self.dead: str | None = None
        self.closing = False
        self.on_death = on_death
        threading.Thread(target=self._read, name=f"engine-rank-{rank}-reader", daemon=True).start()

    def call(self, method: str, *args, **kwargs) -> Future:
        fut: Future = Future()
        with self.lock:
            if self.dead is not None:
                raise RuntimeError(self.dead)
            msg_id = next(self.ids)
            self.pending[msg_id] = fut
            self.conn.send((msg_id, method, args, kwargs))
        return fut

    def _read(self) -> None:
        try:
            while True:
                msg_id, ok, payload = self.conn.recv()
                with self.lock:
                    fut = self.pending.pop(msg_id)
                fut.set_result(payload) if ok else fut.set_exception(payload)
        except (EOFError, OSError):
            pass
        self.proc.join(5)
        with self.lock:
            self.dead = f"engine rank {self.rank} exited (exit code {self.proc.exitcode})"
            pending, self.pending = list(self.pending.values()), {}
        for fut in pending:
            if not fut.done():
                fut.set_exception(RuntimeError(self.dead))
        if not self.closing:
            log.error("%s", self.dead)
            if self.on_death is not None:
                self.on_death(self.dead)

    def close(self, timeout_s: float = 10.0) -> None:
        self.closing = True
        try:
            with self.lock:
                self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _gather(futures) -> list:
    """Every future's result, in order; the first failure raised after all have ended."""
    results, error = [], None
    for fut in futures:
        try:
            results.append(fut.result())
        except Exception as err:
            error = error or err
            results.append(None)
    if error is not None:
        raise error
    return results


class RankedEngine(Engine):
    """An `Engine` whose weights live on `ranks` replicas (rank 0 here, the others in
    processes of their own); same typed methods, fanned out to every rank."""

    def __init__(self, model_path: str, *, ranks: int, dtype: str = "float32", max_batch_size: int = 256,
                 threads: int | None = None, on_rank_death: Callable[[str], None] | None = None):
        if ranks < 1:
            raise ValueError(f"ranks={ranks}; need at least 1")
        threads = threads or torch.get_num_threads()
        self.peers = [_Peer(r, model_path, dtype, max_batch_size, threads, on_rank_death) for r in range(1, ranks)]
        try:  # rank 0 loads while the others do
            super().__init__(model_path, dtype=dtype, max_batch_size=max_batch_size)
            _gather([p.ready for p in self.peers])
        except BaseException:
            self.close()
            raise
        self.ranks = ranks
        self._dealt = 0
        self._deal_lock = threading.Lock()

    def close(self) -> None:
        """Stop the rank processes (the engine is unusable afterwards)."""
        for p in self.peers:
            p.close()

    def _everywhere(self, method: str, *args, **kwargs) -> list:
        """Call `method` on ranks 1.. (started first), then on rank 0; every rank's result."""
        futures = [p.call(method, *args, **kwargs) for p in self.peers]
        local: Future = Future()
        try:
            local.set_result(getattr(super(), method)(*args, **kwargs))
        except Exception as err:
            local.set_exception(err)
        return _gather([local, *futures])

    # -- generation --------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: list[SamplingParams], rids: list[str],
                 images: list | None = None, routed_experts: bool = False,
                 adapters: list[str | None] | None = None) -> list[Completion]:
        """Deal the prompts round-robin over the ranks; each completion names its rank."""
        images = images if images is not None else [None] * len(prompts)
        adapters = adapters if adapters is not None else [None] * len(prompts)
        if not (len(params) == len(rids) == len(prompts) == len(images) == len(adapters)):
            raise BadRequest("input_ids, sampling_params, rid, image_data and lora_path differ in length")
        with self._deal_lock:
            first, self._dealt = self._dealt, self._dealt + len(prompts)
        shares = [[i for i in range(len(prompts)) if (first + i) % self.ranks == r] for r in range(self.ranks)]

        def part(values, r):
            return [values[i] for i in shares[r]]

        futures = {r: self.peers[r - 1].call("generate", part(prompts, r), part(params, r), part(rids, r),
                                             part(images, r), routed_experts, part(adapters, r))
                   for r in range(1, self.ranks) if shares[r]}
        local: Future = Future()
        try:
            local.set_result(super().generate(part(prompts, 0), part(params, 0), part(rids, 0), part(images, 0),
                                              routed_experts, part(adapters, 0)) if shares[0] else [])
        except Exception as err:
            local.set_exception(err)
        ranks = [0, *futures]
        done = _gather([local, *futures.values()])
        results: list[Completion | None] = [None] * len(prompts)
        for r, completions in zip(ranks, done):
            for i, c in zip(shares[r], completions):
                c.rank = r
                results[i] = c
        return results

    def health_generate(self) -> None:
        self._everywhere("health_generate")

    # -- control -----------------------------------------------------------------------
    def pause(self, mode: str) -> None:
        self._everywhere("pause", mode)

    def resume(self) -> None:
        self._everywhere("resume")

    # -- weights -----------------------------------------------------------------------
    def begin_weight_update(self) -> None:
        self._everywhere("begin_weight_update")

    def end_weight_update(self) -> None:
        self._everywhere("end_weight_update")

    def set_weight_version(self, version: str) -> None:
        self._everywhere("set_weight_version", version)

    def init_group(self, master_address: str, master_port: int, world_size: int, *, rank_offset: int = 1,
                   group_name: str = DEFAULT_GROUP, backend: str = "nccl", timeout_s: float = 300.0) -> None:
        """Join the group as ranks rank_offset .. rank_offset + ranks - 1 (rank r of this
        engine at rank_offset + r), every rank itself."""
        if group_name in self.groups:
            raise BadRequest(f"group {group_name!r} exists; destroy it first")
        if rank_offset < 1 or rank_offset + self.ranks > world_size:
            raise BadRequest(f"this engine has {self.ranks} ranks: rank_offset={rank_offset} and "
                             f"world_size={world_size} leave no room for group ranks {rank_offset}.."
                             f"{rank_offset + self.ranks - 1} (count the engine's tp_size from /get_server_info)")
        kw = dict(group_name=group_name, backend=backend, timeout_s=timeout_s)
        futures = [p.call("init_group", master_address, master_port, world_size, rank_offset=rank_offset + p.rank, **kw)
                   for p in self.peers]
        local: Future = Future()
        try:
            super().init_group(master_address, master_port, world_size, rank_offset=rank_offset, **kw)
            local.set_result(None)
        except Exception as err:
            local.set_exception(err)
        _gather([local, *futures])

    def destroy_group(self, group_name: str = DEFAULT_GROUP) -> None:
        self._everywhere("destroy_group", group_name)

    def update_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                group_name: str = DEFAULT_GROUP, load_format: str | None = None,
                                weight_version: str | None = None) -> None:
        """Every rank receives the announced bucket by broadcast and loads it."""
        self._everywhere("update_from_distributed", names, dtypes, shapes, group_name=group_name,
                         load_format=load_format, weight_version=weight_version)

    def update_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        self._everywhere("update_from_disk", model_path, weight_version)

    def load_lora_adapter(self, name: str, path: str) -> None:
        self._everywhere("load_lora_adapter", name, path)

    def unload_lora_adapter(self, name: str) -> None:
        self._everywhere("unload_lora_adapter", name)

    def load_lora_adapter_from_tensors(self, name: str, config: dict, serialized_named_tensors: list[str],
                                       load_format: str | None = None) -> None:
        """Rank r loads entry r, as update_from_tensor."""
        if len(serialized_named_tensors) != self.ranks:
            raise BadRequest(f"serialized_named_tensors has {len(serialized_named_tensors)} entries; this engine "
                             f"has {self.ranks} ranks (count them from /get_server_info's tp_size)")
        futures = [p.call("load_lora_adapter_from_tensors", name, config, [serialized_named_tensors[p.rank]],
                          load_format) for p in self.peers]
        local: Future = Future()
        try:
            local.set_result(super().load_lora_adapter_from_tensors(name, config, serialized_named_tensors[:1],
                                                                    load_format))
        except Exception as err:
            local.set_exception(err)
        _gather([local, *futures])

    def update_from_tensor(self, serialized_named_tensors: list[str], *, load_format: str | None = None,
                           weight_version: str | None = None) -> None:
        """Rank r loads entry r (one per rank, as an SGLang TP rank does)."""
        if len(serialized_named_tensors) != self.ranks:
            raise BadRequest(f"serialized_named_tensors has {len(serialized_named_tensors)} entries; this engine "
                             f"has {self.ranks} ranks (count them from /get_server_info's tp_size)")
        kw = dict(load_format=load_format, weight_version=weight_version)
        futures = [p.call("update_from_tensor", [serialized_named_tensors[p.rank]], **kw) for p in self.peers]
        local: Future = Future()
        try:
            local.set_result(super().update_from_tensor(serialized_named_tensors[:1], **kw))
        except Exception as err:
            local.set_exception(err)
        _gather([local, *futures])

    def release_memory(self, tags: list[str] | None = None) -> None:
        self._everywhere("release_memory", tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._everywhere("resume_memory", tags)

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self._everywhere("load_weights", named)

    def rank_weight_checksums(self, names: list[str]) -> list[dict[str, float]]:
        """Each rank's `weight_checksums`, by rank."""
        return self._everywhere("weight_checksums", names)

    def weight_checksums(self, names: list[str]) -> dict[str, float]:
        """The checksums all ranks agree on; `RanksDisagree` when they do not."""
        per_rank = self.rank_weight_checksums(names)
        for r, sums in enumerate(per_rank[1:], start=1):
            wrong = [n for n in names if sums[n] != per_rank[0][n]]
            if wrong:
                raise RanksDisagree(f"rank {r} of this engine holds different weights than rank 0 for "
                                    f"{len(wrong)} tensor(s): {wrong[:5]}")
        return per_rank[0]


def rank_checksums(engine: Engine, names: list[str]) -> list[dict[str, float]]:
    """Every rank's checksums of `names` (one entry for a one-rank engine)."""
    if isinstance(engine, RankedEngine):
        return engine.rank_weight_checksums(names)
    return [engine.weight_checksums(names)]
