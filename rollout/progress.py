"""How far a rollout has got, for a progress display: episodes and steps done, engine
requests in flight.

    counter = ProgressCounter(episodes=128, on_progress=print)
    counter.add(requests_in_flight=1)                     # a request sent
    counter.add(requests_in_flight=-1, steps_done=1)      # its response stepped the env
    counter.add(episodes_done=1)                          # an episode ended

The loops call `add` from their threads (engine callbacks, env lanes); each call hands a
copy of the counts to `on_progress`, which must be cheap (the driver keeps the latest and
shows it at most a few times a second).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutProgress:
    episodes: int  # played by this rollout
    episodes_done: int = 0
    steps_done: int = 0  # env steps taken, over all episodes
    requests_in_flight: int = 0  # sent to the engines, not answered yet


class ProgressCounter:
    """Thread-safe counts of one rollout; `on_progress` (may be None) gets each new state."""

    def __init__(self, episodes: int, on_progress: Callable[[RolloutProgress], None] | None):
        self.state = RolloutProgress(episodes)
        self.on_progress = on_progress
        self._lock = threading.Lock()

    def add(self, *, episodes_done: int = 0, steps_done: int = 0, requests_in_flight: int = 0) -> None:
        if self.on_progress is None:
            return
        with self._lock:
            s = self.state
            self.state = dataclasses.replace(s, episodes_done=s.episodes_done + episodes_done,
                                             steps_done=s.steps_done + steps_done,
                                             requests_in_flight=s.requests_in_flight + requests_in_flight)
            self.on_progress(self.state)  # under the lock: the states arrive in order
