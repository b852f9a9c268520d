"""Rollout ahead (`training.mode=overlap`): iteration k+1's rollout runs in a thread on the
leader while iteration k trains, on the weights the engines hold (those of iteration k);
the weight sync waits for both, so generation is never paused under a running rollout.
Every sample is then one update old (`train/policy_staleness` 1), which the rollout
correction (`algorithm.tis_cap`, `algorithm.rollout_mask`) corrects by the engines' logprobs.

    rollouts = RolloutAhead(fleet, collect, leader=..., overlap=...)
    collected = rollouts.take(k)    # every rank: ready since iteration k-1, or rolled out now
    rollouts.start(k + 1)           # overlap on: in a thread on the leader
    ...                             # iteration k's update
    rollouts.finish()               # every rank, before the weight sync

Without overlap, `start` and `finish` do nothing and `take` rolls out on the spot. With
it, the last iteration rolls out one iteration more than the run trains on: a checkpoint
holds the rollout done ahead, so a run resumed from any checkpoint (or extended past its
last iteration) is the run that never stopped.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class RolloutAhead:
    def __init__(self, fleet, collect, *, leader: bool, overlap: bool):
        """`collect(client, iteration)` -> (samples, metrics, episodes), on the leader."""
        self.fleet, self.collect = fleet, collect
        self.leader, self.overlap = leader, overlap
        self.ready: dict[int, object] = {}  # iteration -> collected (None off the leader)
        self.taken_ahead = False  # whether the last `take` was rolled out on older weights
        self._running: int | None = None
        self._thread = self._result = self._error = None

    def take(self, iteration: int):
        """This iteration's rollout (the leader's; None on the other ranks)."""
        self.taken_ahead = iteration in self.ready
        if self.taken_ahead:
            return self.ready.pop(iteration)
        return self.fleet.run(lambda client: self.collect(client, iteration), iteration)

    def start(self, iteration: int) -> None:
        if not self.overlap:
            return
        self._running = iteration
        if self.leader:
            self._thread = threading.Thread(target=self._collect, args=(iteration,), name=f"rollout-{iteration}",
                                            daemon=True)
            self._thread.start()

    def _collect(self, iteration: int) -> None:
        try:
            self._result = self.collect(self.fleet.client, iteration)
        except BaseException as err:  # noqa: BLE001 - handed to the main thread by finish()
            self._error = err

    def finish(self) -> None:
        """Wait for the rollout ahead (collective). One that the engines failed is dropped:
        `take` rolls it out again, through the fleet's restarts, when its turn comes."""
        from megatron_agent.platform import from_leader
        from rollout.engine_client import EngineError

        if self._running is None:
            return
        iteration, self._running = self._running, None
        failure = None
        if self.leader:
            self._thread.join()
            error, result = self._error, self._result
            self._thread = self._result = self._error = None
            if error is not None and not isinstance(error, EngineError):
                raise error
            failure = None if error is None else f"{type(error).__name__}: {error}"
        failure = from_leader(failure)
        if failure is None:
            self.ready[iteration] = result if self.leader else None
        else:
            log.warning("the rollout ahead of iteration %d failed (%s); it runs again in its turn",
                        iteration, failure.splitlines()[0])

    def pending(self, iteration: int):
        """The rollout collected ahead for `iteration` (the leader's; None when there is none)."""
        return self.ready.get(iteration)

    def restore(self, iteration: int, collected) -> None:
        """Collective: the leader's rollout ahead for `iteration`, read from a checkpoint
        (None: there is none, `take` rolls it out)."""
        from megatron_agent.platform import from_leader

        if from_leader(collected is not None):
            self.ready[iteration] = collected
