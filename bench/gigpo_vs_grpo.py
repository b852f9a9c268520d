"""GiGPO against GRPO: the same tasks, seeds, model and settings; only the advantage differs.

    .venv/bin/python bench/gigpo_vs_grpo.py                        # 3 tasks x 3 arms x 10 seeds
    .venv/bin/python bench/gigpo_vs_grpo.py --tasks maze --seeds 0 1 2
    .venv/bin/python bench/gigpo_vs_grpo.py --quick                # the script end to end, measures nothing

Tasks:
  dense   NumberLine 0..5, the CPU main job (shaped reward: +1 at the target, -1 for a step
          that does not get closer), its model trained from scratch; 80 iterations
  sparse  the same with +1 at the target and -0.1 for every other step; 80 iterations
  maze    KeyMaze (+experiment=maze): a fixed maze with dead ends, a key and a door,
          solutions of 12-24 moves, reward 1 at the goal only; the tiny model imitates
          noisy expert episodes first; 40 iterations

A seed fixes the model's initialisation (and its warm start), the environments' seeds and
the sampling, so the arms' runs with one seed are paired. Arms: grpo, gigpo (the paper's
GiGPO: unscaled advantages) and gigpo_std (GiGPO divided by the std as GRPO is). Each run trains for a
fixed number of iterations (no early stop): equal episodes per iteration and equal
updates; the step samples each run trained on are reported. Writes
RUN_ROOT/<task>-<arm>-seed<N>/, RUN_ROOT/results.md (the tables docs/cpu_job.md
shows) and RUN_ROOT/<task>.png (curves: the mean over seeds, a min..max band). The runs are
deterministic: the same commit gives the same tables digit for digit (wall times are
printed, never tabled).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

# task -> (its overrides, its iterations)
TASKS = {
    "dense": ([], 80),
    "sparse": (["+experiment=numberline-sparse"], 80),
    "maze": (["+experiment=maze"], 40),
}
# arm -> its overrides. GiGPO's default (the paper's) leaves both halves unscaled ("mean_norm":
# R - mean), GRPO divides by the group's std; gigpo_std is GiGPO with GRPO's scaling
# (both halves "mean_std_norm"), the control that separates the step half from the scale.
ARMS = {"grpo": ["algorithm=grpo"], "gigpo": ["algorithm=gigpo"],
        "gigpo_std": ["algorithm=gigpo", "algorithm.gigpo_mode=mean_std_norm"]}
# What a run costs on 2 idle cores, for the estimate printed at the start: (start-up s, s per iteration)
COST = {"dense": (10.0, 0.6), "sparse": (10.0, 0.7), "maze": (30.0, 1.4)}
PROGRESS_EVERY = 10  # iterations between a run's progress lines
# --quick: one iteration of 2 groups x 2 per run, seed 0, the dense task
QUICK = ["num_groups=2", "group_size=2", "loop.validation.num_episodes=2"]
DIAGNOSTICS = ("gigpo/shared_state_fraction", "gigpo/step_group_size", "gigpo/episode_advantage_abs",
               "gigpo/step_advantage_abs", "gigpo/step_to_episode_abs", "gigpo/sign_disagreement")
BOOTSTRAP_RESAMPLES = 10_000
# A run whose last iterations' actions are mostly invalid: on the maze it has collapsed (every
# episode lost, every return in a group equal, no advantage left to recover with); on
# NumberLine a run can still win half its episodes so.
MOSTLY_INVALID = 0.5


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
    rows = run.rows
    success = [r["train/success_rate"] for r in rows]
    summary = {"final": statistics.mean(success[-tail:]), "mean": statistics.mean(success),
               "reach": phase_figures(run)["reached_iteration"],  # 3-iteration average >= 0.9
               "length": statistics.mean(r["train/episode_length"] for r in rows[-tail:]),
               "invalid": statistics.mean(r["train/invalid_action_rate"] for r in rows[-tail:]),
               "samples": sum(r["train/num_samples"] for r in rows), "seconds": rows[-1]["time/elapsed"]}
    for key in DIAGNOSTICS:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        summary[key] = statistics.mean(values) if values else None
    return summary


def sign_test_p(differences: list[float]) -> float:
    """Two-sided sign test: how likely this many (or more lopsided) signs are by chance."""
    from math import comb

    n = sum(1 for d in differences if d != 0)
    k = max(sum(1 for d in differences if d > 0), sum(1 for d in differences if d < 0))
    return min(1.0, 2 * sum(comb(n, i) for i in range(k, n + 1)) / 2**n) if n else 1.0


def bootstrap_interval(differences: list[float], level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean paired difference (seeds resampled with
    replacement; a fixed generator, so the same differences give the same interval)."""
    values = np.asarray(differences, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(len(values), size=(BOOTSTRAP_RESAMPLES, len(values)))
    means = values[picks].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def fmt(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def paired_rows(task: str, arm: str, arm_runs: list[dict], grpo: list[dict]) -> list[str]:
    rows = []
    for key, name in (("mean", "mean over all iterations"), ("final", "last iterations")):
        diffs = [a[key] - g[key] for a, g in zip(arm_runs, grpo)]
        low, high = bootstrap_interval(diffs)
        rows.append(f"| {task} | {arm} | {name} | {statistics.mean(diffs):+.3f} | [{low:+.3f}, {high:+.3f}] | "
                    f"{statistics.median(diffs):+.3f} | "
                    f"{sum(d > 0 for d in diffs)} of {len(diffs)} | {sign_test_p(diffs):.3f} | "
                    + " ".join(f"{d:+.3f}" for d in diffs) + " |")
    return rows


def diagnostics_row(task: str, arm: str, runs: list[dict]) -> str:
    cells = []
    for key in DIAGNOSTICS:
        values = [s[key] for s in runs if s[key] is not None]
        cells.append(f"{statistics.mean(values):.3f}" if values else "–")
    return f"| {task} | {arm} | " + " | ".join(cells) + " |"


def main() -> None:
    from megatron_agent.platform.launch import run_on_ranks
    from megatron_agent.plot import load_runs, plot_runs
    from megatron_agent.run_dir import read_metrics

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=None, help="for every task (default: each task's own)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS),
                        help="grpo is the baseline every other arm is paired with")
    parser.add_argument("--run-root", default="runs/gigpo-vs-grpo")
    parser.add_argument("--tail", type=int, default=10, help="iterations averaged for the final success rate")
    parser.add_argument("--reuse", action="store_true", help="skip runs whose metrics are already complete")
    parser.add_argument("--quick", action="store_true",
                        help="1 iteration of 2 groups x 2 per run, seed 0, the dense task: checks the script "
                             "end to end in about a minute and measures nothing")
    args = parser.parse_args()
    extra = []
    if args.quick:
        args.iterations, args.seeds, args.tasks, args.arms, extra = 1, [0], ["dense"], ["grpo", "gigpo"], QUICK
    arms = list(dict.fromkeys(["grpo", *args.arms]))
    iterations = {task: args.iterations or TASKS[task][1] for task in args.tasks}
    runs = len(args.tasks) * len(arms) * len(args.seeds)
    expected = len(arms) * len(args.seeds) * sum(COST[t][0] + iterations[t] * COST[t][1] for t in args.tasks)
    print(f"gigpo_vs_grpo: {len(args.tasks)} task(s) x {len(arms)} arms x {len(args.seeds)} seed(s) = "
          f"{runs} runs, one after the other; expected about "
          f"{f'{expected / 60:.0f} minutes' if expected >= 120 else f'{expected:.0f} s'} on 2 idle cores", flush=True)
    started, count = time.perf_counter(), 0

    root = Path(args.run_root)
    table = [f"| task | arm | success, last {args.tail} iterations | success, mean over all | runs reaching "
             f"a 0.9 average (median first iteration) | episode length, last {args.tail} | runs with mostly "
             f"invalid actions (> {MOSTLY_INVALID}, last {args.tail}) | step samples per run |",
             "|---|---|---|---|---|---|---|---|"]
    paired, diagnostics = [], []
    for task in args.tasks:
        dirs, by_arm = [], {}
        for arm in arms:
            summaries = by_arm[arm] = []
            for seed in args.seeds:
                run_dir = root / f"{task}-{arm}-seed{seed}"
                dirs.append(run_dir)
                count += 1
                if not (args.reuse and len(read_metrics(run_dir)) == iterations[task]):
                    label = f"{task} {arm} seed {seed}"
                    print(f"run {count}/{runs}: {label} ({time.perf_counter() - started:.0f} s so far)", flush=True)
                    run_on_ranks(run_one, 1, [f"run_dir={run_dir}", *ARMS[arm], f"seed={seed}",
                                              f"iterations={iterations[task]}", "stop_success=null", "val_every=0",
                                              "save_every=0", "samples_every=0", *TASKS[task][0], *extra], label,
                                 timeout_s=3600)
                summaries.append(summarize(run_dir, args.tail))
            reached = [s["reach"] for s in summaries if s["reach"] is not None]
            table.append(f"| {task} | {arm} | {fmt([s['final'] for s in summaries])} | "
                         f"{fmt([s['mean'] for s in summaries])} | {len(reached)} of {len(summaries)}"
                         f"{f' ({statistics.median(reached):.0f})' if reached else ''} | "
                         f"{fmt([s['length'] for s in summaries])} | "
                         f"{sum(s['invalid'] > MOSTLY_INVALID for s in summaries)} of {len(summaries)} | "
                         f"{statistics.mean(s['samples'] for s in summaries):.0f} |")
            print(f"{task} {arm}: {statistics.mean(s['seconds'] for s in summaries):.0f} s per run",
                  flush=True)
        plot_runs(load_runs(dirs), root / f"{task}.png", keys=["train/success_rate", "train/episode_length"],
                  average_seeds=True)
        for arm in arms[1:]:
            paired += paired_rows(task, arm, by_arm[arm], by_arm["grpo"])
            diagnostics.append(diagnostics_row(task, arm, by_arm[arm]))
    table += ["", f"Each arm minus GRPO in success, paired by seed (last iterations: the last {args.tail}); the "
              f"interval is a 95 % bootstrap interval of the mean difference; per seed in seed order {args.seeds}",
              "", "| task | arm | success | mean difference | 95 % interval | median difference | arm higher | sign test p | "
              "per seed |", "|---|---|---|---|---|---|---|---|---|", *paired,
              "", "GiGPO's diagnostics, mean over its runs' iterations (docs/algorithms.md)", "",
              "| task | arm | shared-state fraction | step-group size | mean abs(A_E) | mean abs(A_S) | "
              "their ratio | sign disagreement |", "|---|---|---|---|---|---|---|---|", *diagnostics]
    text = "\n".join(table)
    (root / "results.md").write_text(text + "\n")
    print(text)
    print(f"curves: {', '.join(str(root / f'{t}.png') for t in args.tasks)} "
          f"({time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
