"""The rollout engines of a run, and how the run survives one that dies.

Every trainer rank holds an `EngineFleet`. Rank 0 (the leader) starts the engines (unless
`engine.urls` names a running fleet), holds the client that generates on them, and
restarts them when they fail; every rank's weight sync follows their addresses.

    fleet.run(lambda client: rollout(client), version)   # a leader step: rollout, validation
    fleet.sync_weights(version)                          # every rank: the weight sync

When a step fails because the engines did (`EngineError`, `WeightSyncError`), the leader
restarts them (embedded or project-started engines only: a configured SGLang fleet is
the cluster's to restart), every rank points its weight sync at the new engines and
sends the current weights (`version`), and the step runs again, at most
`MAX_ENGINE_RESTARTS` times per step.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

MAX_ENGINE_RESTARTS = 2  # per step of an iteration


class EngineFleet:
    def __init__(self, config, model_dir: str, actor, *, leader: bool, launch_engines=None):
        """`config`: the RunConfig (its engine and weight_sync sections, run_dir for the
        engines' logs). `launch_engines(engine_config, model_dir, log_dir)` returns started
        engines (objects with `url` and `stop()`); by default embedded engine processes."""
        from megatron_agent.platform import from_leader
        from megatron_agent.weight_sync import WeightSync
        from rollout.engine_launch import engine_client, launch_embedded_engines

        self.engine_config = config.engine
        self.model_dir, self.log_dir = model_dir, Path(config.run_dir) / "engines"
        self.leader = leader
        self.launch_engines = launch_engines or launch_embedded_engines
        self.restarts = 0
        self.engines, self.client = [], None
        try:
            if leader and not self.engine_config.urls:
                self.engines = self.launch_engines(self.engine_config, model_dir, self.log_dir)
            self.urls = from_leader(list(self.engine_config.urls) or [e.url for e in self.engines])
            if leader:
                self.client = engine_client(self.engine_config, self.urls)
            self.weight_sync = WeightSync(actor, self.urls, config.weight_sync)
        except BaseException:
            self.close()
            raise

    def run(self, step, version: int):
        """`step(client)` on the leader (None on the other ranks), retried on new engines
        that hold weights `version` if the engines fail."""
        return self._with_restarts(lambda: step(self.client) if self.leader else None, version,
                                   is_weight_sync=False)

    def sync_weights(self, version: int) -> dict[str, float]:
        """The collective weight sync (every rank), retried on restarted engines."""
        return self._with_restarts(lambda: self.weight_sync.sync(version=version), version, is_weight_sync=True)

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
        self.engines = self.launch_engines(self.engine_config, self.model_dir, self.log_dir)
        self.client = engine_client(self.engine_config, [e.url for e in self.engines])

    def close(self) -> None:
        from rollout.engine_launch import stop_engines

        if self.engine_config.urls and getattr(self, "weight_sync", None) is not None:
            self.weight_sync.close()  # an external fleet outlives the run: leave its update group
        if self.client is not None:
            self.client.close()
        stop_engines(self.engines)
