"""A group stream: env groups played without end, for asynchronous training.

    stream = GroupStream(envs, engine, tokenizer, loop_config, admit)
    stream.start()                       # each of envs' groups plays the first group admitted
    finished = stream.take(n, timeout_s)  # groups done since the last take (waits for n)
    stream.wake()                        # admit again where `admit` said "not yet"
    unplayed = stream.stop()             # the groups cut off in flight, to play again

`envs` (an EnvManager of P groups of G copies) holds the groups in flight: P at most.
Each time one of them ends (every copy done), its episodes become a `FinishedGroup` and
`admit()` names the group it plays next (a `GroupTicket`: group id, env seed, rollout
index), or None to hold it until `wake`. So `admit` bounds how far the stream runs
ahead of the trainer (the driver's staleness bound). Episodes play on the asynchronous
loop (rollout/async_loop.py); a weight update in the middle of a response finishes it
as `loop.in_flight_update` says (rollout/partial_rollout.py), so a group may hold tokens
of several weight versions (`FinishedGroup.version_tokens`).

`clocks_since_last()`: the wall, generation, env and engine-idle seconds (no request of
the stream in flight) since its last call.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.agent_loop import AgentLoopConfig, EpisodeSummary, finished_episodes
from rollout.async_loop import AsyncPlay
from rollout.episodes import RolloutSettings, Slot, Timeline
from rollout.memory import memory_factory
from rollout.progress import ProgressCounter, RolloutProgress
from rollout.samples import StepSample


@dataclass(frozen=True)
class GroupTicket:
    group_id: int
    seed: int  # the env seed of the group's copies
    rollout_index: int  # mixed into the sampling seeds (rollout/episodes.py)


@dataclass
class FinishedGroup:
    ticket: GroupTicket
    samples: list[StepSample]  # failed episodes left out when loop.drop_failed_episodes
    summaries: list[EpisodeSummary]  # one per episode, failed ones too
    version_tokens: dict[str, int]  # response tokens per engine weight version
    finished_at: float = field(default_factory=time.monotonic)


class GroupStream:
    def __init__(self, envs, engine, tokenizer, config: AgentLoopConfig,
                 admit: Callable[[], GroupTicket | None], *, image_processor=None,
                 on_progress: Callable[[RolloutProgress], None] | None = None):
        settings = RolloutSettings(
            tokenizer, config.prompt, config.sampling, 0, config.max_steps,
            memory_factory(config.prompt.memory, config.prompt.history_length, config.prompt.max_images),
            image_processor=image_processor, in_flight_update=config.in_flight_update)
        if config.mode != "async":
            raise ValueError(f"a group stream plays on the asynchronous loop, not loop.mode={config.mode!r}")
        self.slot = Slot(envs, [0] * envs.num_groups, 0, settings)
        self.config, self.admit, self.on_progress = config, admit, on_progress
        self.lock = threading.Condition()
        self.tickets: list[GroupTicket | None] = [None] * envs.num_groups  # what each group plays
        self.playing: list[set[int]] = [set() for _ in range(envs.num_groups)]  # its copies still playing
        self.finished: list[FinishedGroup] = []
        self.stopped = False
        self.in_flight, self.idle_s, self.idle_since = 0, 0.0, time.monotonic()
        self.clock_mark, self.idle_mark = time.monotonic(), 0.0  # at the last clocks_since_last
        self.play = AsyncPlay([self.slot], engine, Timeline(), ProgressCounter(0, self._count), self._episode_ended)

    def start(self) -> None:
        self.slot.observations = [None] * self.slot.envs.num_envs
        self.slot.memories = [None] * self.slot.envs.num_envs
        self.wake()

    def wake(self) -> None:
        """Every group that waits (ended, or never started) plays the next group admitted."""
        for g in range(len(self.tickets)):
            with self.lock:  # a ticket is given and written in one hold: no group plays twice
                ticket = self._admit_into(g) if self.tickets[g] is None else None
            self._play(g, ticket)

    def _admit_into(self, g: int) -> GroupTicket | None:
        """(Under the lock) group g's next ticket, written down: None when stopped or not admitted."""
        self.tickets[g] = None if self.stopped else self.admit()
        return self.tickets[g]

    def _play(self, g: int, ticket: GroupTicket | None) -> None:
        while ticket is not None:
            copies = self.slot.restart_group(g, ticket.group_id, ticket.seed, ticket.rollout_index)
            with self.lock:
                self.playing[g] = set(copies)
            for i in copies:
                self.play.start(0, i)
            if copies:
                return
            ticket = self._group_ended(g)  # every copy failed at reset: done as it starts

    def _episode_ended(self, play: AsyncPlay, k: int, i: int) -> None:
        g = i // self.slot.G
        with self.lock:
            self.playing[g].discard(i)
            if self.playing[g]:
                return
        self._play(g, self._group_ended(g))

    def _group_ended(self, g: int) -> GroupTicket | None:
        """Group g's episodes become a FinishedGroup; the group's next ticket."""
        episodes, failed = self.slot.take_group(g)
        samples, summaries = finished_episodes(episodes, failed, self.config.drop_failed_episodes)
        versions = Counter(v for s in samples for v in (s.token_versions or [s.weight_version] * len(s.response_ids)))
        with self.lock:
            self.finished.append(FinishedGroup(self.tickets[g], samples, summaries, dict(versions)))
            self.lock.notify_all()
            return self._admit_into(g)

    def take(self, wanted: int = 0, timeout_s: float | None = None) -> list[FinishedGroup]:
        """The groups finished since the last take, once there are `wanted` of them (or the
        timeout passes: then those there are). Raises the stream's first error."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.lock:
            while len(self.finished) < wanted and not self.play.errors:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self.lock.wait(0.5 if left is None else min(left, 0.5))
            self.play.raise_error()
            taken, self.finished = self.finished, []
            return taken

    def clocks_since_last(self) -> dict[str, float]:
        """Since the last call (or the start): the rollout clocks as `run_rollout`'s metrics
        (wall seconds, and those with generation and env steps under way), and
        `engine_idle_s` of `wall_s`, the seconds with nothing of the stream's in flight. The
        intervals recorded so far are let go."""
        timeline = self.play.timeline
        with timeline.lock:
            intervals, timeline.intervals = timeline.intervals, type(timeline.intervals)(list)
        done = Timeline(intervals)
        with self.lock:
            now = time.monotonic()
            idle = self.idle_s + (now - self.idle_since if self.in_flight == 0 else 0.0)
            wall, idle_since_last = now - self.clock_mark, idle - self.idle_mark
            self.clock_mark, self.idle_mark = now, idle
        busy = done.busy(["generate", "env"])
        return {"rollout/time_s": wall, "rollout/time_generate_s": done.busy(["generate"]),
                "rollout/time_env_s": done.busy(["env"]),
                "rollout/overhead_share": 1.0 - busy / wall if wall > 0 else 0.0,
                "engine_idle_s": idle_since_last, "wall_s": wall}

    def _count(self, progress: RolloutProgress) -> None:
        now = time.monotonic()
        with self.lock:
            if self.in_flight == 0 and progress.requests_in_flight > 0:
                self.idle_s += now - self.idle_since
            elif self.in_flight > 0 and progress.requests_in_flight == 0:
                self.idle_since = now
            self.in_flight = progress.requests_in_flight
        if self.on_progress is not None:
            self.on_progress(progress)

    def stop(self) -> list[GroupTicket]:
        """No group starts any more and answers still to come are dropped; the tickets of
        the groups cut off (to play again) in group order."""
        with self.lock:
            self.stopped = True
            self.lock.notify_all()
        self.play.close()
        self.play.env_pool.shutdown(wait=True)  # after a failure too: no lane still steps these envs
        with self.lock:
            cut = sorted((t for t in self.tickets if t is not None), key=lambda t: t.group_id)
            self.tickets = [None] * len(self.tickets)
            return cut


def version_lag_tokens(version_tokens: dict[str, int], version: int,
                       number: Callable[[str], int]) -> dict[int, int]:
    """Response tokens by lag behind weight version `version` ({lag: tokens}), each
    token's version read by `number`."""
    lags: Counter = Counter()
    for v, n in version_tokens.items():
        lags[version - number(v)] += n
    return dict(lags)
