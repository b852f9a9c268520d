"""The rollout engines of a run, and how the run survives one that dies.

Every trainer rank holds an `EngineFleet`. Rank 0 (the leader) starts the engines (unless
`engine.urls` names a running fleet), holds the client that generates on them, and
restarts them when they fail; every rank's weight sync follows their addresses.

    fleet.run(lambda client: rollout(client), version)   # a leader step: rollout, validation
    fleet.release_memory()                               # every rank, after the rollout
    fleet.sync_weights(version)                          # every rank: the weight sync

Colocated (`placement.colocate`: the engines share the trainer's machine and devices):
after the rollout the engines release their memory (`/release_memory_occupation`,
weights and KV cache) while the actor trains; the weight sync first resumes their
weights' memory, then sends the weights (by tensor handles: `weight_sync.transport`
"tensor": megatron_agent/weight_sync/tensor_sync.py), then resumes the KV cache. Engines
that refuse the release keep their memory: the run logs why, once, and goes on. (SGLang
on a CPU accepts both calls and frees nothing: its memory saver is CUDA-only.)

When a step fails because the engines did (`EngineError`, `WeightSyncError`), the leader
restarts them (embedded or project-started engines only: a configured SGLang fleet is
the cluster's to restart), every rank points its weight sync at the new engines and
sends the current weights (`version`), and the step runs again, at most
`MAX_ENGINE_RESTARTS` times per step.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

log = logging.getLogger(__name__)

MAX_ENGINE_RESTARTS = 2  # per step of an iteration
RELEASE_TAGS = ("weights", "kv_cache")
TRANSPORTS = ("broadcast", "tensor")


def weight_transport(config) -> str:
    """The weight path of a run: `weight_sync.transport`, by default tensor handles when
    the engines are colocated and a broadcast otherwise."""
    return config.weight_sync.transport or ("tensor" if config.placement.colocate else "broadcast")


def make_weight_sync(actor, urls: list[str], config):
    from megatron_agent.weight_sync import WeightSync

    return WeightSync(actor, urls, dataclasses.replace(config.weight_sync, transport=weight_transport(config)))


class EngineFleet:
    def __init__(self, config, model_dir: str, actor, *, leader: bool, launch_engines=None):
        """`config`: the RunConfig (its engine and weight_sync sections, run_dir for the
        engines' logs). `launch_engines(engine_config, model_dir, log_dir)` returns started
        engines (objects with `url` and `stop()`); by default embedded engine processes."""
        from megatron_agent.platform import from_leader
        from rollout.engine_launch import engine_client, launch_embedded_engines

        self.engine_config = config.engine
        self.model_dir, self.log_dir = model_dir, Path(config.run_dir) / "engines"
        self.leader = leader
        self.launch_engines = launch_engines or launch_embedded_engines
        self.restarts = 0
        self.engines, self.client = [], None
        self.colocate = config.placement.colocate
        self.released: set[str] = set()  # (leader) the memory tags the engines released
        self.release_refused: str | None = None  # (leader) why the engines keep their memory
        try:
            if leader and not self.engine_config.urls:
                self.engines = self.launch_engines(self.engine_config, model_dir, self.log_dir)
            self.urls = from_leader(list(self.engine_config.urls) or [e.url for e in self.engines])
            if leader:
                self.client = engine_client(self.engine_config, self.urls)
            self.weight_sync = make_weight_sync(actor, self.urls, config)
        except BaseException:
            self.close()
            raise

    def run(self, step, version: int):
        """`step(client)` on the leader (None on the other ranks), retried on new engines
        that hold weights `version` if the engines fail."""
        return self._with_restarts(lambda: step(self.client) if self.leader else None, version,
                                   is_weight_sync=False)

    def sync_weights(self, version: int) -> dict[str, float]:
        """The collective weight sync (every rank), retried on restarted engines. Released
        engines get their weights' memory back first and their KV cache after."""
        return self._with_restarts(lambda: self._resume_and_sync(version), version, is_weight_sync=True)

    def _resume_and_sync(self, version: int) -> dict[str, float]:
        released = bool(self._memory_call("resume", ["weights"]))
        metrics = self.weight_sync.sync(version=version)
        self._memory_call("resume", ["kv_cache"])
        return {**metrics, "engine/memory_released": float(released)} if self.colocate else metrics

    def release_memory(self) -> None:
        """Colocated runs (every rank calls it, after the rollout): the engines free their
        weights and KV cache while the actor trains. Engines that refuse keep it."""
        if self.colocate:
            self._memory_call("release", list(RELEASE_TAGS))

    def _memory_call(self, action: str, tags: list[str]) -> list[str]:
        """The leader posts `/{action}_memory_occupation` for those of `tags` that apply
        (release: held ones; resume: released ones); every rank gets the tags it did. A
        failed resume raises EngineError on every rank; a refused release is logged."""
        from megatron_agent.platform import from_leader
        from rollout.engine_client import EngineError

        done, error = [], None
        if self.leader and self.colocate and not self.release_refused:
            todo = [t for t in tags if (t in self.released) == (action == "resume")]
            try:
                if todo:
                    self.client.post_all(f"/{action}_memory_occupation", {"tags": todo},
                                         timeout_s=self.engine_config.timeout_s)
                done = todo
            except EngineError as err:
                error = f"{action} of the engines' memory ({', '.join(todo)}) failed: {err}"
            if action == "release" and error:
                self.release_refused, error = error, None
                log.warning("the colocated engines keep their memory while the actor trains: %s",
                            self.release_refused)
            self.released = self.released | set(done) if action == "release" else self.released - set(done)
        done, error = from_leader((done, error))
        if error:
            raise EngineError(error)
        return done

    def _with_restarts(self, step, version: int, is_weight_sync: bool):
        from megatron_agent.platform import from_leader
        from megatron_agent.weight_sync import WeightSyncError
        from rollout.engine_client import EngineError

        resync = False
        for attempt in range(MAX_ENGINE_RESTARTS + 1):
            result, error = None, None
            try:
                if resync and version and not is_weight_sync:  # a weight sync step re-sends them itself
                    self.weight_sync.sync(version=version)
                result = step()
            except (EngineError, WeightSyncError) as err:  # a weight sync fails on every rank
                error = f"{type(err).__name__}: {err}"
            error = error if is_weight_sync else from_leader(error)
            if error is None:
                return result
            if attempt == MAX_ENGINE_RESTARTS or self.engine_config.urls:
                raise EngineError(error)
            if self.leader:
                log.warning("rollout engines failed (%s); restarting them (weights version %d) and retrying",
                            error.splitlines()[0], version)
                self._restart()
            self.weight_sync.set_engines(from_leader([e.url for e in self.engines]))
            resync, self.restarts = True, self.restarts + 1

    def _restart(self) -> None:
        from rollout.engine_launch import engine_client, stop_engines

        stop_engines(self.engines)
        self.client.close()
        self.released = set()  # new engines hold their memory
        self.engines = self.launch_engines(self.engine_config, self.model_dir, self.log_dir)
        self.client = engine_client(self.engine_config, [e.url for e in self.engines])

    def close(self) -> None:
        from rollout.engine_launch import stop_engines

        if self.engine_config.urls and getattr(self, "weight_sync", None) is not None:
            self.weight_sync.close()  # an external fleet outlives the run: leave its update group
        if self.client is not None:
            self.client.close()
        stop_engines(self.engines)
