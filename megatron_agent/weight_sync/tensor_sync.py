"""The colocated weight path: the actor's weights handed to engines on the same machine
as tensor handles (`/update_weights_from_tensor`: shared memory on CPU, CUDA IPC on
GPU), instead of a broadcast over a weight-update group.

`TensorWeightSync` has `WeightSync`'s interface (`sync(version)`, `set_engines`, `close`)
and its order of calls: rank 0 pauses generation, flushes and opens the update; pipeline
stages take turns; in each, every rank iterates the bridge's export and the stage's
source rank (DP 0, TP 0) packs buckets of `bucket_bytes` into one buffer each and posts
its handles to every engine, one serialized copy per engine TP rank (the wire format:
rollout/weight_tensors.py, SGLang's); rank 0 closes the update, sets the version and
resumes generation. The engines copy the weights out before they answer, so a bucket's
buffer is freed when the next is packed.

It needs every engine on the machine of each stage's source rank (a handle names this
machine's shared memory or GPU memory): `placement.colocate` puts them there.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from megatron_agent.weight_sync import WeightSyncConfig, WeightSyncError

log = logging.getLogger(__name__)


class TensorWeightSync:
    def __init__(self, actor, engine_urls: list[str], config: WeightSyncConfig | None = None):
        from megatron.core import parallel_state as ps

        from megatron_agent.models.bridge import is_export_source
        from megatron_agent.platform import control_group

        self.actor = actor
        self.config = config or WeightSyncConfig()
        self.urls = list(engine_urls)
        self.rank = dist.get_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.is_source = is_export_source()
        self.control = control_group()
        self.client = None
        self.ranks: dict[str, int] | None = None  # each engine's TP ranks: one payload each

    def set_engines(self, engine_urls: list[str]) -> None:
        self.close()
        self.urls = list(engine_urls)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.client, self.ranks = None, None

    def _client(self):
        from rollout.engine_client import EngineClient

        if self.client is None:
            self.client = EngineClient(self.urls, timeout_s=self.config.timeout_s, max_attempts=1,
                                       auth_token=self.config.auth_token)
        return self.client

    # --- one sync -------------------------------------------------------------------

    def sync(self, version: int | str) -> dict[str, float]:
        start = time.perf_counter()
        version = str(version)
        errors: list[str] = []
        if self.rank == 0:
            errors += _try(self.rank, lambda: (self._client().pause_generation("abort"), self._client().flush_cache(),
                                               self._client().begin_weight_update()))
        self._raise_if_any(errors, "opening the update")
        sent_bytes, buckets = 0, 0
        for stage in range(self.pp_size):
            if stage == self.pp_rank:
                stage_bytes, stage_buckets, stage_errors = self._send_stage(version)
                sent_bytes, buckets = sent_bytes + stage_bytes, buckets + stage_buckets
                errors += stage_errors
            self._raise_if_any(errors, f"sending stage {stage}")
        if self.rank == 0:
            errors += _try(self.rank, lambda: (self._client().end_weight_update(),
                                               self._client().update_weight_version(version),
                                               self._client().continue_generation()))
        self._raise_if_any(errors, "closing the update")
        totals = torch.tensor([sent_bytes, buckets], dtype=torch.float64)
        dist.all_reduce(totals, group=self.control)
        seconds = time.perf_counter() - start
        return {"weight_sync/seconds": seconds, "weight_sync/bytes": float(totals[0]),
                "weight_sync/buckets": float(totals[1]), "weight_sync/gb_per_s": float(totals[0]) / 1e9 / seconds}

    def _send_stage(self, version: str) -> tuple[int, int, list[str]]:
        """Every rank of this stage iterates the export (its gathers are collectives); the
        source posts each full bucket. After an error it keeps draining the export."""
        errors: list[str] = []
        bucket, bucket_bytes, sent, buckets = [], 0, 0, 0

        def flush():
            nonlocal bucket, bucket_bytes, sent, buckets
            if bucket and not errors:
                errors.extend(_try(self.rank, lambda: self._post_bucket(bucket, version)))
                sent, buckets = sent + bucket_bytes, buckets + 1
            bucket, bucket_bytes = [], 0

        for name, tensor in self.actor.named_hf_weights():
            if not self.is_source or errors:
                continue
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and bucket_bytes + nbytes > self.config.bucket_bytes:
                flush()
            bucket.append((name, tensor))
            bucket_bytes += nbytes
        if self.is_source:
            flush()
        return sent, buckets, errors

    def _post_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: str) -> None:
        client = self._client()
        if self.ranks is None:
            self.ranks = client.server_ranks(timeout_s=min(30.0, self.config.timeout_s))
        send_tensor_bucket(client, bucket, self.ranks, weight_version=version, flattened=self.config.flattened,
                           timeout_s=self.config.timeout_s)

    # --- errors ---------------------------------------------------------------------

    def _raise_if_any(self, errors: list[str], during: str) -> None:
        gathered = [None] * dist.get_world_size(self.control)
        dist.all_gather_object(gathered, errors, group=self.control)
        failures = [e for rank_errors in gathered for e in rank_errors]
        if not failures:
            return
        down = []
        if self.rank == 0:
            down = [url for url, ok in self._client().check_health().items() if not ok]
        self.close()
        raise WeightSyncError(f"weight sync (tensor handles) failed while {during}"
                              + (f"; engine(s) down: {', '.join(down)}" if down else "")
                              + "\n" + "\n".join(failures))


def send_tensor_bucket(client, bucket: list[tuple[str, torch.Tensor]], ranks: dict[str, int], *,
                       weight_version: str | None = None, flattened: bool = True, timeout_s: float = 600.0) -> list:
    """Post one bucket's handles to every engine (`ranks`: URL -> its TP ranks, one
    serialized copy each); return their answers. Call between begin/end_weight_update."""
    from rollout.weight_tensors import FLATTENED, serialize, tensor_payload

    buffer, payload = tensor_payload(bucket, flattened=flattened)
    bodies = {url: {"serialized_named_tensors": [serialize(payload) for _ in range(n)],
                    "load_format": FLATTENED if flattened else None, "flush_cache": False,
                    "weight_version": weight_version}
              for url, n in ranks.items()}
    answers = client.post_all_async("/update_weights_from_tensor", bodies=bodies, timeout_s=timeout_s)
    result = answers.result(timeout=timeout_s)  # the engines have copied out of `buffer`
    del buffer
    return result


def _try(rank: int, fn) -> list[str]:
    try:
        fn()
        return []
    except Exception as err:  # reported to every rank
        return [f"rank {rank}: {type(err).__name__}: {err}"]
