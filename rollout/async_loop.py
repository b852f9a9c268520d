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
    progress = progress or ProgressCounter(0, None)
    submit, generate_pool = engine_submitter(engine)
    lock = threading.Lock()
    arrived: dict[tuple[int, int], list] = defaultdict(list)  # (slot, env worker) -> [(copy, prompt, output)]
    draining: set[tuple[int, int]] = set()
    left = [sum(len(s.active_copies()) for s in slots)]
    finished = threading.Event()
    errors: list[BaseException] = []
    in_flight: set[Future] = set()
    lanes = sum(len(getattr(s.envs, "workers", [None])) for s in slots)
    env_pool = ThreadPoolExecutor(max_workers=max(1, lanes), thread_name_prefix="rollout-env")

    def guarded(fn):
        """After a failure nothing moves on: late responses and env steps are dropped."""
        def run(*args):
            if finished.is_set():
                return
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - raised by run_async's caller thread
                errors.append(e)
                finished.set()
        return run

    def start(k: int, i: int) -> None:
        prompt = slots[k].prompt(i)
        request = slots[k].request(i, prompt)
        t0 = time.perf_counter()
        progress.add(requests_in_flight=1)
        future = submit(request)
        with lock:
            in_flight.add(future)
        future.add_done_callback(guarded(lambda f: generated(k, i, prompt, t0, f)))

    def generated(k: int, i: int, prompt, t0: float, future: Future) -> None:
        timeline.record("generate", t0, time.perf_counter())
        with lock:
            in_flight.discard(future)
        progress.add(requests_in_flight=-1)
        output = future.result()
        lane = (k, slots[k].envs.worker_of(i))
        with lock:
            arrived[lane].append((i, prompt, output))
            if lane in draining:
                return
            draining.add(lane)
        env_pool.submit(guarded(drain), lane)

    def drain(lane: tuple[int, int]) -> None:
        slot = slots[lane[0]]
        while True:
            with lock:
                items = arrived.pop(lane, [])
                if not items:
                    draining.discard(lane)
                    return
            stepped = slot.step(items, timeline)
            progress.add(steps_done=len(stepped), episodes_done=sum(not goes_on for _, goes_on in stepped))
            for i, goes_on in stepped:
                if goes_on:
                    start(lane[0], i)
                else:
                    with lock:
                        left[0] -= 1
                        if left[0] == 0:
                            finished.set()

    try:
        if left[0] == 0:
            return
        for k, slot in enumerate(slots):
            for i in slot.active_copies():
                guarded(start)(k, i)
        finished.wait()
    finally:
        finished.set()
        with lock:
            abandoned = list(in_flight)
        for future in abandoned:  # an aborted rollout: its queued requests are never sent
            future.cancel()
        env_pool.shutdown(wait=not errors)
        if generate_pool is not None:
            generate_pool.shutdown(wait=not errors, cancel_futures=bool(errors))
    if errors:
        raise errors[0]
