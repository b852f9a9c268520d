"""The asynchronous agent loop: each episode takes its next step as soon as its own
response is back, so one long response holds up only its own episode.

Every active copy's request is submitted at once (`EngineClient.submit`: queued per
engine, a bounded number in flight on each, so an engine that batches continuously sees
a steady stream). A finished response is handed to its env worker's *lane*: a task on a
thread pool that steps, in one call, every copy of that worker whose response has come
back meanwhile (`EnvManager.step_copies`), records the samples and submits those
episodes' next requests. Lanes of different workers run in parallel, so env stepping
overlaps generation; one lane runs at a time per worker, as the worker serves one call
at a time.

Nothing here depends on the order in which responses come back: each copy's prompt is
built from its own history, and its sampling seed from (seed, rollout index, env seed,
copy, step) (rollout/episodes.py), so on an engine whose outputs do not depend on what
else it batches the samples equal the lock-step loop's.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from rollout.episodes import Request, Slot, Timeline
from rollout.partial_rollout import next_step
from rollout.progress import ProgressCounter


def engine_submitter(engine) -> tuple[Callable[[Request], Future], ThreadPoolExecutor | None]:
    """(submit one request -> Future of its output, the pool to shut down or None). An
    engine with only the batch `generate` gets one call per request from a thread pool."""
    if hasattr(engine, "submit"):
        return (lambda r: engine.submit(r.ids, r.params, rid=r.rid, sticky_key=r.sticky_key, **image_kwargs(r))), None
    pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="rollout-generate")

    def submit(r: Request) -> Future:
        images = {k: [v] for k, v in image_kwargs(r).items()}
        return pool.submit(lambda: engine.generate([r.ids], [r.params], rids=[r.rid], sticky_keys=[r.sticky_key],
                                                   **images)[0])

    return submit, pool


def image_kwargs(r: Request) -> dict:
    """An image request's `image_data` and `prompt_tokens` for the engine call (none for a
    text request, so engines that know no images are called as before)."""
    return {"image_data": r.image_data, "prompt_tokens": r.prompt_tokens} if r.image_data else {}


def run_async(slots: list[Slot], engine, timeline: Timeline, progress: ProgressCounter | None = None) -> None:
    """Play every active copy of `slots` (already reset) to its end; `progress` counts
    the requests in flight and the steps and episodes done."""
    left = [sum(len(s.active_copies()) for s in slots)]
    lock = threading.Lock()

    def episode_ended(play: AsyncPlay, k: int, i: int) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                play.finished.set()

    play = AsyncPlay(slots, engine, timeline, progress, episode_ended)
    try:
        if left[0]:
            for k, slot in enumerate(slots):
                for i in slot.active_copies():
                    play.start(k, i)
            play.finished.wait()
    finally:
        play.close()
    play.raise_error()


class AsyncPlay:
    """The engine of the asynchronous loop: `start(k, i)` sends copy i of slot k its next
    request; each answer steps its env in its worker's lane and sends that copy's next
    request, until its episode ends, when `on_episode_end(play, k, i)` is called (from a
    lane). `finished` is set by the caller's hook, or by the first error (`raise_error`)."""

    def __init__(self, slots: list[Slot], engine, timeline: Timeline, progress: ProgressCounter | None,
                 on_episode_end: Callable[[AsyncPlay, int, int], None]):
        self.slots, self.timeline = slots, timeline
        self.progress = progress or ProgressCounter(0, None)
        self.on_episode_end = on_episode_end
        self.submit, self.generate_pool = engine_submitter(engine)
        self.in_flight_update = slots[0].settings.in_flight_update if slots else "continue"
        self.lock = threading.Lock()
        self.arrived: dict[tuple[int, int], list] = defaultdict(list)  # (slot, env worker) -> [(copy, prompt, output)]
        self.draining: set[tuple[int, int]] = set()
        self.finished = threading.Event()
        self.errors: list[BaseException] = []
        self.in_flight: set[Future] = set()
        lanes = sum(len(getattr(s.envs, "workers", [None])) for s in slots)
        self.env_pool = ThreadPoolExecutor(max_workers=max(1, lanes), thread_name_prefix="rollout-env")

    def guarded(self, fn):
        """After a failure nothing moves on: late responses and env steps are dropped."""
        def run(*args):
            if self.finished.is_set():
                return
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - raised by the caller's thread (raise_error)
                self.errors.append(e)
                self.finished.set()
        return run

    def start(self, k: int, i: int) -> None:
        self.guarded(self._start)(k, i)

    def _start(self, k: int, i: int) -> None:
        slot = self.slots[k]
        prompt = slot.prompt(i)
        request = slot.request(i, prompt)
        self._send(k, i, prompt, request, (request, None, 0), time.perf_counter())

    def _send(self, k: int, i: int, prompt, request: Request, sending: tuple, t0: float) -> None:
        """Send `sending` (the request to send, the answer so far, how many sent before:
        rollout/partial_rollout.py) for copy i's `request`."""
        self.progress.add(requests_in_flight=1)
        future = self.submit(sending[0])
        with self.lock:
            self.in_flight.add(future)
        future.add_done_callback(self.guarded(lambda f: self._generated(k, i, prompt, request, sending, t0, f)))

    def _generated(self, k: int, i: int, prompt, request: Request, sending: tuple, t0: float,
                   future: Future) -> None:
        with self.lock:
            self.in_flight.discard(future)
        self.progress.add(requests_in_flight=-1)
        output, again = next_step(request, future.result(), sending[1], sending[2], self.in_flight_update)
        if again is not None:  # cut by a weight update: sent again
            self._send(k, i, prompt, request, again, t0)
            return
        self.timeline.record("generate", t0, time.perf_counter())
        lane = (k, self.slots[k].envs.worker_of(i))
        with self.lock:
            self.arrived[lane].append((i, prompt, output))
            if lane in self.draining:
                return
            self.draining.add(lane)
        self.env_pool.submit(self.guarded(self._drain), lane)

    def _drain(self, lane: tuple[int, int]) -> None:
        slot = self.slots[lane[0]]
        while True:
            with self.lock:
                items = self.arrived.pop(lane, [])
                if not items:
                    self.draining.discard(lane)
                    return
            stepped = slot.step(items, self.timeline)
            self.progress.add(steps_done=len(stepped), episodes_done=sum(not goes_on for _, goes_on in stepped))
            for i, goes_on in stepped:
                if goes_on:
                    self._start(lane[0], i)
                else:
                    self.on_episode_end(self, lane[0], i)

    def close(self) -> None:
        """Stop: requests not sent yet are dropped, late answers ignored."""
        self.finished.set()
        with self.lock:
            abandoned = list(self.in_flight)
        for future in abandoned:  # an aborted rollout: its queued requests are never sent
            future.cancel()
        self.env_pool.shutdown(wait=not self.errors)
        if self.generate_pool is not None:
            self.generate_pool.shutdown(wait=not self.errors, cancel_futures=bool(self.errors))

    def raise_error(self) -> None:
        if self.errors:
            raise self.errors[0]
