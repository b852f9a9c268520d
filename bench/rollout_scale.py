"""Rollout at cluster scale, simulated: the lock-step loop against the asynchronous one.

    python bench/rollout_scale.py [--engines 8] [--concurrency 32] [--token-ms 2.0]

K fake engines answer SGLang's /generate through the real EngineClient (its transport is
swapped for an in-process call, so no sockets: the routing, the per-engine bound on
requests in flight, sticky trajectories and the protocol's bodies are the client's own).
Each engine batches continuously: up to C requests run at once, each taking
`tokens x token_ms` (a sleep, so the simulation needs no CPU), the rest queue. Response
lengths are heavy-tailed (lognormal, drawn from the request's sampling seed, so both
loops see the same lengths). Environments sleep `env_ms` per step in a process pool and
end an episode with probability 1/15 per step (drawn from the seed, the step and the
response), at most 30 steps. 256 groups of 8 episodes.

The lower bound is the larger of the fleet's generation work spread over its K x C slots
and the longest episode (its responses and env steps back to back); the busiest engine's
generation time in the asynchronous run (its work / C) is printed beside it. Prints
figures and ends with `rollout_scale: async A x bound, lock-step L x bound`; never
asserts a time.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from envs import EnvManager, Observation, make_info, register_env  # noqa: E402
from rollout.agent_loop import AgentLoopConfig, run_rollout  # noqa: E402
from rollout.engine_client import EngineClient  # noqa: E402
from rollout.prompts import PromptConfig  # noqa: E402
from rollout.sampling import SamplingConfig  # noqa: E402

TOKEN = 7


@dataclass
class SleepyConfig:
    step_ms: float = 1.0
    end_probability: float = 1 / 15


class SleepyEnv:
    """Sleeps step_ms per step; the episode ends at random (seed, step, response length)."""

    def __init__(self, config: SleepyConfig):
        self.config = config

    def reset(self, seed: int) -> Observation:
        self.seed, self.step_index = int(seed), 0
        return Observation(text="step 0", anchor="step 0")

    def step(self, text: str):
        time.sleep(self.config.step_ms / 1000)
        draw = random.Random(f"{self.seed}-{self.step_index}-{len(text or '')}").random()
        self.step_index += 1
        done = bool(draw < self.config.end_probability)
        obs = f"step {self.step_index}"
        return Observation(text=obs, anchor=obs), 0.0, done, make_info(True, done)


register_env("bench_sleepy", SleepyEnv, SleepyConfig)


class CountTokenizer:
    """Just enough of a tokenizer: short prompt ids, and a response decodes to its length."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "\n".join(m["content"] for m in messages)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode()[:32])}

    def decode(self, ids, skip_special_tokens=True):
        return str(len(ids))


def response_length(sampling_seed: int, median: float, sigma: float, cap: int) -> int:
    return int(min(cap, max(1, round(random.Random(sampling_seed).lognormvariate(math.log(median), sigma)))))


class FakeEngine:
    """Continuous batching: up to `concurrency` requests progress at once, each at
    `token_s` per output token; requests beyond that wait for a free slot. A batch of
    prompts in one call runs as that many requests (FIFO, on a pool of `concurrency`
    threads); a call of one prompt runs in the caller's thread."""

    def __init__(self, concurrency: int, token_s: float, median: float, sigma: float):
        self.running = threading.BoundedSemaphore(concurrency)
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="fake-engine")
        self.token_s, self.median, self.sigma = token_s, median, sigma
        self.lock = threading.Lock()
        self.work_s = 0.0  # generation seconds served, summed over requests

    def generate(self, body: dict) -> list[dict]:
        if len(body["sampling_params"]) == 1:
            return [self._one(body["sampling_params"][0])]
        jobs = [self.pool.submit(self._one, params) for params in body["sampling_params"]]
        return [job.result() for job in jobs]

    def _one(self, params: dict) -> dict:
        n = response_length(params["sampling_seed"], self.median, self.sigma, params["max_new_tokens"])
        with self.running:
            time.sleep(n * self.token_s)
        with self.lock:
            self.work_s += n * self.token_s
        finish = "length" if n == params["max_new_tokens"] else "stop"
        return {"text": "", "output_ids": [TOKEN] * n,
                "meta_info": {"output_token_logprobs": [(-1.0, TOKEN, None)] * n,
                              "finish_reason": {"type": finish}, "weight_version": "0"}}

    def close(self) -> None:
        self.pool.shutdown(wait=False)


def in_process_transport(fleet: dict[str, FakeEngine]):
    def call(method, url, body=None, *, timeout_s=30.0, token=None):
        base, path = url.rsplit("/", 1)
        if path != "generate":
            return 404, {"error": f"/{path} is not served by the fake engine"}
        return 200, fleet[base].generate(body)

    return call


def run(mode: str, args, seeds: list[int]) -> tuple[dict, list, dict[str, float]]:
    fleet = {f"http://fake-{k}": FakeEngine(args.concurrency, args.token_ms / 1000, args.median_tokens,
                                            args.sigma) for k in range(args.engines)}
    client = EngineClient(list(fleet), max_inflight_per_engine=args.concurrency,
                          transport=in_process_transport(fleet))
    cfg = AgentLoopConfig(max_steps=args.max_steps, mode=mode,
                          prompt=PromptConfig(memory="none", include_instructions=False),
                          sampling=SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0))
    try:
        with EnvManager("bench_sleepy", {"step_ms": args.env_ms}, num_groups=args.groups,
                        group_size=args.group_size, backend=args.env_backend, num_workers=args.env_workers) as envs:
            result = run_rollout(envs, client, CountTokenizer(), cfg, seeds)
    finally:
        client.close()
        for engine in fleet.values():
            engine.close()
    return result.metrics, result.samples, {url: e.work_s for url, e in fleet.items()}


def lower_bound(samples, args) -> tuple[float, float]:
    """(fleet generation work / (K x C), the longest episode back to back), seconds."""
    token_s, env_s = args.token_ms / 1000, args.env_ms / 1000
    per_episode: dict[int, float] = defaultdict(float)
    for s in samples:
        per_episode[s.traj_id] += len(s.response_ids) * token_s + env_s
    work = sum(len(s.response_ids) for s in samples) * token_s
    return work / (args.engines * args.concurrency), max(per_episode.values())


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight per engine")
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--token-ms", type=float, default=1.0, help="per output token of one request")
    ap.add_argument("--median-tokens", type=float, default=64)
    ap.add_argument("--sigma", type=float, default=1.2, help="lognormal sigma of the response lengths")
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--env-ms", type=float, default=1.0)
    ap.add_argument("--env-backend", default="process")
    ap.add_argument("--env-workers", type=int, default=4)
    args = ap.parse_args(argv)

    seeds = list(range(1000, 1000 + args.groups))
    print(f"{args.groups} groups x {args.group_size} episodes, up to {args.max_steps} steps; {args.engines} fake "
          f"engines x {args.concurrency} in flight, {args.token_ms} ms/token, lognormal lengths (median "
          f"{args.median_tokens:g}, sigma {args.sigma}, cap {args.max_new_tokens}); env {args.env_ms} ms/step on "
          f"{args.env_workers} {args.env_backend} worker(s); at the defaults about 2.5 minutes on 2 cores",
          flush=True)
    walls, samples, work = {}, {}, {}
    for mode in ("lockstep", "async"):
        t0 = time.perf_counter()
        metrics, samples[mode], work[mode] = run(mode, args, seeds)
        walls[mode] = metrics["rollout/time_s"]
        print(f"{mode:>8}: rollout {walls[mode]:7.2f} s (with env start {time.perf_counter() - t0:.2f} s), "
              f"{len(samples[mode])} steps, generate busy {metrics['rollout/time_generate_s']:.2f} s, "
              f"env busy {metrics['rollout/time_env_s']:.2f} s")
    same = [(s.traj_id, s.step_index, s.response_ids) for s in samples["lockstep"]] == \
           [(s.traj_id, s.step_index, s.response_ids) for s in samples["async"]]
    fleet, longest = lower_bound(samples["async"], args)
    bound = max(fleet, longest)
    busiest = max(work["async"].values()) / args.concurrency
    lengths = np.array([len(s.response_ids) for s in samples["async"]])
    print(f"response tokens: mean {lengths.mean():.0f}, p50 {np.median(lengths):.0f}, p99 "
          f"{np.percentile(lengths, 99):.0f}, max {lengths.max()}; samples equal across loops: {same}")
    print(f"   bound: {bound:7.2f} s = max(fleet work / {args.engines * args.concurrency} slots {fleet:.2f} s, "
          f"longest episode {longest:.2f} s); busiest engine (async) {busiest:.2f} s")
    ratios = {mode: walls[mode] / bound for mode in walls}
    print(f"rollout_scale: async {ratios['async']:.2f} x bound, lock-step {ratios['lockstep']:.2f} x bound")
    return {"async": ratios["async"], "lockstep": ratios["lockstep"], "same": float(same)}


if __name__ == "__main__":
    main()
