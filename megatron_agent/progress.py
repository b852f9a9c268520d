"""Where a training run is inside its iteration, from rank 0 to whoever shows it.

    reporter = ProgressReporter(run_dir, iterations, on_progress)   # rank 0
    reporter.phase(iteration, "update")                             # a phase begins
    collect(..., on_progress=reporter.rollout(iteration))           # a rollout's counts
    reporter.close()

The state (`Progress`: the iteration the loop is in, its phase, the counts of the rollout
under way) is kept as it changes and handed on at most every `interval_s` by a thread of
the reporter: to `on_progress` in this process, and to run_dir/progress.json, which the
process that launched other ranks (or Ray actors) follows with metrics.jsonl
(launcher.follow_metrics), and anyone can read while the run goes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollout.progress import RolloutProgress

PROGRESS_FILE = "progress.json"
STARTING = "start-up"  # the phase before the first iteration: checkpoint load, engines, environments
DONE = "done"


@dataclass(frozen=True)
class Progress:
    iteration: int  # the iteration the loop is in; the ones before it are done
    iterations: int  # the run's `iterations`
    phase: str  # STARTING, a phase of the iteration's PhaseTimer ("rollout", "update", ...), DONE
    # The rollout under way, what it is for ("rollout of iteration N" or "validation") and
    # its counts; with training.mode=overlap the next iteration's runs during this one's update.
    rollout_for: str | None = None
    rollout: RolloutProgress | None = None


def progress_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / PROGRESS_FILE


def read_progress(run_dir: str | Path) -> Progress | None:
    """The last state written to run_dir/progress.json (None: none yet)."""
    try:
        data = json.loads(progress_path(run_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    rollout = data.pop("rollout", None)
    return Progress(**data, rollout=RolloutProgress(**rollout) if rollout else None)


class ProgressReporter:
    def __init__(self, run_dir: str | Path, iterations: int, first_iteration: int,
                 on_progress: Callable[[Progress], None] | None = None, interval_s: float = 0.5):
        self.path, self.on_progress, self.interval_s = progress_path(run_dir), on_progress, interval_s
        self.state = Progress(first_iteration, iterations, STARTING)
        self._lock = threading.Lock()
        self._shown: Progress | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._hand_on, name="progress", daemon=True)
        self._thread.start()

    def phase(self, iteration: int, phase: str) -> None:
        with self._lock:
            self.state = dataclasses.replace(self.state, iteration=iteration, phase=phase)

    def rollout(self, label: str) -> Callable[[RolloutProgress], None]:
        """The agent loop's `on_progress` for the rollout named `label`."""
        def update(counts: RolloutProgress) -> None:
            with self._lock:
                self.state = dataclasses.replace(self.state, rollout_for=label, rollout=counts)
        return update

    def close(self) -> None:
        self.phase(self.state.iteration, DONE)
        self._closed.set()
        self._thread.join()

    def _hand_on(self) -> None:
        while True:
            closed = self._closed.wait(self.interval_s)
            with self._lock:
                state = self.state
            if state != self._shown:
                self._shown = state
                tmp = self.path.with_name(f".{self.path.name}.tmp")
                tmp.write_text(json.dumps(dataclasses.asdict(state)))
                os.replace(tmp, self.path)  # a reader sees the old state or the new one, whole
                if self.on_progress is not None:
                    self.on_progress(state)
            if closed:
                return
