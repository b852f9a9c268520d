"""GiGPO against GRPO: the same tasks, seeds, model and settings; only the advantage differs.

    .venv/bin/python bench/gigpo_vs_grpo.py                      # 2 tasks x 2 algorithms x 3 seeds (~16 min)
    .venv/bin/python bench/gigpo_vs_grpo.py --iterations 40 --seeds 0 --tasks sparse
    .venv/bin/python bench/gigpo_vs_grpo.py --quick              # the script end to end, measures nothing

Tasks (NumberLine 0..5 with the CPU main job's model and prompt; the observation is the
anchor, so the same state recurs at different steps of a trajectory and across the
trajectories of a group, where GiGPO's step groups carry information):
  dense   the main job's shaped reward (+1 at the target, -1 for a step that does not get closer)
  sparse  +1 at the target, -0.1 for every other step: only the outcome and the length
          separate episodes

Each run is a full training run (`megatron_agent.driver.train`, one process each) for a
fixed number of iterations (no early stop). Writes RUN_ROOT/<task>-<algorithm>-seed<N>/,
a Markdown table (RUN_ROOT/results.md) and success-rate curves (RUN_ROOT/<task>.png).
It says how long it expects to take when it starts, and how far each run has got.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

TASKS = {
    "dense": [],
    "sparse": ["+experiment=numberline-sparse"],
}
ALGORITHMS = ("grpo", "gigpo")
# What a run costs on 2 cores (docs/cpu_job.md: the main job's ~0.75 s per iteration of
# 16 groups x 8, ~10 s to start a process, its engine and the model), for the estimate
# printed at the start.
SECONDS_PER_ITERATION = 0.8
START_UP_S = 10.0
PROGRESS_EVERY = 10  # iterations between a run's progress lines
# --quick: one iteration of 2 groups x 2 per run, seed 0, the dense task
QUICK = ["num_groups=2", "group_size=2", "loop.validation.num_episodes=2"]


def run_one(overrides: list[str], label: str) -> None:
    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    config = load_run_config(overrides)

    def report(row: dict) -> None:
        done = row["iteration"] + 1
        if done % PROGRESS_EVERY == 0 or done == config.iterations:
            print(f"  {label}: iteration {done}/{config.iterations}, success {row['train/success_rate']:.2f} "
                  f"(3-iteration average {row['train/success_moving_average']:.2f}), "
                  f"{row['time/elapsed']:.0f} s", flush=True)

    train(config, on_iteration=report)


def summarize(run_dir: Path, tail: int) -> dict:
    from megatron_agent.plot import load_runs, phase_figures

    run = load_runs([run_dir])[0]
    success = [r["train/success_rate"] for r in run.rows]
    return {"final": statistics.mean(success[-tail:]), "mean": statistics.mean(success),
            "reach": phase_figures(run)["reached_iteration"],  # the 3-iteration average at 0.9
            "length": statistics.mean(r["train/episode_length"] for r in run.rows[-tail:])}


def sign_test_p(differences: list[float]) -> float:
    """Two-sided sign test: how likely this many (or more lopsided) signs are by chance."""
    from math import comb

    n = sum(1 for d in differences if d != 0)
    k = max(sum(1 for d in differences if d > 0), sum(1 for d in differences if d < 0))
    return min(1.0, 2 * sum(comb(n, i) for i in range(k, n + 1)) / 2**n) if n else 1.0


def fmt(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def main() -> None:
    from megatron_agent.platform.launch import run_on_ranks
    from megatron_agent.plot import load_runs, plot_runs
    from megatron_agent.run_dir import read_metrics

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=80)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--run-root", default="runs/gigpo-vs-grpo")
    parser.add_argument("--tail", type=int, default=10, help="iterations averaged for the final success rate")
    parser.add_argument("--reuse", action="store_true", help="skip runs whose metrics are already complete")
    parser.add_argument("--quick", action="store_true",
                        help="1 iteration of 2 groups x 2 per run, seed 0, the dense task: checks the script "
                             "end to end in about a minute and measures nothing")
    args = parser.parse_args()
    extra = []
    if args.quick:
        args.iterations, args.seeds, args.tasks, extra = 1, [0], ["dense"], QUICK
    runs = len(args.tasks) * len(ALGORITHMS) * len(args.seeds)
    expected = runs * (START_UP_S + args.iterations * SECONDS_PER_ITERATION)
    print(f"gigpo_vs_grpo: {len(args.tasks)} task(s) x {len(ALGORITHMS)} algorithms x {len(args.seeds)} seed(s) = "
          f"{runs} runs of {args.iterations} iterations, one after the other; expected about "
          f"{f'{expected / 60:.0f} minutes' if expected >= 120 else f'{expected:.0f} s'} on 2 idle cores "
          f"(~{START_UP_S:.0f} s start-up and "
          f"~{SECONDS_PER_ITERATION} s per iteration each)", flush=True)
    started, count = time.perf_counter(), 0

    root = Path(args.run_root)
    table = [f"| task | algorithm | final success (last {args.tail} it) | mean success (all it) | iterations to 0.9 "
             f"(per seed) | episode length (last {args.tail} it) |",
             "|---|---|---|---|---|---|"]
    paired = []
    for task in args.tasks:
        dirs, by_algorithm = [], {}
        for algorithm in ALGORITHMS:
            summaries = by_algorithm[algorithm] = []
            for seed in args.seeds:
                run_dir = root / f"{task}-{algorithm}-seed{seed}"
                dirs.append(run_dir)
                count += 1
                if not (args.reuse and len(read_metrics(run_dir)) == args.iterations):
                    label = f"{task} {algorithm} seed {seed}"
                    print(f"run {count}/{runs}: {label} ({time.perf_counter() - started:.0f} s so far)", flush=True)
                    run_on_ranks(run_one, 1, [f"run_dir={run_dir}", f"algorithm={algorithm}", f"seed={seed}",
                                              f"iterations={args.iterations}", "stop_success=null", "val_every=0",
                                              "save_every=0", "samples_every=0", *TASKS[task], *extra], label,
                                 timeout_s=3600)
                summaries.append(summarize(run_dir, args.tail))
            reach = ", ".join(str(s["reach"]) if s["reach"] is not None else "–" for s in summaries)
            table.append(f"| {task} | {algorithm} | {fmt([s['final'] for s in summaries])} | "
                         f"{fmt([s['mean'] for s in summaries])} | {reach} | "
                         f"{fmt([s['length'] for s in summaries])} |")
        plot_runs(load_runs(dirs), root / f"{task}.png", keys=["train/success_rate", "train/episode_length"],
                  average_seeds=True)
        # Same seed, same initial model and env seeds: compare the two algorithms seed by seed.
        for key in ("mean", "final"):
            diffs = [g[key] - r[key] for g, r in zip(by_algorithm["gigpo"], by_algorithm["grpo"])]
            paired.append(f"| {task} | {key} | " + " | ".join(f"{d:+.3f}" for d in diffs)
                          + f" | {sum(d > 0 for d in diffs)}/{len(diffs)} | {sign_test_p(diffs):.3f} |")
    seeds = " | ".join(f"seed {s}" for s in args.seeds)
    table += ["", f"GiGPO minus GRPO, paired by seed (mean: over all iterations; final: last {args.tail})", "",
              f"| task | success | {seeds} | GiGPO higher | sign test p |",
              "|---|---|" + "---|" * len(args.seeds) + "---|---|", *paired]
    text = "\n".join(table)
    (root / "results.md").write_text(text + "\n")
    print(text)
    print(f"curves: {', '.join(str(root / f'{t}.png') for t in args.tasks)} "
          f"({time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
