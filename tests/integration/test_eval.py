"""`megatron-agent eval` as a user runs it: a short CPU training saves a checkpoint, then
`megatron-agent eval --checkpoint RUN --compare RUN/model` (its `main`) scores the trained checkpoint and the untrained
model on the same held-out tasks and sampling seeds, on NumberLine (the CPU job) and on
the visual quiz (a tiny VLM: images through the prompts); and bad input refused before
anything starts (docs/evaluation.md)."""

from __future__ import annotations

import json
import logging
from fractions import Fraction
from itertools import combinations
from types import SimpleNamespace

import pytest

from envs import validation_seed
from megatron_agent.cli import main
from megatron_agent.platform.launch import run_on_ranks

NUM_TASKS, NUM_SAMPLES = 16, 4
# The cheapest training measured to beat the untrained model on every seed tried (0-4), and
# the margin asserted (success of the checkpoint minus the untrained model's, over the same
# 16 tasks x 4 samples), well inside the smallest measured (docs/evaluation.md): NumberLine
# at 3x the CPU job's lr; the visual quiz with 2 colours (4 in its experiment) at 10x.
ITERATIONS = 8
TRAININGS = {
    "numberline": (["actor.lr=3e-3", "val_every=0"], 0.15),
    # with the training's greedy validation at the last iteration, to compare eval's with (on
    # one env: the budget; the visual one, whose images make the longer path)
    "visual_quiz": (["+experiment=visual-quiz", "actor.lr=1e-2", "env_config.num_choices=2",
                     f"val_every={ITERATIONS}"], 0.2),
}
QUIET = ["samples_every=0", "stop_success=null", f"iterations={ITERATIONS}", f"save_every={ITERATIONS}"]


def _train_then_eval(overrides: list[str], evals: list[list[str]]) -> list[tuple[int, str, str]]:
    """The training, then each `megatron-agent eval` of `evals` in the same process (its
    imports done once): the exit code, stdout and stderr of each command."""
    import contextlib
    import io

    from megatron_agent.driver import train
    from megatron_agent.platform import shutdown_distributed
    from megatron_agent.run_config import load_run_config

    train(load_run_config(overrides))
    shutdown_distributed()  # the trainer's process group: the conversion starts its own
    done = []
    for args in evals:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["eval", *args])
        done.append((code, out.getvalue(), err.getvalue()))
    return done


@pytest.fixture(scope="module", params=sorted(TRAININGS))
def scored(request, tmp_path_factory):
    """One short training with a checkpoint at its end, then `eval --compare` of that
    checkpoint against the run's untrained model (and, where the run validated, `eval` of the
    checkpoint alone with one greedy sample a task); shared by the tests of an env."""
    env = request.param
    overrides, margin = TRAININGS[env]
    run = tmp_path_factory.mktemp(env)
    out, greedy = run / "scored", run / "greedy"
    evals = [["--checkpoint", str(run), "--compare", str(run / "model"), "--num-samples", str(NUM_SAMPLES),
              "--num-tasks", str(NUM_TASKS), "--out", str(out)]]
    validates = f"val_every={ITERATIONS}" in overrides
    if validates:
        evals.append(["--checkpoint", str(run), "--out", str(greedy)])
    done = run_on_ranks(_train_then_eval, 1, [f"run_dir={run}", *overrides, *QUIET], evals, timeout_s=600)[0]
    for code, _, stderr in done:
        assert code == 0, stderr
    return SimpleNamespace(env=env, run=run, out=out, margin=margin, stdout=done[0][1],
                           data=json.loads((out / "eval.json").read_text()),
                           greedy=json.loads((greedy / "eval.json").read_text()) if validates else None)


def brute_force_pass_at_k(n: int, c: int, k: int) -> Fraction:
    subsets = list(combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


@pytest.mark.slow
@pytest.mark.multirank
def test_the_trained_checkpoint_scores_higher_than_the_untrained_model(scored):
    data = scored.data
    trained, untrained = data["models"]
    assert trained["label"] == f"{scored.run} (iter_{ITERATIONS:06d})" and trained["kind"] == "megatron checkpoint"
    assert untrained["label"] == str(scored.run / "model") and untrained["kind"] == "hf model"
    assert data["env"] == scored.env and data["split"] == "validation"
    # the same held-out tasks for both: the validation seed range
    assert data["seeds"] == [validation_seed(i) for i in range(NUM_TASKS)]
    for model in (trained, untrained):
        assert [t["seed"] for t in model["tasks"]] == data["seeds"]
        assert model["metrics"]["num_episodes"] == NUM_TASKS * NUM_SAMPLES
    gain = trained["metrics"]["success_rate"] - untrained["metrics"]["success_rate"]
    assert gain >= scored.margin, (trained["metrics"], untrained["metrics"])


@pytest.mark.slow
@pytest.mark.multirank
def test_pass_at_k_rises_with_k_and_is_the_estimator_over_the_tasks(scored):
    for model in scored.data["models"]:
        metrics, tasks = model["metrics"], model["tasks"]
        curve = [metrics[f"pass@{k}"] for k in range(1, NUM_SAMPLES + 1)]
        assert all(a <= b for a, b in zip(curve, curve[1:])), curve
        assert curve[0] == pytest.approx(metrics["success_rate"])  # every task has its 4 samples
        for k, value in enumerate(curve, 1):  # the mean over tasks of the share of k-subsets with a win
            expected = sum(brute_force_pass_at_k(t["samples"], t["wins"], k) for t in tasks) / len(tasks)
            assert value == pytest.approx(float(expected), abs=1e-9)
    trained = scored.data["models"][0]["metrics"]
    assert trained[f"pass@{NUM_SAMPLES}"] > trained["pass@1"]  # sampled answers differ: more tries win more


@pytest.mark.slow
@pytest.mark.multirank
def test_the_comparison_table_and_json(scored):
    data, run = scored.data, scored.run
    table = (scored.out / "eval.md").read_text()
    assert table in scored.stdout  # printed as written
    lines = table.splitlines()
    assert lines[2] == f"| metric | {run} (iter_{ITERATIONS:06d}) | {run / 'model'} |"
    rows = {line.split(" | ")[0].lstrip("| "): line.strip("|").split(" | ")[1:] for line in lines[4:]}
    for name in ("success rate", f"success rate: {scored.env}", *(f"pass@{k}" for k in range(1, NUM_SAMPLES + 1)),
                 "mean steps", "invalid-action rate", "prompt tokens", "response tokens"):
        assert len(rows[name]) == 2 and all(cell.strip() not in ("", "–") for cell in rows[name]), name
    assert rows["success rate"][0].strip() == f"{data['models'][0]['metrics']['success_rate']:.3f}"
    # several samples a task: the training sampling (temperature 1 in both jobs), the training prompts
    trained = json.loads((run / "config.json").read_text())
    assert data["sampling"] == trained["loop"]["sampling"] and data["sampling"]["temperature"] == 1.0
    assert data["loop"]["prompt"] == trained["loop"]["prompt"] and data["env_config"] == trained["env_config"]
    assert data["configuration"] == str(run / "config.json")
    for model in data["models"]:
        metrics = model["metrics"]
        assert metrics["prompt_tokens"] > 0 and metrics["response_tokens"] > 0 and metrics["episode_length"] >= 1
        assert 0 <= metrics["invalid_action_rate"] <= 1 and metrics["failed_episodes"] == 0
    if scored.env == "visual_quiz":  # the visual job's settings, not configs/' defaults: images, a tiny VLM
        assert data["env_config"]["render_image"] is True and data["env_config"]["num_choices"] == 2
        assert trained["tiny_model"]["family"] == "qwen2_5_vl"


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("scored", ["visual_quiz"], indirect=True)  # the run that validates (the budget)
def test_one_greedy_sample_a_task_is_the_training_s_validation(scored):
    """The same agent loop, prompts, sampling and seeds as training: eval's default (one
    sample, the validation sampling, loop.validation.num_episodes tasks) of the last
    checkpoint gives the figures the run's validation gave on the same weights (the engine
    served them synced from the trainer then, converted from the checkpoint now; fp32)."""
    validation = [json.loads(line) for line in (scored.run / "metrics.jsonl").read_text().splitlines()][-1]
    assert validation["iteration"] == ITERATIONS - 1 and validation["val/num_episodes"] == NUM_TASKS
    (model,) = scored.greedy["models"]
    assert scored.greedy["num_samples"] == 1 and scored.greedy["sampling"]["temperature"] == 0.0
    for key in ("success_rate", "episode_length", "invalid_action_rate", "prompt_length", "response_length",
                f"success_rate/{scored.env}"):
        assert model["metrics"][key] == pytest.approx(validation[f"val/{key}"], abs=1e-9), key


# -- bad input: refused before any engine starts, exit code 2 ---------------------------------


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "{tmp}/missing"], "{tmp}/missing: no such file or directory"),
    (["--checkpoint", "{tmp}/empty"], "{tmp}/empty: neither a Megatron checkpoint"),
    (["--checkpoint", "{model}", "--split", "valid_unseen"],
     "--split 'valid_unseen': env=numberline has the splits validation, train"),
    (["--checkpoint", "{model}", "env_config.max_positon=3"], "bad configuration"),
    (["--checkpoint", "{model}", "--num-samples", "0"], "--num-samples 0"),
    (["--compare", "{model}"], "give --checkpoint too"),
    ([], "nothing to score"),
])
def test_bad_input_is_refused_before_anything_starts(tmp_path, tiny_model_dir, capsys, args, message):
    (tmp_path / "empty").mkdir()
    model = tiny_model_dir("qwen3")
    fill = {"tmp": tmp_path, "model": model}
    root = logging.getLogger()
    level = root.level
    try:
        code = main(["eval", *(a.format(**fill) for a in args), "--out", str(tmp_path / "out")])
    finally:
        root.setLevel(level)  # main sets the command's log level
    assert code == 2
    assert message.format(**fill) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written, no engine started
