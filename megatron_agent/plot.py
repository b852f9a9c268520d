"""Curves and a phase table comparing training runs: `megatron-agent plot RUN_DIR ...`.

Everything here reads run directories (their metrics.jsonl) and returns plain data; only
`plot_runs` draws, and it returns the curves it drew so they can be checked without pixels.

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

from megatron_agent.run_dir import read_metrics

log = logging.getLogger(__name__)

SUCCESS_KEY = "train/success_rate"
MOVING_AVERAGE_KEY = "train/success_moving_average"
DEFAULT_KEYS = (SUCCESS_KEY, "val/success_rate", "train/episode_length", "train/invalid_action_rate")
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
            series_keys = [SUCCESS_KEY, MOVING_AVERAGE_KEY]
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


def plot_runs(runs: Sequence[Run], out_png: str | Path, keys: Sequence[str] | None = None,
              x: str = "iteration", average_seeds: bool = False) -> dict[str, list[Curve]]:
    """Write one panel per metric key to `out_png`; return the curves drawn, by key.

    keys=None plots DEFAULT_KEYS and skips (with a warning) those no run has; keys named
    explicitly must each be in some run, else ValueError naming the missing ones."""
    if x not in ("iteration", "minutes"):
        raise ValueError(f"x must be 'iteration' or 'minutes', not {x!r}")
    wanted = list(DEFAULT_KEYS if keys is None else keys)
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
    colors = {label: f"C{i % 10}" for i, (label, _) in enumerate(groups)}

    panels = {key: panel_curves(runs, key, x, average_seeds) for key in present}
    columns = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(6.5 * columns, 4 * rows), layout="constrained")
    FigureCanvasAgg(figure)  # Agg renders the PNG without a display and without pyplot's global state
    for index, (key, curves) in enumerate(panels.items()):
        axes = figure.add_subplot(rows, columns, index + 1)
        for curve in curves:
            color = colors[curve.label]
            sparse = key.startswith("val/")
            axes.plot(curve.x, curve.y, "o-" if sparse else "-", color=color, markersize=3,
                      alpha=0.3 if curve.faint else 1.0, linewidth=1 if curve.faint else 1.8,
                      label="_nolegend_" if curve.faint else curve.label)
            if curve.low is not None:
                axes.fill_between(curve.x, curve.low, curve.high, color=color,
                                  alpha=0.07 if curve.faint else 0.2, linewidth=0)
        axes.set_title(key)
        axes.set_xlabel(x)
        axes.grid(alpha=0.3)
        if curves:
            axes.legend(fontsize="small")
        else:
            axes.text(0.5, 0.5, "no iteration common to a group's runs", ha="center", transform=axes.transAxes)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_png, dpi=100)
    return panels


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


def phase_table(runs: Sequence[Run], average_seeds: bool = False) -> str:
    """A Markdown table, one row per run (or seed group, then each column is the mean over
    its runs): see phase_figures."""
    phases = phase_keys(runs)
    header = ["run", "iterations", f"first iteration avg3 >= {REACH_THRESHOLD:g}", "at minutes",
              "s / iteration", *(f"{key} (s)" for key in phases)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, members in group_runs(runs, average_seeds):
        figures = group_phase_figures(members) if len(members) > 1 else phase_figures(members[0])
        if figures["reached_iteration"] is None:
            reached, at_minutes = "not reached", "-"
        else:
            reached = f"{figures['reached_iteration']:.4g}"
            if len(members) > 1:
                reached += f" ({figures['reached_runs']}/{len(members)} runs)"
            at_minutes = f"{figures['reached_minutes']:.2f}"
        cells = [label, f"{figures['iterations']:.4g}", reached, at_minutes,
                 f"{figures['seconds_per_iteration']:.2f}",
                 *("-" if figures.get(key) is None else f"{figures[key]:.2f}" for key in phases)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
