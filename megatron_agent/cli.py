"""`megatron-agent` command line: doctor, init-model, train, eval, plot, show."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import platform as py_platform
import sys
import threading
import time

log = logging.getLogger("megatron_agent")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def doctor(_args) -> int:
    """Versions, devices, and which path (layer spec, backend) a run will take."""
    import torch

    from megatron_agent.platform import detect_platform

    info = detect_platform()
    rows = [
        ("python", py_platform.python_version()),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none: CPU build'})"),
        ("megatron-core", _version("megatron-core")),
        ("transformer-engine", _version("transformer_engine")),
        ("sglang", _version("sglang")),
        ("ray", _version("ray")),
        ("transformers", _version("transformers")),
        ("device", info.device if info.is_cpu else f"{info.gpu_count} x {info.gpu_name}"),
        ("collective backend", f"{info.backend} (plus gloo for control messages)"),
        ("layer spec", info.layer_spec),
        ("fp8", "available" if info.fp8_capable else "unavailable"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if info.gpu_path_missing:
        print("\nGPU path unavailable:")
        for reason in info.gpu_path_missing:
            print(f"  - {reason}")
        print("The CPU path (gloo, local layer spec, embedded rollout engine) is used.")
    else:
        print("\nGPU path available.")
    return 0


def init_model(args) -> int:
    from megatron_agent.models.families import FAMILIES
    from megatron_agent.models.tiny import PRESETS, write_tiny_model

    for flag, value, known in (("--family", args.family, FAMILIES), ("--preset", args.preset, PRESETS)):
        if value not in known:
            print(f"error: {flag} {value!r}: choose one of {sorted(known)}", file=sys.stderr)
            return 2
    out = write_tiny_model(args.family, args.out, preset=args.preset, seed=args.seed)
    print(f"wrote {args.family} {args.preset} to {out}")
    return 0


def train(args) -> int:
    """The main job: configs/config.yaml (RL on NumberLine, CPU default) plus overrides."""
    from megatron_agent.driver import first_iteration
    from megatron_agent.driver import train as run_training
    from megatron_agent.run_config import ConfigError, load_run_config

    try:
        config = load_run_config(args.overrides)
    except ConfigError as err:
        print(f"error: bad configuration: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        return show_resolved_config(config)
    try:
        first = first_iteration(config)
    except FileNotFoundError as err:  # resume= a run with no complete checkpoint
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:  # resume= a checkpoint these settings cannot continue
        print(f"error: bad configuration: {err}", file=sys.stderr)
        return 2
    print(f"megatron-agent train: {config.algorithm.advantage_estimator} on {config.env}, {config.num_groups} "
          f"groups x {config.group_size} episodes per iteration; run directory {config.run_dir}"
          + (f"; resuming at iteration {first}" if first else ""), flush=True)
    if config.actor.lora.enabled:
        print(f"actor: {lora_summary(config)}", flush=True)
    bar = TrainingBar(config.iterations, first)
    try:
        history = run_training(config, on_iteration=bar.on_iteration, on_progress=bar.on_progress)
    except FileNotFoundError as err:  # a file the run needs (a model_dir's config.json, ...)
        bar.close()
        print(f"error: {err}", file=sys.stderr)
        return 2
    bar.close()
    wall = time.perf_counter() - args.started
    done = [row for row in history if row["iteration"] >= first]
    if not done:
        print(f"no iteration to run: the run is at iteration {first} of {config.iterations}; "
              f"{wall:.0f} s wall time")
        return 0
    last = done[-1]
    span = f"{first}" if len(done) == 1 else f"{first}-{last['iteration']}"
    print(f"{len(done)} iteration{'s' if len(done) > 1 else ''} ({span}) in {wall:.0f} s wall time, start-up included "
          f"(the iterations took {last['time/elapsed']:.0f} s); success rate {last['train/success_rate']:.2f} "
          f"(3-iteration average {last['train/success_moving_average']:.2f}); "
          f"metrics in {config.run_dir}/metrics.jsonl")
    if bar.reached is not None:
        row, seconds = bar.reached
        print(f"reached a 3-iteration average success of 0.9 at iteration {row['iteration']} "
              f"({seconds:.0f} s wall time)")
    return 0


def lora_summary(config) -> str:
    """The actor's adapters, counted from the model's config as the actor counts them built."""
    from megatron_agent.models.lora import describe_trainable
    from megatron_agent.models.memory import lora_parameters, parameter_counts
    from megatron_agent.run_config import model_hf_config

    hf = model_hf_config(config)
    return describe_trainable(sum(lora_parameters(hf, config.actor.lora)), parameter_counts(hf).total,
                              config.actor.lora, config.actor.params_dtype)


class TrainingBar:
    """The train command's progress bar: iterations done (from the one a resumed run starts
    at) with the last one's success figures, and inside an iteration its phase, and the
    episodes and steps done and engine requests in flight of the rollout under way. Fed
    by the driver from its threads (on_progress, on_iteration)."""

    def __init__(self, iterations: int, first_iteration: int):
        from tqdm import tqdm

        self.first, self.reached, self.started = first_iteration, None, time.perf_counter()
        self.bar = tqdm(total=iterations, initial=first_iteration, unit="it", dynamic_ncols=True,
                        bar_format="{l_bar}{bar:12}{r_bar}")
        # On a terminal the line is redrawn in place; in a log each redraw is a line of its own.
        self.redraw_s = 0.0 if self.bar.fp.isatty() else 10.0
        self.figures, self.inside, self.drawn = "", "start-up", 0.0
        self.lock = threading.Lock()
        self._show(first_iteration, force=True)

    def on_iteration(self, row: dict) -> None:
        if row["iteration"] < self.first:  # a resumed run's earlier rows, followed from metrics.jsonl
            return
        with self.lock:
            self.figures = (f"success {row['train/success_rate']:.2f} (avg3 "
                            f"{row['train/success_moving_average']:.2f}), invalid "
                            f"{row['train/invalid_action_rate']:.2f}")
            if self.reached is None and row["train/success_moving_average"] >= 0.9:
                self.reached = (row, time.perf_counter() - self.started)
            self.inside = ""  # until the next iteration reports
            self._show(row["iteration"] + 1, force=True)

    def on_progress(self, progress) -> None:
        with self.lock:
            self.inside = describe_progress(progress)
            self._show(progress.iteration)

    def close(self) -> None:
        with self.lock:
            self.inside = ""
            self._show(self.bar.n, force=True)
            self.bar.close()

    def _show(self, iterations_done: int, force: bool = False) -> None:
        self.bar.set_postfix_str("; ".join(part for part in (self.figures, self.inside) if part), refresh=False)
        now = time.perf_counter()
        if iterations_done > self.bar.n:
            self.bar.update(iterations_done - self.bar.n)  # draws the bar
            self.drawn = now
        elif force or now - self.drawn >= self.redraw_s:
            self.bar.refresh()
            self.drawn = now


def describe_progress(progress) -> str:
    """"rollout: 57/128 episodes, 312 steps, 24 requests in flight", "update", ... (the
    rollout's counts while it is under way, with what it is for when that is not the phase)."""
    from megatron_agent.progress import DONE, STARTING

    if progress.phase == DONE:
        return ""
    if progress.phase == STARTING:
        return STARTING
    text = progress.phase
    counts, label = progress.rollout, progress.rollout_for
    if counts is not None and counts.episodes_done < counts.episodes:
        what = (f"{counts.episodes_done}/{counts.episodes} episodes, {counts.steps_done} steps, "
                f"{counts.requests_in_flight} requests in flight")
        same = (progress.phase == "validation" and label == "validation") or (
            progress.phase == "rollout" and label == f"rollout of iteration {progress.iteration}")
        text += f": {what}" if same else f"; {label}: {what}"
    return text


def show_resolved_config(config) -> int:
    """`train --dry-run`: the configuration as run_dir/config.json would hold it, then the layout."""
    import dataclasses
    import json

    from megatron_agent.run_config import model_hf_config

    print(json.dumps(dataclasses.asdict(config), indent=2, default=str))
    hf = model_hf_config(config)
    print(f"model: {hf.get('model_type')} ({'with' if hf.get('vision_config') else 'no'} vision tower), "
          f"{hf['num_hidden_layers']} layers", file=sys.stderr)
    ranks, par = config.placement.trainer_ranks, config.parallel
    print(f"layout: {ranks} trainer ranks = DP {par.data_parallel_size(ranks)} x TP {par.tp} x PP {par.pp}"
          + (f"; experts: EP {par.ep} x expert TP {par.expert_tp} x expert DP {par.expert_data_parallel_size(ranks)}"
             if par.ep > 1 else "")
          + f"; {config.engine.num_engines} engines x {config.engine.gpus_per_engine} GPUs", file=sys.stderr)
    print("configuration checked; nothing started (--dry-run)", file=sys.stderr)
    return 0


def plot(args) -> int:
    """PNG curves comparing runs' metrics.jsonl, and a table of their phase timings."""
    from megatron_agent.plot import default_out_path, load_runs, phase_table, plot_runs

    out = args.out or default_out_path(args.run_dirs)
    keys = [key.strip() for key in args.keys.split(",") if key.strip()] if args.keys else None
    try:
        runs = load_runs(args.run_dirs)
        plot_runs(runs, out, keys=keys, x=args.x, average_seeds=args.average_seeds)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    print(phase_table(runs, average_seeds=args.average_seeds))
    return 0


def show(args) -> int:
    """One static HTML page of a run's sample episodes (samples/iter_N.json); it opens offline."""
    from megatron_agent.episode_page import NoSamples, write_episode_page

    if args.last is not None and args.last < 1:
        print(f"error: --last {args.last}: give 1 or more iterations", file=sys.stderr)
        return 2
    try:
        out = write_episode_page(args.run_dir, args.out, last=args.last)
    except NoSamples as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def evaluate(args) -> int:
    """Score a checkpoint on the env's held-out tasks through the training agent loop."""
    import shlex

    from megatron_agent.evaluate import EvalError, EvalRequest, run_eval

    request = EvalRequest(checkpoint=args.checkpoint, compare=args.compare, num_samples=args.num_samples,
                          num_tasks=args.num_tasks, split=args.split, out=args.out, overrides=list(args.overrides),
                          command=shlex.join(["megatron-agent", *args.argv]))
    try:
        report = run_eval(request, say=lambda line: print(line, flush=True))
    except (EvalError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print()
    print(report.markdown, end="")
    print(f"\nwrote {report.out / 'eval.json'} and {report.out / 'eval.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()  # the wall time a command reports counts from here
    parser = argparse.ArgumentParser(prog="megatron-agent", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("doctor", help="show versions, devices and the path a run will take")
    p.set_defaults(func=doctor)

    p = sub.add_parser("init-model", help="write a tiny HF model + tokenizer made on the spot")
    # Checked in init_model against the family tables and the presets (importing them here
    # would load torch for every command, --help included).
    p.add_argument("--family", required=True, help="a family of megatron_agent.models.families, e.g. qwen3")
    p.add_argument("--preset", default="tiny", help="a preset of megatron_agent.models.tiny, e.g. tiny")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=init_model)

    p = sub.add_parser("train", help="the main job; configs/config.yaml plus key=value overrides")
    p.add_argument("overrides", nargs="*", help="e.g. seed=1 algorithm=gigpo actor.lr=5e-4 run_dir=runs/x")
    p.add_argument("--dry-run", action="store_true",
                   help="resolve and check the configuration (layout against placement.trainer_ranks and the "
                        "model's config.json), print it as JSON and start nothing")
    p.set_defaults(func=train)

    p = sub.add_parser("plot", help="PNG curves comparing runs, and their phase timings")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", help="the PNG to write (default: RUN_DIR/plot.png for one run, "
                   "./runs_comparison.png for several)")
    p.add_argument("--keys", help="comma-separated metrics, one panel each (default: success rate, "
                   "validation success rate, episode length, invalid-action rate)")
    p.add_argument("--x", choices=["iteration", "minutes"], default="iteration")
    p.add_argument("--average-seeds", action="store_true",
                   help="one curve per group of runs named alike but for a seed suffix (-seed0, _s1)")
    p.set_defaults(func=plot)

    p = sub.add_parser("show", help="one static HTML page of a run's sample episodes (samples_every)")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", help="the HTML file to write (default: RUN_DIR/episodes.html)")
    p.add_argument("--last", type=int, help="only the newest LAST sampled iterations (default: all)")
    p.set_defaults(func=show)

    p = sub.add_parser("eval", help="score a checkpoint on the env's held-out tasks, through the training agent loop")
    p.add_argument("overrides", nargs="*", help="train's key=value overrides (env=..., env_config..., loop..., "
                   "engine.urls=[...], model_dir=...); on a run's config.json when the model is a run's")
    p.add_argument("--checkpoint", metavar="PATH", help="a Megatron checkpoint (a run's checkpoints/iter_N), a run "
                   "directory (its latest checkpoint) or an HF model directory")
    p.add_argument("--compare", metavar="PATH2", help="a second model, scored on the same tasks and seeds")
    p.add_argument("--num-samples", type=int, default=1,
                   help="samples per task (default 1: the validation sampling; more: the training sampling)")
    p.add_argument("--num-tasks", type=int, help="tasks of the split (default: loop.validation.num_episodes)")
    p.add_argument("--split", help="the env's split (default: its held-out tasks; docs/evaluation.md)")
    p.add_argument("--out", help="where eval.json and eval.md go (default: RUN/eval/NAME-SPLIT, or ./eval/NAME-SPLIT)")
    p.set_defaults(func=evaluate)

    args = parser.parse_args(argv)
    args.started = started
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    if args.command in ("train", "eval"):  # the bar, the table: the output; keep the log to warnings
        logging.getLogger().setLevel(logging.WARNING)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
