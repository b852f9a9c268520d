"""GiGPO against GRPO: the same tasks, seeds, model and settings; only the advantage differs.

    .venv/bin/python bench/gigpo_vs_grpo.py                      # 2 tasks x 2 algorithms x 3 seeds
    .venv/bin/python bench/gigpo_vs_grpo.py --iterations 40 --seeds 0 --tasks sparse

Tasks (NumberLine 0..5 with the CPU main job's model and prompt; the observation is the
anchor, so the same state recurs at different steps of a trajectory and across the
trajectories of a group, where GiGPO's step groups carry information):
  dense   the main job's shaped reward (+1 at the target, -1 for a step that does not get closer)
  sparse  +1 at the target, -0.1 for every other step: only the outcome and the length
          separate episodes

Each run is a full training run (`megatron_agent.driver.train`, one process each) for a
fixed number of iterations (no early stop). Writes RUN_ROOT/<task>-<algorithm>-seed<N>/,
a Markdown table (RUN_ROOT/results.md) and success-rate curves (RUN_ROOT/<task>.png).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

TASKS = {
    "dense": [],
    "sparse": ["+experiment=numberline-sparse"],
}
ALGORITHMS = ("grpo", "gigpo")


def run_one(overrides: list[str]) -> None:
    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    train(load_run_config(overrides))


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
    args = parser.parse_args()

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
                if not (args.reuse and len(read_metrics(run_dir)) == args.iterations):
                    print(f"{task} {algorithm} seed {seed} ...", flush=True)
                    run_on_ranks(run_one, 1, [f"run_dir={run_dir}", f"algorithm={algorithm}", f"seed={seed}",
                                              f"iterations={args.iterations}", "stop_success=null", "val_every=0",
                                              "save_every=0", "samples_every=0", *TASKS[task]],
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
    print(f"curves: {', '.join(str(root / f'{t}.png') for t in args.tasks)}")


if __name__ == "__main__":
    main()
