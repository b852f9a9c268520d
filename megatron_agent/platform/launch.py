"""Run a function on N local ranks (spawned processes, gloo) and gather what each returns.

Used by the multi-rank tests and by single-machine CPU jobs. Each rank gets the
torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so the
function calls `platform.init_distributed` as it would under torchrun.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from megatron_agent.platform.distributed import die_with_parent, free_port


class RankFailed(RuntimeError):
    """A spawned rank raised, died, or did not finish in time."""


def _rank_main(rank, world_size, port, threads, fn, args, kwargs, results):
    die_with_parent(multiprocessing.parent_process().pid)  # a killed launcher leaves no rank behind
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    try:
        out = fn(*args, **kwargs)
        # Serialised to bytes: a tensor sent through the queue as shared memory would
        # need this process alive while the parent unpickles it.
        buffer = io.BytesIO()
        torch.save(out, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    timeout_s: float = 300.0,
    threads_per_rank: int | None = None,
    **kwargs,
) -> list[Any]:
    """Call `fn(*args, **kwargs)` on `world_size` spawned ranks; return results by rank.

    `fn` must be importable (a module-level function). A failure on any rank raises
    RankFailed with that rank's traceback, after the other ranks are stopped. The
    rendezvous port is free when picked but may be taken before rank 0 binds it (another
    process on the machine): that failure, and only it, is retried on a fresh port.
    """
    for attempt in range(_PORT_RETRIES):
        try:
            return _launch(fn, world_size, args, kwargs, timeout_s, threads_per_rank)
        except RankFailed as err:
            if _PORT_TAKEN not in str(err) or attempt == _PORT_RETRIES - 1:
                raise
    raise AssertionError("unreachable")


_PORT_RETRIES = 3
_PORT_TAKEN = "EADDRINUSE"  # torch's DistNetworkError when the rendezvous store cannot bind


def _launch(fn, world_size: int, args, kwargs, timeout_s: float, threads_per_rank: int | None) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, threads, fn, args, kwargs, results),
                    daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    gathered: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(gathered) < world_size:
            try:
                rank, ok, out = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in gathered]
                if dead and results.empty():
                    codes = {r: procs[r].exitcode for r in dead}
                    raise RankFailed(f"rank(s) {dead} exited without a result (exit codes {codes})") from None
                if time.monotonic() > deadline:
                    raise RankFailed(
                        f"ranks {sorted(set(range(world_size)) - set(gathered))} did not finish "
                        f"within {timeout_s:.0f} s"
                    ) from None
                continue
            if not ok:
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{out}")
            gathered[rank] = torch.load(io.BytesIO(out), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10 if len(gathered) == world_size else 0.1)
            if p.is_alive():
                _kill_tree(p.pid)
                p.join()
    return [gathered[r] for r in range(world_size)]


def _kill_tree(pid: int) -> None:
    """Kill a rank and what it started (dist_checkpointing starts writer processes)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        for child in proc.children(recursive=True):
            child.kill()
        proc.kill()
    except psutil.NoSuchProcess:
        pass
