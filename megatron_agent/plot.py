"""Curves, seconds per phase and a table comparing training runs: `megatron-agent plot RUN_DIR ...`.

Everything here reads run directories (their metrics.jsonl) and returns plain data; only
`plot_runs` draws, and it returns what it drew (the curves, the stacked phase seconds) so
it can be checked without pixels.

Averaging over seeds (`average_seeds=True`): runs whose labels differ only by a seed
suffix (`-seed0`, `_s1`, `-s2`, ...) form one group, drawn as the mean over its runs with a
min..max band. A group's curve uses only the iterations at which every one of its runs has
the metric, so it ends where the shortest run stopped.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from megatron_agent.run_dir import read_metrics

log = logging.getLogger(__name__)

SUCCESS_KEY = "train/success_rate"
MOVING_AVERAGE_KEY = "train/success_moving_average"
DEFAULT_KEYS = (SUCCESS_KEY, "val/success_rate", "train/episode_length", "train/invalid_action_rate")
# GiGPO's diagnostics (algorithms/gigpo.py `gigpo_diagnostics`), plotted by default where a run has them
GIGPO_KEYS = ("gigpo/shared_state_fraction", "gigpo/step_to_episode_abs", "gigpo/sign_disagreement")
REACH_THRESHOLD = 0.9
SEED_SUFFIX = re.compile(r"[-_](?:seed|s)\d+$", re.IGNORECASE)


@dataclass
class Run:
    label: str
    run_dir: Path
    rows: list[dict]


@dataclass
class Curve:
    """One line of a panel. `low`/`high` (the min and max over seeds) only for seed groups."""

    label: str
    key: str  # the metric the y values are
    x: list[float]
    y: list[float]
    low: list[float] | None = None
    high: list[float] | None = None
    faint: bool = False


def load_runs(run_dirs: Sequence[str | Path]) -> list[Run]:
    """One Run per directory, labelled by the directory's name (its path when two names clash)."""
    runs = []
    for given in run_dirs:
        run_dir = Path(given)
        if not run_dir.is_dir():
            raise ValueError(f"{run_dir}: no such run directory")
        if not (run_dir / "metrics.jsonl").is_file():
            raise ValueError(f"{run_dir}: no metrics.jsonl in this directory")
        rows = read_metrics(run_dir)
        if not rows:
            raise ValueError(f"{run_dir / 'metrics.jsonl'}: no complete metrics row")
        if not all(_has_number(row, "iteration") for row in rows):
            raise ValueError(f"{run_dir / 'metrics.jsonl'}: rows without an 'iteration' (not a training run's metrics)")
        runs.append(Run(run_dir.resolve().name, run_dir, rows))
    names = [run.label for run in runs]
    for run in runs:
        if names.count(run.label) > 1:
            run.label = str(run.run_dir)
    return runs


def seed_group_name(label: str) -> str:
    """The label without its seed suffix: "gigpo-seed1" -> "gigpo"."""
    return SEED_SUFFIX.sub("", label)


def group_runs(runs: Sequence[Run], average_seeds: bool = False) -> list[tuple[str, list[Run]]]:
    """(label, runs) per curve, in the order the runs came: each run alone, or seed groups."""
    if not average_seeds:
        return [(run.label, [run]) for run in runs]
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(seed_group_name(run.label), []).append(run)
    return [(name if len(members) == 1 else f"{name} ({len(members)} seeds)", members)
            for name, members in groups.items()]


def elapsed_minutes(rows: Sequence[dict]) -> list[float]:
    """Minutes since the run started, per row. A resumed run's clock restarts from zero;
    the time before the resume is added back so the minutes keep growing."""
    minutes, offset, previous = [], 0.0, 0.0
    for row in rows:
        elapsed = float(row.get("time/elapsed", previous))
        if elapsed < previous:
            offset += previous
        previous = elapsed
        minutes.append((offset + elapsed) / 60)
    return minutes


def _has_number(row: dict, key: str) -> bool:
    value = row.get(key)
    return isinstance(value, int | float) and not isinstance(value, bool)


def run_series(run: Run, key: str, x: str = "iteration") -> tuple[list[float], list[float]]:
    """(x, y) over the rows that have `key`; x is the iteration or the minutes elapsed."""
    minutes = elapsed_minutes(run.rows) if x == "minutes" else None
    xs, ys = [], []
    for i, row in enumerate(run.rows):
        if _has_number(row, key):
            xs.append(minutes[i] if minutes else row["iteration"])
            ys.append(row[key])
    return xs, ys


def seed_average(runs: Sequence[Run], key: str, x: str = "iteration"
                 ) -> tuple[list[float], list[float], list[float], list[float]]:
    """(x, mean, min, max) of `key` over runs, at the iterations every run has it.
    With x="minutes", x is the mean over the runs of the minutes at that iteration."""
    by_run = []
    for run in runs:
        minutes = elapsed_minutes(run.rows)
        by_run.append({row["iteration"]: (minutes[i], row[key])
                       for i, row in enumerate(run.rows) if _has_number(row, key)})
    common = sorted(set.intersection(*(set(points) for points in by_run)))
    xs, means, lows, highs = [], [], [], []
    for iteration in common:
        values = [points[iteration][1] for points in by_run]
        xs.append(iteration if x == "iteration" else sum(p[iteration][0] for p in by_run) / len(by_run))
        means.append(sum(values) / len(values))
        lows.append(min(values))
        highs.append(max(values))
    return xs, means, lows, highs


def panel_curves(runs: Sequence[Run], key: str, x: str = "iteration",
                 average_seeds: bool = False) -> list[Curve]:
    """The curves of one panel. The success-rate panel draws the raw rate faintly and its
    3-iteration moving average solid (when the runs logged it)."""
    curves = []
    for label, members in group_runs(runs, average_seeds):
        series_keys = [key]
        if key == SUCCESS_KEY and all(any(MOVING_AVERAGE_KEY in row for row in run.rows) for run in members):
            series_keys = [MOVING_AVERAGE_KEY, SUCCESS_KEY]
        for series_key in series_keys:
            faint = len(series_keys) == 2 and series_key == SUCCESS_KEY
            if len(members) == 1:
                xs, ys = run_series(members[0], series_key, x)
                curve = Curve(label, series_key, xs, ys, faint=faint)
            else:
                xs, ys, lows, highs = seed_average(members, series_key, x)
                curve = Curve(label, series_key, xs, ys, lows, highs, faint=faint)
            if curve.x:
                curves.append(curve)
            elif len(members) > 1 and any(_has_number(row, series_key) for run in members for row in run.rows):
                log.warning("%s: no iteration at which all its runs have %s; not drawn", label, series_key)
    return curves


def curve_legend(curve: Curve) -> str:
    """What a line is, in its panel's legend: the run, and which series when a panel has two."""
    if curve.key == MOVING_AVERAGE_KEY:
        return f"{curve.label}: 3-iteration average"
    if curve.faint:
        return f"{curve.label}: per iteration"
    return curve.label


@dataclass(frozen=True)
class LineStyle:
    color: str
    linestyle: str | tuple
    linewidth: float
    marker: str
    markersize: float


# Runs differ in colour and also in dash pattern, width and marker shape, widest first, so a
# run drawn over another with the same values leaves the one below visible around and
# between its dashes (and hollow markers of different shapes both show at one point).
DASHES = ("-", (0, (4, 2.5)), (0, (1, 1.5)), (0, (6, 2, 1, 2)), (0, (3, 3)), (0, (8, 2, 1, 2, 1, 2)))
WIDTHS = (3.2, 2.0, 1.3)  # then 1.0
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def run_style(index: int) -> LineStyle:
    """The look of the index-th curve group's lines."""
    return LineStyle(color=f"C{index % 10}", linestyle=DASHES[index % len(DASHES)],
                     linewidth=WIDTHS[index] if index < len(WIDTHS) else 1.0, marker=MARKERS[index % len(MARKERS)],
                     markersize=max(4.0, 9.0 - 1.5 * index))


# time/* keys that are not a phase of their own: the clock, the whole iteration, and the
# parts of time/rollout (iteration_metrics.iteration_row)
NOT_PHASES = ("time/elapsed", "time/iteration")
ROLLOUT_PARTS = ("time/generate", "time/env")
PHASE_ORDER = ("time/rollout", "time/rollout_wait", "time/advantages", "time/logprobs", "time/update",
               "time/critic_update", "time/weight_sync", "time/validation", "time/checkpoint", "time/other")


def stacked_phase_keys(runs: Sequence[Run]) -> list[str]:
    """The phases an iteration's seconds add up to (time/iteration), bottom to top: the
    known ones in PHASE_ORDER, then others the runs logged, in the order first seen."""
    logged = [key for key in phase_keys(runs) if key not in NOT_PHASES + ROLLOUT_PARTS]
    return [key for key in PHASE_ORDER if key in logged] + [key for key in logged if key not in PHASE_ORDER]


@dataclass
class PhaseStack:
    """One run's (or seed group's mean) seconds per phase at each iteration; a phase an
    iteration did not run (validation, checkpoint) counts 0."""

    label: str
    iterations: list[int]
    seconds: dict[str, list[float]]  # phase key -> one value per iteration, bottom to top


def phase_stack(label: str, members: Sequence[Run], phases: Sequence[str]) -> PhaseStack:
    by_run = [{row["iteration"]: row for row in run.rows if _has_number(row, "time/iteration")} for run in members]
    iterations = sorted(set.intersection(*(set(rows) for rows in by_run)))
    seconds = {key: [sum(float(rows[i].get(key, 0.0)) for rows in by_run) / len(by_run) for i in iterations]
               for key in phases}
    return PhaseStack(label, iterations, seconds)


@dataclass
class Plot:
    """What `plot_runs` drew: the curves per metric panel, a stack of phases per run, and
    the figure (its axes: the metric panels in order, then the phase panels)."""

    panels: dict[str, list[Curve]]
    phases: list[PhaseStack]
    figure: Figure


def plot_runs(runs: Sequence[Run], out_png: str | Path, keys: Sequence[str] | None = None,
              x: str = "iteration", average_seeds: bool = False) -> Plot:
    """Write one panel per metric key, then one panel per run (or seed group) of its seconds
    per phase at each iteration, stacked, to `out_png`; return what was drawn.

    keys=None plots DEFAULT_KEYS (skipping, with a warning, those no run has) and the
    GIGPO_KEYS some run has; keys named explicitly must each be in some run, else
    ValueError naming the missing ones."""
    if x not in ("iteration", "minutes"):
        raise ValueError(f"x must be 'iteration' or 'minutes', not {x!r}")
    wanted = list(DEFAULT_KEYS if keys is None else keys)
    if keys is None:
        wanted += [key for key in GIGPO_KEYS if any(_has_number(row, key) for run in runs for row in run.rows)]
    missing = [key for key in wanted if not any(_has_number(row, key) for run in runs for row in run.rows)]
    if missing and keys is not None:
        raise ValueError(f"no run has the metric(s): {', '.join(missing)}")
    if missing:
        log.warning("skipping metrics no run has: %s", ", ".join(missing))
    present = [key for key in wanted if key not in missing]
    if not present:
        raise ValueError("none of the metrics to plot is in any run")
    groups = group_runs(runs, average_seeds)
    for label, members in groups:
        lasts = {run.rows[-1]["iteration"] for run in members}
        if len(lasts) > 1:
            log.warning("%s: its runs stop at iterations %s; the average ends at the earliest",
                        label, sorted(lasts))
    styles = {label: run_style(i) for i, (label, _) in enumerate(groups)}
    phases = stacked_phase_keys(runs)
    stacks = [stack for stack in (phase_stack(label, members, phases) for label, members in groups)
              if stack.iterations] if phases else []

    panels = {key: panel_curves(runs, key, x, average_seeds) for key in present}
    columns = 1 if len(panels) + len(stacks) == 1 else 2
    metric_rows = math.ceil(len(panels) / columns)
    rows = metric_rows + math.ceil(len(stacks) / columns)
    figure = Figure(figsize=(6.5 * columns, 4 * rows), layout="constrained")
    FigureCanvasAgg(figure)  # Agg renders the PNG without a display and without pyplot's global state
    for index, (key, curves) in enumerate(panels.items()):
        axes = figure.add_subplot(rows, columns, index + 1)
        for curve in curves:
            draw_curve(axes, curve, styles[curve.label], with_markers=key.startswith("val/"))
        title = key if key != SUCCESS_KEY or not any(c.faint for c in curves) else \
            f"{key} (faint: per iteration)"
        axes.set_title(title)
        axes.set_xlabel(x)
        if x == "iteration":
            axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        axes.grid(alpha=0.3)
        if curves:
            axes.legend(fontsize="small")
        else:
            axes.text(0.5, 0.5, "no iteration common to a group's runs", ha="center", transform=axes.transAxes)
    shared = None
    for index, stack in enumerate(stacks):
        axes = figure.add_subplot(rows, columns, metric_rows * columns + index + 1, sharey=shared)
        shared = shared or axes
        draw_phase_stack(axes, stack)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_png, dpi=100)
    return Plot(panels, stacks, figure)


def draw_curve(axes, curve: Curve, style: LineStyle, with_markers: bool) -> None:
    marker = dict(marker=style.marker, markersize=style.markersize, markerfacecolor="none",
                  markeredgewidth=1.3) if with_markers else {}
    axes.plot(curve.x, curve.y, color=style.color, linestyle=style.linestyle,
              linewidth=0.8 if curve.faint else style.linewidth, alpha=0.35 if curve.faint else 1.0,
              label=curve_legend(curve), **marker)
    if curve.low is not None:
        axes.fill_between(curve.x, curve.low, curve.high, color=style.color,
                          alpha=0.07 if curve.faint else 0.2, linewidth=0)


PHASE_COLORS = ("#4c72b0", "#8da0cb", "#dd8452", "#937860", "#c44e52", "#da8bc3", "#55a868", "#8172b3",
                "#ccb974", "#8c8c8c")


def draw_phase_stack(axes, stack: PhaseStack) -> None:
    """Bars, one per iteration, cut into the phases' seconds, the first phase at the bottom."""
    bottom = [0.0] * len(stack.iterations)
    for i, (key, values) in enumerate(stack.seconds.items()):
        if not any(values):  # a phase this run never ran (its colour stays the phase's in every panel)
            continue
        axes.bar(stack.iterations, values, bottom=bottom, width=1.0, align="center", linewidth=0,
                 color=PHASE_COLORS[i % len(PHASE_COLORS)], label=key.removeprefix("time/"))
        bottom = [b + v for b, v in zip(bottom, values)]
    axes.set_title(f"{stack.label}: seconds per phase")
    axes.set_xlabel("iteration")
    axes.set_ylabel("s")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    axes.grid(alpha=0.3, axis="y")
    axes.legend(fontsize="x-small", ncols=2, reverse=True)  # top to bottom, as stacked


def default_out_path(run_dirs: Sequence[str | Path]) -> Path:
    """<run dir>/plot.png for one run, ./runs_comparison.png for several."""
    return Path(run_dirs[0]) / "plot.png" if len(run_dirs) == 1 else Path("runs_comparison.png")


def phase_keys(runs: Sequence[Run]) -> list[str]:
    """The time/* keys any run logged, in the order first seen, without time/elapsed."""
    keys: dict[str, None] = {}
    for run in runs:
        for row in run.rows:
            keys.update((k, None) for k in row if k.startswith("time/") and k != "time/elapsed")
    return list(keys)


def phase_figures(run: Run) -> dict[str, float | int | None]:
    """A run's figures for the phase table: iterations run, the first iteration (and its
    minutes) at which the 3-iteration success average reached 0.9 (None if never), mean
    seconds per iteration, and the mean seconds of each time/* phase over the iterations
    that logged it (time/validation only runs on validated iterations)."""
    minutes = elapsed_minutes(run.rows)
    figures: dict[str, float | int | None] = {
        "iterations": len(run.rows), "reached_iteration": None, "reached_minutes": None,
        "seconds_per_iteration": minutes[-1] * 60 / len(run.rows),
    }
    for i, row in enumerate(run.rows):
        if _has_number(row, MOVING_AVERAGE_KEY) and row[MOVING_AVERAGE_KEY] >= REACH_THRESHOLD:
            figures["reached_iteration"], figures["reached_minutes"] = row["iteration"], minutes[i]
            break
    for key in phase_keys([run]):
        values = [row[key] for row in run.rows if _has_number(row, key)]
        if values:
            figures[key] = sum(values) / len(values)
    return figures


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def group_phase_figures(runs: Sequence[Run]) -> dict[str, float | int | None]:
    """The mean of each run's figures; the reach columns average the runs that reached 0.9
    and `reached_runs` says how many did."""
    per_run = [phase_figures(run) for run in runs]
    reached = [f for f in per_run if f["reached_iteration"] is not None]
    figures: dict[str, float | int | None] = {
        "iterations": _mean([f["iterations"] for f in per_run]),
        "reached_iteration": _mean([f["reached_iteration"] for f in reached]),
        "reached_minutes": _mean([f["reached_minutes"] for f in reached]),
        "reached_runs": len(reached),
        "seconds_per_iteration": _mean([f["seconds_per_iteration"] for f in per_run]),
    }
    for key in phase_keys(runs):
        figures[key] = _mean([f[key] for f in per_run if key in f])
    return figures


def table_phase_keys(runs: Sequence[Run]) -> list[str]:
    """The table's time/* rows: the stacked phases bottom to top, the parts of the rollout
    after it, time/iteration last."""
    logged = phase_keys(runs)
    keys = []
    for key in stacked_phase_keys(runs):
        keys.append(key)
        if key == "time/rollout":
            keys += [part for part in ROLLOUT_PARTS if part in logged]
    return keys + [key for key in logged if key not in keys]


def phase_table(runs: Sequence[Run], average_seeds: bool = False) -> str:
    """A Markdown table, one column per run (or seed group, then each figure is the mean
    over its runs), one row per figure: see phase_figures."""
    groups = group_runs(runs, average_seeds)
    columns = [group_phase_figures(members) if len(members) > 1 else phase_figures(members[0])
               for _, members in groups]

    def reached(figures: dict, members: list) -> str:
        if figures["reached_iteration"] is None:
            return "not reached"
        text = f"{figures['reached_iteration']:.4g}"
        return text + (f" ({figures['reached_runs']}/{len(members)} runs)" if len(members) > 1 else "")

    table = [["iterations", *(f"{f['iterations']:.4g}" for f in columns)],
             [f"first iteration avg3 >= {REACH_THRESHOLD:g}",
              *(reached(f, members) for f, (_, members) in zip(columns, groups))],
             ["at minutes", *("-" if f["reached_minutes"] is None else f"{f['reached_minutes']:.2f}" for f in columns)],
             ["s / iteration", *(f"{f['seconds_per_iteration']:.2f}" for f in columns)]]
    for key in table_phase_keys(runs):
        name = f"{key} (s)" if key not in ROLLOUT_PARTS else f"{key} (s, part of time/rollout)"
        table.append([name, *("-" if f.get(key) is None else f"{f[key]:.2f}" for f in columns)])
    header = ["", *(label for label, _ in groups)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in table)])
