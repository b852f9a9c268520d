"""`megatron-agent plot`: curves, stacked phase seconds and the table from hand-written
metrics.jsonl files (and rows made by the driver's own iteration_row)."""

from __future__ import annotations

import json
import logging

import pytest
from PIL import Image

from megatron_agent.cli import main
from megatron_agent.plot import (
    DEFAULT_KEYS,
    elapsed_minutes,
    group_runs,
    load_runs,
    phase_figures,
    phase_table,
    plot_runs,
    seed_group_name,
)


def write_run(parent, name, rows, tail=""):
    run_dir = parent / name
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + tail)
    (run_dir / "config.json").write_text(json.dumps({"run_dir": str(run_dir), "seed": 0}))
    return run_dir


def make_rows(successes, seconds_per_iteration=30.0, val_every=2, validation_s=4.0):
    """Rows as the driver writes them, with round numbers: 10 s rollout, 5 s update, 1 s sync."""
    rows = []
    for i, success in enumerate(successes):
        window = successes[max(0, i - 2):i + 1]
        row = {"iteration": i, "time/elapsed": seconds_per_iteration * (i + 1),
               "train/success_rate": success, "train/success_moving_average": sum(window) / len(window),
               "train/episode_length": 10.0 - i, "train/invalid_action_rate": 0.5 / (i + 1),
               "actor/pg_loss": 0.1, "time/rollout": 10.0 + i, "time/update": 5.0, "time/weight_sync": 1.0}
        if (i + 1) % val_every == 0:
            row["val/success_rate"] = success / 2
            row["time/validation"] = validation_s * (i + 1)
        rows.append(row)
    return rows


def panel(drawn, key, label, series_key=None):
    (curve,) = [c for c in drawn.panels[key] if c.label == label and c.key == (series_key or key)]
    return curve


def test_png_is_written_and_curves_equal_the_metrics(tmp_path):
    rows_a = make_rows([0.0, 0.5, 1.0, 1.0])
    rows_b = make_rows([0.25, 0.25, 0.5], seconds_per_iteration=60.0)
    runs = load_runs([write_run(tmp_path, "gigpo", rows_a), write_run(tmp_path, "grpo", rows_b)])
    assert [run.label for run in runs] == ["gigpo", "grpo"]

    out = tmp_path / "out" / "curves.png"
    panels = plot_runs(runs, out)
    assert out.stat().st_size > 10_000
    with Image.open(out) as image:
        assert image.format == "PNG" and image.width > 400 and image.height > 300
    assert list(panels.panels) == list(DEFAULT_KEYS)

    raw = panel(panels, "train/success_rate", "gigpo")
    assert raw.faint and raw.x == [0, 1, 2, 3] and raw.y == [0.0, 0.5, 1.0, 1.0]
    smooth = panel(panels, "train/success_rate", "gigpo", "train/success_moving_average")
    assert not smooth.faint and smooth.y == pytest.approx([0.0, 0.25, 0.5, 2.5 / 3])
    val = panel(panels, "val/success_rate", "grpo")
    assert val.x == [1] and val.y == [0.125]  # only the validated rows
    length = panel(panels, "train/episode_length", "grpo")
    assert length.x == [0, 1, 2] and length.y == [10.0, 9.0, 8.0] and length.low is None
    invalid = panel(panels, "train/invalid_action_rate", "gigpo")
    assert invalid.y == pytest.approx([0.5, 0.25, 0.5 / 3, 0.125])


def test_minutes_on_x_and_a_resumed_clock(tmp_path):
    runs = load_runs([write_run(tmp_path, "run", make_rows([0.1, 0.2, 0.3], seconds_per_iteration=90.0))])
    panels = plot_runs(runs, tmp_path / "m.png", keys=["train/episode_length"], x="minutes")
    assert list(panels.panels) == ["train/episode_length"]
    assert panels.panels["train/episode_length"][0].x == pytest.approx([1.5, 3.0, 4.5])
    # a resume restarts time/elapsed from zero; the minutes keep counting from where it stopped
    resumed = [{"time/elapsed": 60}, {"time/elapsed": 120}, {"time/elapsed": 30}, {"time/elapsed": 90}]
    assert elapsed_minutes(resumed) == pytest.approx([1.0, 2.0, 2.5, 3.5])


@pytest.mark.parametrize("label, group", [("gigpo-seed0", "gigpo"), ("gigpo_s1", "gigpo"), ("gigpo-s12", "gigpo"),
                                          ("gigpo-seed", "gigpo-seed"), ("gigpo-lr1e-3", "gigpo-lr1e-3"),
                                          ("run_s", "run_s")])
def test_seed_suffix(label, group):
    assert seed_group_name(label) == group


def test_seed_average_is_mean_min_max_over_common_iterations(tmp_path):
    dirs = [write_run(tmp_path, "gigpo-seed0", make_rows([0.0, 0.5, 1.0, 1.0])),
            write_run(tmp_path, "gigpo_s1", make_rows([0.5, 0.5, 0.5, 0.75], seconds_per_iteration=60.0)),
            write_run(tmp_path, "gigpo-s2", make_rows([1.0, 0.0, 0.25])),  # stopped after iteration 2
            write_run(tmp_path, "grpo-seed0", make_rows([0.25, 0.25]))]
    runs = load_runs(dirs)
    assert [(label, [r.label for r in members]) for label, members in group_runs(runs, average_seeds=True)] == [
        ("gigpo (3 seeds)", ["gigpo-seed0", "gigpo_s1", "gigpo-s2"]), ("grpo", ["grpo-seed0"])]

    panels = plot_runs(runs, tmp_path / "avg.png", average_seeds=True)
    raw = panel(panels, "train/success_rate", "gigpo (3 seeds)")
    assert raw.x == [0, 1, 2]  # iteration 3: seed 2 had stopped
    assert raw.y == pytest.approx([0.5, 1 / 3, 1.75 / 3])
    assert raw.low == [0.0, 0.0, 0.25] and raw.high == [1.0, 0.5, 1.0]
    length = panel(panels, "train/episode_length", "gigpo (3 seeds)")
    assert length.y == pytest.approx([10.0, 9.0, 8.0]) and length.low == length.high == [10.0, 9.0, 8.0]
    # validated at iteration 1 only, among the common ones: success / 2 of each seed
    val = panel(panels, "val/success_rate", "gigpo (3 seeds)")
    assert val.x == [1] and val.y == pytest.approx([(0.25 + 0.25 + 0.0) / 3])
    assert val.low == [0.0] and val.high == [0.25]
    assert panel(panels, "train/success_rate", "grpo").y == [0.25, 0.25]  # a group of one: the run itself

    minutes = plot_runs(runs, tmp_path / "avg_min.png", keys=["train/episode_length"], x="minutes",
                        average_seeds=True)
    # mean over the seeds of (0.5, 1.0, 0.5) minutes per iteration
    assert panel(minutes, "train/episode_length", "gigpo (3 seeds)").x == pytest.approx([2 / 3, 4 / 3, 2.0])


def test_phase_table_figures(tmp_path):
    reached = write_run(tmp_path, "fast", make_rows([0.5, 1.0, 1.0, 1.0, 1.0], seconds_per_iteration=30.0))
    never = write_run(tmp_path, "slow", make_rows([0.0, 0.5, 0.5], seconds_per_iteration=12.0, val_every=10))
    runs = load_runs([reached, never])

    fast = phase_figures(runs[0])
    # moving averages 0.5, 0.75, 0.833, 1.0: first >= 0.9 at iteration 3, 4 x 30 s = 2 minutes
    assert fast["iterations"] == 5 and fast["reached_iteration"] == 3 and fast["reached_minutes"] == 2.0
    assert fast["seconds_per_iteration"] == pytest.approx(30.0)
    assert fast["time/rollout"] == pytest.approx(12.0)  # 10, 11, 12, 13, 14
    assert fast["time/update"] == 5.0 and fast["time/weight_sync"] == 1.0
    assert fast["time/validation"] == pytest.approx((8.0 + 16.0) / 2)  # iterations 1 and 3 only
    assert "time/elapsed" not in fast
    slow = phase_figures(runs[1])
    assert slow["reached_iteration"] is None and "time/validation" not in slow

    lines = phase_table(runs).splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == ["", "fast", "slow"]
    assert set(lines[1]) <= set("|-")
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert list(rows) == ["iterations", "first iteration avg3 >= 0.9", "at minutes", "s / iteration",
                          "time/rollout (s)", "time/update (s)", "time/weight_sync (s)", "time/validation (s)"]
    assert rows == {"iterations": ["5", "3"], "first iteration avg3 >= 0.9": ["3", "not reached"],
                    "at minutes": ["2.00", "-"], "s / iteration": ["30.00", "12.00"],
                    "time/rollout (s)": ["12.00", "11.00"], "time/update (s)": ["5.00", "5.00"],
                    "time/weight_sync (s)": ["1.00", "1.00"], "time/validation (s)": ["12.00", "-"]}


def test_phase_table_of_a_seed_group(tmp_path):
    dirs = [write_run(tmp_path, "a-seed0", make_rows([1.0, 1.0, 1.0, 1.0], seconds_per_iteration=30.0)),
            write_run(tmp_path, "a-seed1", make_rows([0.5, 1.0, 1.0, 1.0, 1.0], seconds_per_iteration=60.0)),
            write_run(tmp_path, "a-seed2", make_rows([0.0, 0.0], seconds_per_iteration=90.0))]
    lines = phase_table(load_runs(dirs), average_seeds=True).splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == ["", "a (3 seeds)"]
    column = [[c.strip() for c in line.strip("|").split("|")][1] for line in lines[2:]]
    # reached at iterations 0 (0.5 min) and 3 (4 min); iterations (4 + 5 + 2) / 3; rollout (11.5 + 12 + 10.5) / 3
    assert column[:5] == [f"{11 / 3:.4g}", "1.5 (2/3 runs)", "2.25", "60.00", f"{34 / 3:.2f}"]


def test_truncated_last_line_is_tolerated(tmp_path):
    run_dir = write_run(tmp_path, "killed", make_rows([0.1, 0.2, 0.3]), tail='{"iteration": 3, "time/ela')
    (run,) = load_runs([run_dir])
    assert [row["iteration"] for row in run.rows] == [0, 1, 2]
    panels = plot_runs([run], tmp_path / "k.png")
    assert panel(panels, "train/success_rate", "killed").x == [0, 1, 2]


def test_default_key_no_run_has_is_skipped_with_a_warning(tmp_path, caplog):
    rows = [{k: v for k, v in row.items() if k != "val/success_rate"} for row in make_rows([0.1, 0.2])]
    runs = load_runs([write_run(tmp_path, "noval", rows)])
    with caplog.at_level(logging.WARNING, logger="megatron_agent.plot"):
        panels = plot_runs(runs, tmp_path / "p.png")
    assert "val/success_rate" not in panels.panels and len(panels.panels) == 3
    assert "val/success_rate" in caplog.text


def test_unknown_key_is_an_error_naming_it(tmp_path, capsys):
    run_dir = write_run(tmp_path, "run", make_rows([0.1, 0.2]))
    with pytest.raises(ValueError, match="train/nope"):
        plot_runs(load_runs([run_dir]), tmp_path / "p.png", keys=["train/episode_length", "train/nope"])
    assert main(["plot", str(run_dir), "--keys", "train/episode_length,train/nope"]) == 2
    assert "train/nope" in capsys.readouterr().err
    assert not (run_dir / "plot.png").exists()


def test_cli_errors_name_the_path(tmp_path, capsys):
    missing = tmp_path / "no_such_run"
    assert main(["plot", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err

    no_metrics = tmp_path / "bare"
    no_metrics.mkdir()
    assert main(["plot", str(no_metrics)]) == 2
    assert str(no_metrics) in capsys.readouterr().err

    empty = write_run(tmp_path, "empty", [])
    assert main(["plot", str(empty)]) == 2
    assert str(empty) in capsys.readouterr().err


def test_cli_writes_the_png_and_prints_the_table(tmp_path, capsys, monkeypatch):
    one = write_run(tmp_path, "one", make_rows([1.0, 1.0, 1.0]))
    assert main(["plot", str(one)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {one / 'plot.png'}" in out and "|  | one |" in out and "| first iteration avg3 >= 0.9 | 0 |" in out
    with Image.open(one / "plot.png") as image:
        assert image.format == "PNG"

    two = write_run(tmp_path, "two", make_rows([0.0, 0.0]))
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(one), str(two), "--x", "minutes"]) == 0
    assert "wrote runs_comparison.png" in capsys.readouterr().out
    assert (tmp_path / "runs_comparison.png").stat().st_size > 10_000

    assert main(["plot", str(one), str(two), "--out", str(tmp_path / "c" / "x.png"), "--average-seeds"]) == 0
    assert (tmp_path / "c" / "x.png").exists()


def driver_rows(phase_seconds: list[dict[str, float]], iteration_seconds: list[float]) -> list[dict]:
    """Rows as the driver's own iteration_row builds them from a PhaseTimer's seconds (its
    time/other is what the named phases leave of the iteration)."""
    from megatron_agent.iteration_metrics import PhaseTimer, iteration_row

    rows, elapsed = [], 0.0
    for i, (seconds, total) in enumerate(zip(phase_seconds, iteration_seconds)):
        timer = PhaseTimer()
        timer.seconds = {f"time/{k}": v for k, v in seconds.items()}
        timer.elapsed = lambda total=total: total
        elapsed += total
        rollout = {"rollout/success_rate": 0.5, "rollout/episode_length": 3.0, "rollout/invalid_action_rate": 0.1,
                   "rollout/time_s": seconds["rollout"], "rollout/time_generate_s": 0.6 * seconds["rollout"],
                   "rollout/time_env_s": 0.1 * seconds["rollout"], "rollout/overhead_share": 0.3}
        rows.append(iteration_row(i, timer, rollout, {}, tokens=100.0, elapsed=elapsed, successes=[0.5] * (i + 1),
                                  restarts=0))
    return rows


def test_phase_seconds_are_stacked_per_iteration_and_add_up_to_it(tmp_path):
    phases = [{"rollout": 2.0, "advantages": 0.1, "update": 1.0, "weight_sync": 0.2},
              {"rollout": 1.5, "advantages": 0.1, "update": 1.2, "weight_sync": 0.2, "validation": 3.0},
              {"rollout": 1.0, "advantages": 0.1, "update": 0.9, "weight_sync": 0.2, "checkpoint": 2.5}]
    rows = driver_rows(phases, [3.5, 6.5, 5.0])
    drawn = plot_runs(load_runs([write_run(tmp_path, "run", rows)]), tmp_path / "p.png")
    (stack,) = drawn.phases
    assert stack.label == "run" and stack.iterations == [0, 1, 2]
    # bottom to top; generate and env are parts of the rollout, not phases of their own
    assert list(stack.seconds) == ["time/rollout", "time/advantages", "time/update", "time/weight_sync",
                                   "time/validation", "time/checkpoint", "time/other"]
    assert stack.seconds["time/validation"] == [0.0, 3.0, 0.0] and stack.seconds["time/checkpoint"] == [0, 0, 2.5]
    tops = [sum(values[i] for values in stack.seconds.values()) for i in range(3)]
    assert [row["time/iteration"] for row in rows] == [3.5, 6.5, 5.0]
    assert tops == pytest.approx([3.5, 6.5, 5.0])
    # drawn as bars, one per iteration and phase that ran, each starting where the one below ended
    axes = drawn.figure.axes[-1]
    assert axes.get_title() == "run: seconds per phase"
    bars = [(round(p.get_x() + p.get_width() / 2), p.get_y(), p.get_height()) for p in axes.patches if p.get_height()]
    for i, top in enumerate(tops):
        mine = sorted((y, h) for x, y, h in bars if x == i)
        assert mine[0][0] == 0 and all(a[0] + a[1] == pytest.approx(b[0]) for a, b in zip(mine, mine[1:]))
        assert mine[-1][0] + mine[-1][1] == pytest.approx(top)


def test_phase_stack_of_a_seed_group_is_the_mean_and_an_absent_phase_counts_zero(tmp_path):
    a = driver_rows([{"rollout": 2.0, "update": 1.0}, {"rollout": 2.0, "update": 1.0, "validation": 4.0}], [3.0, 7.0])
    b = driver_rows([{"rollout": 1.0, "update": 3.0}], [4.0])  # stopped after iteration 0, never validated
    drawn = plot_runs(load_runs([write_run(tmp_path, "x-seed0", a), write_run(tmp_path, "x-seed1", b)]),
                      tmp_path / "p.png", average_seeds=True)
    (stack,) = drawn.phases
    assert stack.label == "x (2 seeds)" and stack.iterations == [0]
    assert stack.seconds["time/rollout"] == [1.5] and stack.seconds["time/update"] == [2.0]
    assert stack.seconds["time/validation"] == [0.0]


def test_every_line_is_in_its_legend_and_iterations_are_whole_numbers(tmp_path):
    runs = load_runs([write_run(tmp_path, "a", make_rows([0.0, 0.5, 1.0])),
                      write_run(tmp_path, "b", make_rows([0.5, 0.5, 0.5]))])
    drawn = plot_runs(runs, tmp_path / "p.png")
    metric_axes = drawn.figure.axes[:len(drawn.panels)]
    for axes, (key, curves) in zip(metric_axes, drawn.panels.items()):
        lines = [line.get_label() for line in axes.get_lines()]
        assert len(lines) == len(curves) and not any(label.startswith("_") for label in lines), key
        assert [t.get_text() for t in axes.get_legend().get_texts()] == lines, key
        ticks = [t for t in axes.get_xticks() if axes.get_xlim()[0] <= t <= axes.get_xlim()[1]]
        assert ticks and all(t == int(t) for t in ticks), (key, ticks)  # 3 iterations: no 0.25, 0.5, ...
    success = [line.get_label() for line in metric_axes[0].get_lines()]
    assert success == ["a: 3-iteration average", "a: per iteration", "b: 3-iteration average", "b: per iteration"]
    for axes in drawn.figure.axes[len(drawn.panels):]:  # the phase panels
        assert {t.get_text() for t in axes.get_legend().get_texts()} == {"rollout", "update", "weight_sync",
                                                                         "validation"}
        assert all(t == int(t) for t in axes.get_xticks())


def count_color(png, rgb, tolerance=40) -> int:
    import numpy as np

    with Image.open(png) as image:
        pixels = np.asarray(image.convert("RGB")).astype(int)
    return int((np.abs(pixels - np.array(rgb)).sum(axis=-1) < tolerance).sum())


def test_runs_with_the_same_values_both_show(tmp_path):
    """Drawn over the first run, a second with the same values must leave the first
    visible (not hide it, as one solid line of equal width over another did)."""
    from matplotlib.colors import to_rgb

    rows = [{k: v for k, v in row.items() if not k.startswith("time/")} for row in make_rows([0.1, 0.4, 0.3, 0.9])]
    first = [round(255 * c) for c in to_rgb("C0")]
    alone = plot_runs(load_runs([write_run(tmp_path, "first", rows)]), tmp_path / "alone.png",
                      keys=["train/episode_length"])
    both = plot_runs(load_runs([tmp_path / "first", write_run(tmp_path, "second", rows)]), tmp_path / "both.png",
                     keys=["train/episode_length"])
    assert both.panels["train/episode_length"][0].y == both.panels["train/episode_length"][1].y
    assert alone.figure.axes[0].get_lines()[0].get_color() == "C0"
    # the first run's colour still covers a good part of what it covered alone
    assert count_color(tmp_path / "both.png", first) > 0.2 * count_color(tmp_path / "alone.png", first)


def test_gigpo_diagnostics_get_panels_where_a_run_has_them(tmp_path, caplog):
    from megatron_agent.plot import GIGPO_KEYS

    gigpo = make_rows([0.1, 0.3])
    for i, row in enumerate(gigpo):
        row.update({"gigpo/shared_state_fraction": 0.2 + i, "gigpo/step_to_episode_abs": 0.5,
                    "gigpo/sign_disagreement": 0.1})
    runs = load_runs([write_run(tmp_path, "gigpo", gigpo), write_run(tmp_path, "grpo", make_rows([0.2, 0.2]))])
    with caplog.at_level(logging.WARNING):
        drawn = plot_runs(runs, tmp_path / "both.png")
    assert list(drawn.panels) == [*DEFAULT_KEYS, *GIGPO_KEYS]
    assert panel(drawn, "gigpo/shared_state_fraction", "gigpo").y == [0.2, 1.2]
    assert not [c for c in drawn.panels["gigpo/shared_state_fraction"] if c.label == "grpo"]
    assert "gigpo/" not in caplog.text  # a run without them is no reason to warn
    assert list(plot_runs(runs[1:], tmp_path / "grpo.png").panels) == list(DEFAULT_KEYS)
