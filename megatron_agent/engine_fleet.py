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
that refuse the release keep their memory: the run logs why, once, and goes on. With
`weight_sync.lora=adapters` they release the KV cache alone: the sync sends no base weights,
so theirs stay (the frozen base, which a LoRA actor's small optimizer leaves room for).
`engine/memory_released` is 1 only when the engines' release frees memory, which the
leader reads from each engine's /server_info when they start (`release_frees_memory`):
SGLang without its memory saver (`--enable-memory-saver`, CUDA-only) accepts both calls,
answers 200 and frees nothing. On a GPU such an engine is refused (the actor would run
out of memory beside it: `memory_saver_problem`); on a CPU the run logs it and goes on.

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


def release_frees_memory(info: dict) -> bool:
    """Whether an engine's /release_memory_occupation frees memory, by its /server_info.
    SGLang (its answer has `enable_memory_saver`, 0.5.23) frees weights and KV cache only
    with the memory saver on, which is CUDA-only; without it the call changes nothing and
    answers 200. The embedded engine (no such field) frees its parameters."""
    if "enable_memory_saver" not in info:
        return True
    return bool(info["enable_memory_saver"]) and info.get("device") != "cpu"


def memory_saver_problem(url: str, info: dict) -> str | None:
    """Why a colocated run cannot use the engine at `url` (None: it can): SGLang on a GPU
    without its memory saver keeps its weights and KV cache while the actor trains."""
    if release_frees_memory(info) or info.get("device") == "cpu":
        return None
    return (f"{url} is SGLang on {info.get('device')} without --enable-memory-saver: its /release_memory_occupation "
            "frees nothing (and answers 200), so the actor trains beside its weights and KV cache and runs out "
            "of memory; start it with --enable-memory-saver and a --mem-fraction-static that leaves the actor "
            "room (engines this run starts get both), or set placement.colocate=false")


def release_check(infos: dict[str, dict]) -> tuple[bool, str | None]:
    """From each engine's /server_info (URL -> answer): whether all of them free memory
    when released, and why they cannot be colocated (None: they can)."""
    problems = [p for p in (memory_saver_problem(url, info) for url, info in infos.items()) if p]
    return all(release_frees_memory(info) for info in infos.values()), "; ".join(problems) or None


def make_weight_sync(actor, urls: list[str], config):
    from megatron_agent.weight_sync import WeightSync

    return WeightSync(actor, urls, dataclasses.replace(
        config.weight_sync, transport=weight_transport(config),
        adapter_dir=config.weight_sync.adapter_dir or str(Path(config.run_dir) / "adapters")))


class EngineFleet:
    def __init__(self, config, model_dir: str, actor, *, leader: bool, launch_engines=None):
        """`config`: the RunConfig (its engine and weight_sync sections, run_dir for the
        engines' logs). `launch_engines(engine_config, model_dir, log_dir)` returns started
        engines (objects with `url` and `stop()`); by default embedded engine processes."""
        from megatron_agent.platform import from_leader
        from rollout.engine_client import EngineError
        from rollout.engine_launch import engine_client, launch_embedded_engines

        self.engine_config = config.engine
        self.model_dir, self.log_dir = model_dir, Path(config.run_dir) / "engines"
        self.leader = leader
        self.launch_engines = launch_engines or launch_embedded_engines
        self.restarts = 0
        self.engines, self.client = [], None
        self.colocate = config.placement.colocate
        # what the engines release while the actor trains: not the base an adapter sync keeps
        self.release_tags = ["kv_cache"] if config.weight_sync.lora == "adapters" else list(RELEASE_TAGS)
        self.released: set[str] = set()  # (leader) the memory tags the engines released
        self.release_refused: str | None = None  # (leader) why the engines keep their memory
        self.frees_memory = True  # whether the engines' release frees memory (colocated)
        try:
            problem = None
            if leader:
                if not self.engine_config.urls:
                    self.engines = self.launch_engines(self.engine_config, model_dir, self.log_dir)
                urls = list(self.engine_config.urls) or [e.url for e in self.engines]
                self.client = engine_client(self.engine_config, urls, model_dir)
                if self.colocate:
                    self.frees_memory, problem = release_check(self._server_infos(urls))
                    if not self.frees_memory and not problem:
                        log.warning("the colocated engines free no memory when released (SGLang on a CPU: its "
                                    "memory saver is CUDA-only): engine/memory_released stays 0")
            self.urls, self.frees_memory, problem = from_leader(
                (urls, self.frees_memory, problem) if leader else None)
            if problem:
                raise EngineError(problem)
            self.weight_sync = make_weight_sync(actor, self.urls, config)
        except BaseException:
            self.close()
            raise

    def _server_infos(self, urls: list[str]) -> dict[str, dict]:
        """(leader) Each engine's /server_info ({} where it has none)."""
        from rollout.engine_client import http_json

        infos = {}
        for url in urls:
            status, info = http_json("GET", url + "/server_info", timeout_s=self.engine_config.timeout_s,
                                     token=self.client.token)
            infos[url] = info if status == 200 and isinstance(info, dict) else {}
        return infos

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
        return ({**metrics, "engine/memory_released": float(released and self.frees_memory)} if self.colocate
                else metrics)

    def release_memory(self) -> None:
        """Colocated runs (every rank calls it, after the rollout): the engines free their
        weights and KV cache while the actor trains. Engines that refuse keep it."""
        if self.colocate:
            self._memory_call("release", self.release_tags)

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
        self.client = engine_client(self.engine_config, [e.url for e in self.engines], self.model_dir)

    def close(self) -> None:
        from rollout.engine_launch import stop_engines

        if self.engine_config.urls and getattr(self, "weight_sync", None) is not None:
            self.weight_sync.close()  # an external fleet outlives the run: leave its update group
        if self.client is not None:
            self.client.close()
        stop_engines(self.engines)
