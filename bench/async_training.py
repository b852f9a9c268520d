"""Synchronous, overlapped and asynchronous training on a simulated fleet (training.mode).

    python bench/async_training.py [--iterations 6] [--update-s 3.0] [--quick]

The rollout is the project's own (a rollout worker: megatron_agent/rollout_worker.py, its
group stream and partial rollouts in async mode) on K fake engines reached through the
real EngineClient (an in-process transport, as bench/rollout_scale.py). Each engine
batches continuously (C requests at once; a prefill of the request's ids plus
`--prompt-tokens` more, an agent's prompt, then `token_ms` per output token: sleeps, so the
simulation needs little CPU), answers at its weight version, and honours
/pause_generation: "abort" ends a running request at once with the tokens it has (its
continuation gives the rest of that answer, after a prefill of its longer prompt),
"in_place" holds it to decode on after the pause. Response lengths are lognormal and drawn
from the request's sampling seed; an episode's length (steps) is lognormal too, drawn at
its first step (median `--median-steps`, at most `--max-steps`): a few episodes take every
step. The trainer is a sleep of `update_s` per iteration, then a weight sync: the engines
are paused, `sync_s` pass, their version moves on and they continue. Every mode trains the
same iterations of `groups` groups: sync, overlap, async (pause "abort", answers continued),
and async with `weight_sync.pause_mode=in_place`.

Prints each mode's samples per second and the engines' idle share (time with no request
running or prefilling, averaged over the engines), in place against abort, and ends with
`async_training: async A samples/s, overlap O, sync S (engine idle a/o/s %)`.
Never asserts a time.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rollout_scale import TOKEN, CountTokenizer, in_process_transport, response_length  # noqa: E402

from envs import EnvManager, Observation, make_info, register_env  # noqa: E402
from megatron_agent.rollout_stream import TrainingConfig  # noqa: E402
from megatron_agent.rollout_worker import RolloutWorker  # noqa: E402
from megatron_agent.rollout_workers import RolloutWorkersConfig  # noqa: E402
from megatron_agent.run_config import RunConfig  # noqa: E402
from rollout.agent_loop import AgentLoopConfig  # noqa: E402
from rollout.engine_client import EngineClient  # noqa: E402
from rollout.prompts import PromptConfig  # noqa: E402
from rollout.sampling import SamplingConfig  # noqa: E402


@dataclass
class LongTailConfig:
    median_steps: float = 4.0
    sigma: float = 1.0
    max_steps: int = 40


class LongTailEnv:
    """An episode of L steps, L lognormal, drawn at its first step from (seed, response)."""

    def __init__(self, config: LongTailConfig):
        self.config = config

    def reset(self, seed: int) -> Observation:
        self.seed, self.step_index, self.length = int(seed), 0, None
        return Observation(text="step 0", anchor="step 0")

    def step(self, text: str):
        c = self.config
        if self.length is None:
            draw = random.Random(f"{self.seed}-{text}").lognormvariate(math.log(c.median_steps), c.sigma)
            self.length = int(min(c.max_steps, max(1, round(draw))))
        self.step_index += 1
        done = self.step_index >= self.length
        obs = f"step {self.step_index}"
        return Observation(text=obs, anchor=obs), float(done), done, make_info(True, done)


register_env("bench_long_tail", LongTailEnv, LongTailConfig)


@dataclass
class BusyClock:
    """Seconds with at least one request running."""

    running: int = 0
    busy_s: float = 0.0
    since: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def change(self, by: int) -> None:
        with self.lock:
            now = time.perf_counter()
            if self.running > 0:
                self.busy_s += now - self.since
            self.running += by
            self.since = now

    def busy(self) -> float:
        with self.lock:
            return self.busy_s + (time.perf_counter() - self.since if self.running else 0.0)


class PausableEngine:
    """Continuous batching of `concurrency` requests at `token_s` per token after a prefill
    of `prefill_s` per prompt token (the request's ids and `prompt_tokens` more, an agent's
    prompt), at weight `version`. `pause("abort")` ends the running requests with the
    tokens they have (a continuation, `-c<k>` after the request id, makes the rest of the
    answer the first request was to give, after a prefill of its longer prompt);
    `pause("in_place")` holds them, to decode on after `resume()`. New requests wait."""

    def __init__(self, args):
        self.slots = threading.BoundedSemaphore(args.concurrency)
        self.token_s, self.prefill_s = args.token_ms / 1000, args.prefill_ms_per_token / 1000
        self.prompt_tokens, self.median, self.sigma = args.prompt_tokens, args.median_tokens, args.sigma
        self.cv = threading.Condition()
        self.paused, self.mode, self.epoch, self.version = False, None, 0, 0
        self.left: dict[str, int] = {}  # a cut request's id -> the tokens its answer still has to give
        self.clock = BusyClock()

    def generate(self, body: dict) -> list[dict]:
        from concurrent.futures import ThreadPoolExecutor

        params, ids, rids = body["sampling_params"], body["input_ids"], body.get("rid")
        rids = rids if isinstance(rids, list) else [rids] * len(params)
        if len(params) == 1:
            return [self._one(params[0], ids[0], rids[0])]
        with ThreadPoolExecutor(len(params)) as pool:
            return list(pool.map(self._one, params, ids, rids))

    def _one(self, params: dict, ids: list[int], rid: str | None) -> dict:
        base = (rid or "").split("-c")[0]
        with self.cv:
            n = self.left.pop(base, None)
        if n is None:
            n = response_length(params["sampling_seed"], self.median, self.sigma, params["max_new_tokens"])
        n = min(n, params["max_new_tokens"])
        with self.cv:
            self.cv.wait_for(lambda: not self.paused)
            epoch = self.epoch
        done, aborted = 0.0, False
        with self.slots:
            self.clock.change(+1)
            time.sleep((self.prompt_tokens + len(ids)) * self.prefill_s)
            work = n * self.token_s
            with self.cv:
                while done < work and not aborted:
                    if self.paused and self.mode == "in_place":  # held, its cache kept
                        self.clock.change(-1)
                        self.cv.wait_for(lambda: not self.paused)
                        self.clock.change(+1)
                    start = time.perf_counter()
                    self.cv.wait_for(lambda: self.epoch != epoch or (self.paused and self.mode == "in_place"),
                                     timeout=work - done)
                    done += time.perf_counter() - start
                    aborted = self.epoch != epoch
                version = self.version
            self.clock.change(-1)
        made = min(n, int(done / self.token_s)) if aborted else n
        if aborted and base:
            with self.cv:
                self.left[base] = n - made
        finish = "abort" if aborted else ("length" if n == params["max_new_tokens"] else "stop")
        return {"text": "", "output_ids": [TOKEN] * made,
                "meta_info": {"output_token_logprobs": [(-1.0, TOKEN, None)] * made,
                              "finish_reason": {"type": finish}, "weight_version": str(version)}}

    def pause(self, mode: str) -> None:
        with self.cv:
            self.paused, self.mode = True, mode
            if mode == "abort":
                self.epoch += 1
            self.cv.notify_all()

    def resume(self, version: int) -> None:
        with self.cv:
            self.paused, self.version = False, version
            self.cv.notify_all()


def run(mode: str, args) -> dict[str, float]:
    """`mode`: a training.mode, or "async-in-place" (async with weight_sync.pause_mode=in_place)."""
    pause = "in_place" if mode == "async-in-place" else "abort"
    mode = mode.replace("-in-place", "")
    fleet = {f"http://fake-{k}": PausableEngine(args) for k in range(args.engines)}
    client = EngineClient(list(fleet), max_inflight_per_engine=args.concurrency, transport=in_process_transport(fleet))
    loop = AgentLoopConfig(max_steps=args.max_steps, prompt=PromptConfig(memory="none", include_instructions=False),
                           sampling=SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0))
    config = RunConfig(env="bench_long_tail", num_groups=args.groups, group_size=args.group_size, loop=loop,
                       env_config={"median_steps": args.median_steps, "max_steps": args.max_steps},
                       rollout=RolloutWorkersConfig(workers=1),
                       training=TrainingConfig(mode, args.max_staleness, args.inflight_groups))
    played = config.training.inflight_groups(args.groups) if mode == "async" else args.groups
    envs = EnvManager("bench_long_tail", config.env_config, num_groups=played, group_size=args.group_size,
                      backend="inline")
    worker = RolloutWorker(config, 0, None, envs=envs, tokenizer=CountTokenizer(), engine=client)

    samples, dropped, ahead = 0, 0, None
    start = time.perf_counter()
    try:
        for it in range(args.iterations):
            if mode == "async":
                taken = worker.take_groups(it, it)
                dropped += taken.dropped_groups
            elif mode == "overlap" and ahead is not None:
                ahead.join()
            else:
                worker.begin(it)
                worker.roll_out(it, 0)
            samples += len(worker.samples(it))
            if mode == "overlap" and it + 1 < args.iterations:
                worker.begin(it + 1)
                ahead = threading.Thread(target=worker.roll_out, args=(it + 1, 0))
                ahead.start()
            time.sleep(args.update_s)  # the update, beside the rollout ahead or the stream
            if ahead is not None:
                ahead.join()
            for engine in fleet.values():
                engine.pause(pause)
            time.sleep(args.sync_s)
            for engine in fleet.values():
                engine.resume(it + 1)
        wall = time.perf_counter() - start
    finally:
        worker.close()
        client.close()
    idle = 1.0 - sum(e.clock.busy() for e in fleet.values()) / (len(fleet) * wall)
    return {"samples": samples, "wall": wall, "samples_per_s": samples / wall, "idle": idle, "dropped": dropped}


def main(argv: list[str] | None = None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=32, help="requests running at once per engine")
    ap.add_argument("--token-ms", type=float, default=2.0, help="per output token of one request")
    ap.add_argument("--median-tokens", type=float, default=64)
    ap.add_argument("--sigma", type=float, default=0.8, help="lognormal sigma of the response lengths")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=2048, help="an agent's prompt, prefilled per request")
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    ap.add_argument("--median-steps", type=float, default=4.0)
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--update-s", type=float, default=3.0, help="the trainer's update, per iteration")
    ap.add_argument("--sync-s", type=float, default=0.3, help="the weight sync, engines paused")
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--inflight-groups", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="2 iterations of 4 short groups (a test's size)")
    args = ap.parse_args(argv)
    if args.quick:
        args.iterations, args.groups, args.inflight_groups, args.update_s, args.sync_s = 2, 4, 8, 0.1, 0.05
        args.max_steps, args.token_ms, args.prompt_tokens = 6, 0.3, 256
    print(f"{args.iterations} iterations of {args.groups} groups x {args.group_size} episodes (median "
          f"{args.median_steps:g} steps, at most {args.max_steps}); {args.engines} fake engines x {args.concurrency} "
          f"running, {args.token_ms} ms/token after a prefill of {args.prompt_tokens} + the ids at "
          f"{args.prefill_ms_per_token} ms/token, lognormal responses (median {args.median_tokens:g} tokens, sigma "
          f"{args.sigma}); update {args.update_s} s + sync {args.sync_s} s; async: max_staleness "
          f"{args.max_staleness}, {args.inflight_groups} groups in flight", flush=True)
    results = {}
    for mode in ("sync", "overlap", "async", "async-in-place"):
        results[mode] = r = run(mode, args)
        print(f"{mode:>14}: {r['samples']} samples in {r['wall']:.1f} s = {r['samples_per_s']:.1f} samples/s, "
              f"engines idle {100 * r['idle']:.0f} %" + (f", {r['dropped']} groups dropped as stale"
                                                          if mode.startswith("async") else ""), flush=True)
    a, o, s, k = (results[m] for m in ("async", "overlap", "sync", "async-in-place"))
    print(f"in place (weight_sync.pause_mode=in_place, no prefill again): {k['samples_per_s']:.1f} samples/s, "
          f"{k['samples_per_s'] / a['samples_per_s']:.2f}x async with abort and continue")
    print(f"async_training: async {a['samples_per_s']:.1f} samples/s, overlap {o['samples_per_s']:.1f}, sync "
          f"{s['samples_per_s']:.1f} (engine idle {100 * a['idle']:.0f}/{100 * o['idle']:.0f}/{100 * s['idle']:.0f} %)"
          f"; async / sync {a['samples_per_s'] / s['samples_per_s']:.2f}x")
    return results


if __name__ == "__main__":
    main()
