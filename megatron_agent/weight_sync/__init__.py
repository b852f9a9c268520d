"""Weight sync: the actor's weights, in HF names, to every rollout engine.

Every trainer rank calls `WeightSync.sync(version)` together:

1. global rank 0 pauses generation (`pause_mode`), opens the update (`/begin_weight_update`), on a
   thread while it starts exporting stage 0 (whose source it is; nothing is announced
   before the update is open); the engines' caches are flushed by each announcement
   (`flush_cache`, SGLang's default) over a group, by `/flush_cache` before the update
   with tensor handles (whose calls ask for no flush);
2. pipeline stages take turns (the lock: engines would deadlock on two announcements
   at once); in each stage every rank iterates the bridge's export (TP and EP gathers
   are collectives), and the stage's source rank (DP 0, TP 0) fills buckets of
   `bucket_bytes`, announces each over HTTP and broadcasts it over its own
   weight-update group (NCCL on GPU, gloo on CPU) joined with the engines. Flattened (the
   default where the actor packed its parameters): the first sync writes each bucket into
   one of two reused buffers while the previous one is on the wire (buckets.BucketPipeline)
   and records the export's layout; later syncs send the runs of tensors lying back to back
   in the parameters' memory straight from there, first, and have the export write the
   rest (q/k/v) straight into their buckets (buckets.PlannedBuckets). Per tensor (the
   default where the parameters lie in the distributed optimizer's buffer): once the
   layout is recorded, each bucket is announced before it is exported and each tensor
   broadcast as the export yields it, out of its own memory (buckets.StreamedBuckets).
   With `transport: tensor` (colocated engines) there is no group:
   each bucket's tensors go to the engines as handles to this machine's shared or GPU
   memory (`/update_weights_from_tensor`, tensor_sync.py) while the next one is exported;
   with `quantize: fp8` the attention and MLP weights go as block FP8 with their scales,
   quantized as they are written into the bucket (fp8.py);
3. rank 0 closes the update and resumes generation. The weight version rides on every
   update call (SGLang and the embedded engine set it once a call succeeded); only a rank
   0 that announced nothing sets it with `/update_weight_version`.

A LoRA actor's sync (`lora`): "merged" is the above, each adapted linear's weight exported as
W + (alpha/r)·B·A. "adapters" sends the adapters alone, as a PEFT adapter named after the
weight version (rollout/engine_lora.py `adapter_name`): every rank takes part in gathering
them whole (`Actor.lora_adapter`), and rank 0 pauses generation, loads the adapter into every
engine (`/load_lora_adapter_from_tensors` with tensor handles; otherwise
`/load_lora_adapter` from a directory under `adapter_dir`, which the engines must see),
sets the version, resumes, and unloads the adapter two versions back (adapters.py). The rollout's client
names the adapter of each server's version in every call (EngineClient.lora_adapters).

A failure on any rank (an engine that died, a timeout) reaches every rank as a
`WeightSyncError` naming the engines that are down; the groups are torn down and the
next sync builds them again, so it succeeds against restarted engines.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_agent.weight_sync.adapters import AdapterLoader
from megatron_agent.weight_sync.buckets import (
    BucketBuffers,
    BucketPipeline,
    InPlaceBuckets,
    Layout,
    PlannedBuckets,
    StreamedBuckets,
    entry_bytes,
    layout_entry,
    where_it_lies,
)

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A weight sync that did not complete; the message names the engines at fault."""


PAUSE_MODES = ("abort", "in_place")


@dataclass
class WeightSyncConfig:
    bucket_bytes: int = 512 * 2**20
    backend: str | None = None  # None: nccl on GPU, gloo on CPU
    master_address: str = "127.0.0.1"  # this host, as the engines reach it
    # True: one uint8 tensor per bucket (load_format "flattened_bucket"); over a group, runs
    # of tensors lying back to back in the parameters' memory go straight from there, the rest
    # is copied into two reused buffers. False: one broadcast per tensor, streamed out of the
    # parameters' memory. None: flattened, except per tensor over a group when the parameters
    # lie in the distributed optimizer's buffer (is_flattened).
    flattened: bool | None = None
    # "broadcast": over a weight-update group; "tensor": handles to shared memory / CUDA
    # IPC, engines on the same machine (tensor_sync.py); None: tensor when
    # placement.colocate, else broadcast (engine_fleet.weight_transport).
    transport: str | None = None
    check: bool = False  # compare a checksum of every tensor each engine loaded
    # Flattened over a group: a run of exported tensors lying back to back in the parameters'
    # memory goes as one bucket straight from there when it holds at least this many bytes
    # (shorter runs are copied into the bucket buffers with the export's fresh tensors). On
    # the 2-core CPU machine a bucket's announcement costs about 2 ms, a 16 MB copy.
    in_place_min_bytes: int = 16 * 2**20
    # "fp8": attention and MLP / expert weights go to the engines as block FP8 (float8_e4m3fn
    # + float32 weight_scale_inv per 128x128 block, SGLang's layout; weight_sync/fp8.py), and
    # the engines start from an FP8 checkpoint of the model. None: the training dtype.
    quantize: str | None = None
    # How the engines pause for the update (SGLang's /pause_generation modes): "abort" ends
    # the requests in flight with the tokens they have (the agent loop finishes them:
    # loop.in_flight_update); "in_place" holds them, KV cache and all, and they decode on
    # under the new weights (asynchronous training: docs/driver.md).
    pause_mode: str = "abort"
    timeout_s: float = 300.0
    auth_token: str | None = None
    # A LoRA actor (actor.lora): "merged" sends the weights with the adapters merged in (any
    # engine serves them); "adapters" sends the adapters alone, which the engines serve on their
    # base weights (SGLang's --enable-lora, on GPUs; the embedded engine).
    lora: str = "merged"
    # "adapters" without tensor handles: where the PEFT adapter of each version is written for the
    # engines to read (a filesystem they share with rank 0); None: run_dir/adapters in a run
    # (engine_fleet.make_weight_sync), ./adapters for a WeightSync made alone.
    adapter_dir: str | None = None


LORA_SYNC_MODES = ("merged", "adapters")


class WeightSync:
    def __init__(self, actor, engine_urls: list[str], config: WeightSyncConfig | None = None):
        from megatron.core import parallel_state as ps

        from megatron_agent.models.bridge import is_export_source
        from megatron_agent.platform import control_group
        from megatron_agent.weight_sync.fp8 import QUANTIZE_MODES

        self.actor = actor
        self.config = config or WeightSyncConfig()
        if self.config.quantize not in (None, *QUANTIZE_MODES):
            raise ValueError(f"quantize={self.config.quantize!r}; choose one of {QUANTIZE_MODES} or None")
        self.urls = list(engine_urls)
        self.rank = dist.get_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.is_source = is_export_source()
        self.control = control_group()
        self.backend = self.config.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.client = None
        self.group = None
        self.group_name = None
        self.generation = 0  # bumps when groups are rebuilt
        # in every group name: a long-lived server (SGLang's) refuses a name it still holds,
        # e.g. from an earlier trainer that died without destroying its group
        self.instance = uuid.uuid4().hex[:8]
        self.buffers = BucketBuffers()  # the source's two bucket buffers, kept across syncs
        self.by_handles = self.config.transport == "tensor"
        # the source's export as the last sync sent it, and where each tensor lay: lets the next
        # per-tensor sync announce each bucket before exporting it (StreamedBuckets), the next
        # flattened one send the laid-out runs straight from the parameters' memory (PlannedBuckets)
        self.in_place: InPlaceBuckets | None = None
        self.engine_ranks: dict[str, int] | None = None  # tensor transport: one payload per engine rank
        self.adapters = AdapterLoader(self.config.adapter_dir, pause_mode=self.config.pause_mode,
                                      timeout_s=self.config.timeout_s)  # lora=adapters (adapters.py)
        if self.config.lora not in LORA_SYNC_MODES:
            raise ValueError(f"weight_sync.lora={self.config.lora!r}; choose one of {LORA_SYNC_MODES}")
        if self.config.lora == "adapters" and getattr(actor, "lora", None) is None:
            raise ValueError("weight_sync.lora=adapters needs an actor with LoRA adapters (actor.lora.rank > 0)")
        if self.rank == 0 and not (self.is_source and self.pp_rank == 0):
            raise ValueError("global rank 0 must be stage 0's export source (Megatron's rank order); it opens "
                             "the update before it exports")

    @property
    def layout(self) -> Layout | None:
        """The export's layout as the last sync sent it (None: not recorded yet)."""
        return self.in_place.layout if self.in_place is not None else None

    @property
    def flattened(self) -> bool:
        """The bucket format of the next sync (`is_flattened`)."""
        return is_flattened(self.config.flattened, by_handles=self.by_handles,
                            distributed_optimizer=self.actor.distributed_optimizer)

    def set_engines(self, engine_urls: list[str]) -> None:
        """New engine addresses (restarted engines); the next sync reconnects."""
        self._disconnect()
        self.urls = list(engine_urls)
        self.adapters.forget()

    # --- connection -----------------------------------------------------------------

    def _client(self):
        from rollout.engine_client import EngineClient

        if self.client is None:
            self.client = EngineClient(self.urls, timeout_s=self.config.timeout_s, max_attempts=1,
                                       auth_token=self.config.auth_token)
        return self.client

    def _connect(self) -> None:
        from megatron_agent.platform import free_port
        from rollout.weight_group import init_weight_update_group

        self.generation += 1
        self.group_name = f"megatron-agent-weights-{self.instance}-stage{self.pp_rank}-{self.generation}"
        port = free_port()
        # every rank of every engine is a member (an SGLang server joins with each TP rank)
        ranks = self._client().server_ranks(timeout_s=min(30.0, self.config.timeout_s))
        pending, world = self._client().init_weights_update_group(
            self.config.master_address, port, self.group_name, backend=self.backend,
            ranks_per_server=ranks, timeout_s=self.config.timeout_s,
        )
        self.group = init_weight_update_group(self.config.master_address, port, 0, world, self.group_name,
                                              backend=self.backend, timeout_s=self.config.timeout_s)
        pending.result(timeout=self.config.timeout_s)
        log.info("stage %d joined %d engine(s) (%d ranks: %s) in %s", self.pp_rank, len(ranks), world - 1,
                 ranks, self.group_name)

    def close(self) -> None:
        """Leave the weight-update groups, on the engines too (they outlive the trainer),
        and free the bucket buffers."""
        self._disconnect()
        self.buffers.release()

    def _disconnect(self) -> None:
        from rollout.weight_group import destroy_weight_update_group

        if self.group is not None:
            try:
                self._client().destroy_weights_update_group(self.group_name)
            except Exception as err:  # engines may be gone; the group goes anyway
                log.warning("could not destroy %s on every engine: %s", self.group_name, err)
            destroy_weight_update_group(self.group)
        self.group = None
        if self.client is not None:
            self.client.close()
        self.client, self.engine_ranks = None, None

    @property
    def flushes_cache(self) -> bool:
        """Whether the update flushes the engines' prefix cache: not with requests held in
        place, where SGLang refuses the flush and fails the update call (0.5.23,
        `flush_cache_after_weight_update`), so the cache keeps prefixes of older weights."""
        return self.config.pause_mode != "in_place"

    # --- one sync -------------------------------------------------------------------

    def sync(self, version: int | str) -> dict[str, float]:
        if self.config.lora == "adapters":
            return self._sync_adapters(str(version))
        start = time.perf_counter()
        version = str(version)
        errors: list[str] = []
        if self.rank == 0:
            # before this rank (stage 0's source) exports: run beside the export's Python, these
            # calls waited for the GIL, 1-8 ms each (docs/training.md); a failure to open
            # reaches every rank at stage 0's check
            # (over a group, every announcement asks the engines to flush their cache once the
            # bucket is loaded, so no flush of its own; tensor handles ask none)
            client = self._client()
            errors += [f"opening the update: {e}" for e in self._try(lambda: (
                client.pause_generation(self.config.pause_mode),
                self.by_handles and self.flushes_cache and client.flush_cache(),
                client.begin_weight_update()))]
        sent_bytes, buckets, in_place_bytes, checksums = 0, 0, 0, {}
        for stage in range(self.pp_size):
            if stage == self.pp_rank:
                stage_bytes, stage_buckets, stage_in_place, stage_sums, stage_errors = self._send_stage(
                    version, send=not errors)
                sent_bytes += stage_bytes
                buckets += stage_buckets
                in_place_bytes += stage_in_place
                checksums.update(stage_sums)
                errors += stage_errors
            self._raise_if_any(errors, f"sending stage {stage}")
        if self.config.check:  # every rank has the same config: all take part or none
            if self.is_source:
                errors += self._try(lambda: self._check(checksums))
            self._raise_if_any(errors, "checking what the engines loaded")
        if self.rank == 0:
            # every update call carried the version (engines set it once a call succeeded):
            # `/update_weight_version` only when this rank announced nothing
            errors += self._try(lambda: (self._client().end_weight_update(),
                                         buckets == 0 and self._client().update_weight_version(version),
                                         self._client().continue_generation()))
        self._raise_if_any(errors, "closing the update")
        totals = torch.tensor([sent_bytes, buckets, in_place_bytes], dtype=torch.float64)
        dist.all_reduce(totals, group=self.control)
        seconds = time.perf_counter() - start
        return {"weight_sync/seconds": seconds, "weight_sync/bytes": float(totals[0]),
                "weight_sync/buckets": float(totals[1]), "weight_sync/gb_per_s": float(totals[0]) / 1e9 / seconds,
                "weight_sync/bytes_in_place": float(totals[2])}

    def _sync_adapters(self, version: str) -> dict[str, float]:
        start = time.perf_counter()
        adapter = self.actor.lora_adapter()  # every rank: the TP gathers, then rank 0 collects
        errors, sent = [], 0
        if self.rank == 0:
            config, tensors = adapter
            sent = sum(t.numel() * t.element_size() for t in tensors.values())
            errors += self._try(lambda: self.adapters.load(self._client(), version, config, tensors,
                                                           by_handles=self.by_handles))
        self._raise_if_any(errors, "loading the LoRA adapter")
        seconds = time.perf_counter() - start
        return {"weight_sync/seconds": seconds, "weight_sync/bytes": float(sent), "weight_sync/buckets": 1.0,
                "weight_sync/gb_per_s": sent / 1e9 / seconds, "weight_sync/bytes_in_place": 0.0}

    def _send_stage(self, version: str, send: bool = True):
        """Every rank of this stage iterates the export; the source sends. After an error, or
        without `send` (the update did not open), the source keeps draining the export so its
        TP/EP peers do not hang."""
        from megatron_agent.weight_sync.fp8 import quantize_named
        from rollout.fp8_blocks import dequantize_block_fp8
        from rollout.weight_group import weight_checksum

        if not send:
            for _ in self.actor.named_hf_weights():
                pass
            return 0, 0, 0, {}, []
        errors: list[str] = []
        if self.is_source and self.group is None and not self.by_handles:
            errors += self._try(self._connect)
        parameters = [p for chunk in self.actor.chunks for p in chunk.parameters()]
        storages = {p.untyped_storage().data_ptr() for p in parameters}
        over_group = self.is_source and not self.by_handles
        plan = self.in_place if over_group and self.flattened and not errors else None
        if plan is not None and not plan.holds(parameters):  # a parameter moved: plan again
            plan = None
        if over_group and self.layout is not None and not self.flattened:
            pipeline = StreamedBuckets(self._announce(version), self._broadcast, self.config.bucket_bytes,
                                       self.layout, timeout_s=self.config.timeout_s)
        elif plan is not None:
            pipeline = PlannedBuckets(self._send_bucket(version), plan, storages, self.config.bucket_bytes,
                                      self.buffers)
        else:  # handles: the exported tensors as they are (the engines copy them before answering)
            pipeline = BucketPipeline(self._send_bucket(version), self.config.bucket_bytes,
                                      flattened=self.flattened and not self.by_handles, buffers=self.buffers)
        out = pipeline.destination if plan is not None else None
        checksums, layout, where = {}, [], []
        with _one_thread_on_cpu():
            for name, tensor in self.actor.named_hf_weights(out):
                if not self.is_source or errors or pipeline.failed:
                    continue
                sent = quantize_named(name, tensor) if self.config.quantize == "fp8" else [(name, tensor)]
                for sent_name, sent_tensor in sent:
                    pipeline.add(sent_name, sent_tensor)
                    layout.append(layout_entry(sent_name, sent_tensor))
                    where.append(where_it_lies(sent_tensor, storages))
                if self.config.check:  # of what the engine holds: the dequantized weight in fp8 mode
                    checksums[name] = weight_checksum(tensor if len(sent) == 1 else dequantize_block_fp8(
                        sent[0][1], sent[1][1], dtype=tensor.dtype))
            send_errors = pipeline.finish(send_pending=self.is_source and not errors)
        errors += [f"rank {self.rank}: {e}" for e in send_errors]
        ok = self.is_source and not errors  # a failed sync re-plans
        self.in_place = InPlaceBuckets.plan(layout, where, parameters, self.config.bucket_bytes,
                                             self.config.in_place_min_bytes) if ok else None
        in_place_bytes = sum(entry_bytes(plan.layout[i]) for i in plan.positions) if ok and plan else 0
        return pipeline.sent_bytes, pipeline.buckets, in_place_bytes, checksums, errors

    def _send_bucket(self, version: str):
        if self.by_handles:
            from megatron_agent.weight_sync.tensor_sync import send_tensor_bucket

            def send_handles(named, flat):
                if self.engine_ranks is None:
                    self.engine_ranks = self._client().server_ranks(timeout_s=min(30.0, self.config.timeout_s))
                send_tensor_bucket(self._client(), named, self.engine_ranks, weight_version=version,
                                   flattened=self.flattened, timeout_s=self.config.timeout_s)
            return send_handles

        def send(named, flat):
            send_weights(self._client(), self.group, named, self.group_name, weight_version=version,
                         flattened=self.flattened, timeout_s=self.config.timeout_s, flat=flat,
                         flush_cache=self.flushes_cache)
        return send

    def _announce(self, version: str):
        def announce(named):
            return announce_bucket(self._client(), named, self.group_name, weight_version=version,
                                   flattened=False, timeout_s=self.config.timeout_s, flush_cache=self.flushes_cache)
        return announce

    def _broadcast(self, tensor: torch.Tensor):
        from rollout.weight_group import wire_view

        return dist.broadcast(wire_view(tensor), src=0, group=self.group, async_op=True)

    def _check(self, checksums: dict[str, float]) -> None:
        from rollout.engine_client import http_json

        for url in self.urls:
            status, answer = http_json("POST", f"{url}/weights_checksum", {"names": sorted(checksums)},
                                       timeout_s=self.config.timeout_s)
            if status != 200:
                raise WeightSyncError(f"engine {url} cannot report checksums (HTTP {status}: {answer})")
            wrong = [n for n, v in checksums.items() if abs(answer["checksums"][n] - v) > 1e-6 * max(1.0, abs(v))]
            if wrong:
                raise WeightSyncError(f"engine {url} loaded different values for {len(wrong)} tensor(s): {wrong[:5]}")

    # --- errors ---------------------------------------------------------------------

    def _try(self, fn) -> list[str]:
        try:
            fn()
            return []
        except Exception as err:  # reported to every rank below
            return [f"rank {self.rank}: {type(err).__name__}: {err}"]

    def _raise_if_any(self, errors: list[str], during: str) -> None:
        gathered = [None] * dist.get_world_size(self.control)
        if len(gathered) == 1:  # one trainer rank: nothing to gather
            gathered = [errors]
        else:
            dist.all_gather_object(gathered, errors, group=self.control)
        failures = [e for rank_errors in gathered for e in rank_errors]
        if not failures:
            return
        down = []
        if self.client is not None or self.rank == 0:
            health = self._client().check_health()
            down = [url for url, ok in health.items() if not ok]
        self._disconnect()
        raise WeightSyncError(
            f"weight sync ({'tensor handles' if self.by_handles else 'broadcast'}) failed while {during}"
            + (f"; engine(s) down: {', '.join(down)}" if down else "")
            + "\n" + "\n".join(failures)
        )


def is_flattened(flattened: bool | None, *, by_handles: bool, distributed_optimizer: bool) -> bool:
    """The bucket format `WeightSyncConfig.flattened` gives. None: flattened where the actor
    packed its parameters for the export (one data-parallel rank: their runs go from memory
    in a few buckets) or with tensor handles; per tensor where the parameters lie in the
    distributed optimizer's buffer, whose q/k/v cut them into a run per layer, a bucket each
    (measured slower than per tensor: docs/training.md)."""
    if flattened is not None:
        return flattened
    return by_handles or not distributed_optimizer


@contextmanager
def _one_thread_on_cpu():
    """On a CPU-only machine, the export's copies (q/k/v, bucket writes) on one thread: an
    OpenMP team of two competes with the broadcast's own threads (gloo's, the engine's) for
    the cores; measured on 2 cores, the sender's CPU time rose by half and the sync slowed
    by a quarter with it."""
    if torch.cuda.is_available():
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def send_weights(client, pg: dist.ProcessGroup, named_tensors: list[tuple[str, torch.Tensor]], group_name: str,
                 *, weight_version: str | None = None, flattened: bool = True, timeout_s: float = 600.0,
                 flat: torch.Tensor | None = None, flush_cache: bool = True) -> list:
    """The sender's side of one bucket: announce it to every engine over HTTP and
    broadcast it from rank 0 of `pg` while they wait for it (one flattened uint8 tensor,
    or one broadcast per tensor in list order, all started at once). Call between
    begin/end_weight_update. Only one sender may announce at a time, or engines deadlock.
    `flat`: the bucket's bytes, already laid out; `named_tensors` then only describes them
    (meta tensors do)."""
    from rollout.weight_group import flatten_bucket, wait_all, wire_view

    tensors = [t.detach() if flat is not None else t.detach().contiguous() for _, t in named_tensors]
    pending = announce_bucket(client, list(zip((n for n, _ in named_tensors), tensors)), group_name,
                              weight_version=weight_version, flattened=flattened, timeout_s=timeout_s,
                              flush_cache=flush_cache)
    if flattened:
        dist.broadcast(flat if flat is not None else flatten_bucket(tensors), src=0, group=pg)
    else:
        wait_all([dist.broadcast(wire_view(t), src=0, group=pg, async_op=True) for t in tensors])
    return pending.result(timeout=timeout_s)


def announce_bucket(client, named_tensors: list[tuple[str, torch.Tensor]], group_name: str, *,
                    weight_version: str | None = None, flattened: bool = True, timeout_s: float = 600.0,
                    flush_cache: bool = True):
    """Post one bucket's names, dtypes and shapes to every engine
    (`/update_weights_from_distributed`); a Future of their answers (each engine answers
    once it received and loaded the bucket)."""
    from rollout.weight_group import dtype_name

    return client.update_weights_from_distributed(
        [n for n, _ in named_tensors], [dtype_name(t.dtype) for _, t in named_tensors],
        [list(t.shape) for _, t in named_tensors], group_name, weight_version=weight_version,
        load_format="flattened_bucket" if flattened else None, flush_cache=flush_cache, timeout_s=timeout_s,
    )
