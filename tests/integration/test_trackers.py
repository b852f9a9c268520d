"""W&B (offline) and MLflow (a file store) fed by a real CPU run, resumed, and read back with
each package's own reader: MLflow's MlflowClient, W&B's transaction-log inspector
(`wandb leet inspect`, text protos parsed into wandb's own Record messages)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_agent.platform.launch import run_on_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # a spawned trainer rank plus an engine process

SMALL = ["num_groups=2", "group_size=2", "stop_success=null", "val_every=0", "loop.max_steps=3", "samples_every=1",
         "save_every=3", "logging.backends=[tensorboard,wandb,mlflow]", "logging.wandb_mode=offline"]


def _run(overrides: list[str]) -> list[dict]:
    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    return train(load_run_config(overrides))


def _run_with_mlflow_failing_at(overrides: list[str], failing: int) -> tuple[list[dict], list[str]]:
    """The run, with MLflow's log raising at iteration `failing`; its rows and the trackers' warnings."""
    import logging

    from megatron_agent import trackers

    def log(self, row, log=trackers.MlflowTracker.log):
        if row["iteration"] == failing:
            raise OSError("the store's disk is full")
        log(self, row)

    trackers.MlflowTracker.log = log
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("megatron_agent.trackers").addHandler(handler)
    return _run(overrides), warned


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """3 iterations with both trackers (a checkpoint at 3), then resumed for 2 more, in which
    MLflow fails at the last: the run directory after each part, what each part returned."""
    mp = pytest.MonkeyPatch()
    for name in ("WANDB_MODE", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        mp.delenv(name, raising=False)  # the defaults; the tracker opts in to the file store itself
    run_dir = tmp_path_factory.mktemp("tracked")
    try:
        first = run_on_ranks(_run, 1, [f"run_dir={run_dir}", "iterations=3", *SMALL], timeout_s=300)[0]
        after_first = _snapshot(run_dir)
        resumed, warned = run_on_ranks(_run_with_mlflow_failing_at, 1,
                                       [f"run_dir={run_dir}", f"resume={run_dir}", f"model_dir={run_dir / 'model'}",
                                        "iterations=5", *SMALL], 4, timeout_s=300)[0]
    finally:
        mp.undo()
    return {"run_dir": run_dir, "first": first, "after_first": after_first, "resumed": resumed, "warned": warned}


def _snapshot(run_dir: Path) -> dict:
    """What the first part left: its tracker ids, MLflow's view and W&B's records."""
    ids = json.loads((run_dir / "trackers.json").read_text())
    return {"ids": ids, "config": json.loads((run_dir / "config.json").read_text()),
            "mlflow": _mlflow_view(run_dir, ids["mlflow"]["run_id"]),
            "wandb": _wandb_fragments(run_dir, ids["wandb"]["run_id"])}


def _mlflow_view(run_dir: Path, run_id: str) -> dict:
    """What MLflow's client reads of the run in run_dir/mlruns, the file store (MLflow 3 reads
    it only with MLFLOW_ALLOW_FILE_STORE; set here for the read, not for the runs)."""
    from mlflow import MlflowClient
    from mlflow.artifacts import load_text

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
        run = client.get_run(run_id)
        metrics = {key: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key),
                                                            key=lambda m: (m.step, m.timestamp))]
                   for key in run.data.metrics}
        samples = sorted(f.path for f in client.list_artifacts(run_id, "samples"))
        return {"status": run.info.status, "params": dict(run.data.params), "metrics": metrics,
                "experiment": client.get_experiment(run.info.experiment_id).name, "name": run.info.run_name,
                "samples": samples, "sample_1": load_text(f"{run.info.artifact_uri}/samples/iter_000001.txt")}


def _wandb_records(path: Path) -> list:
    """The records of a .wandb transaction log, as W&B's own inspector prints them."""
    from google.protobuf import text_format
    from wandb.proto import wandb_internal_pb2

    text = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", str(path)], capture_output=True,
                          text=True, check=True, timeout=120).stdout
    records = []
    for chunk in re.split(r"^# record \d+: \w+\n", text, flags=re.M)[1:]:
        records.append(text_format.Parse(chunk, wandb_internal_pb2.Record()))
    return records


def _wandb_fragments(run_dir: Path, run_id: str) -> list[dict]:
    """Each offline fragment of W&B run `run_id` under run_dir/wandb, oldest first: its config,
    history rows {key: value} and exit code."""
    fragments = []
    for folder in sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}")):
        config, history, exit_code = {}, [], None
        for record in _wandb_records(folder / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "history":
                history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
            elif kind == "exit":
                exit_code = record.exit.exit_code
        fragments.append({"folder": folder, "config": config, "history": history, "exit_code": exit_code})
    return fragments


def _numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "iteration" and isinstance(v, int | float)}


def _mlflow_histories(rows: list[dict]) -> dict:
    """{key: [(iteration, value)]} of the rows' numbers, keyed as on a file store: `/` as `.`
    (a file per key, and train/success_rate is a prefix of train/success_rate/numberline)."""
    out = {}
    for row in rows:
        for key, value in _numbers(row).items():
            out.setdefault(key.replace("/", "."), []).append((row["iteration"], float(value)))
    return out


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def test_mlflow_holds_the_config_every_row_and_the_samples(tracked_run):
    run_dir, rows, view = tracked_run["run_dir"], tracked_run["first"], tracked_run["after_first"]["mlflow"]
    assert view["status"] == "FINISHED" and view["experiment"] == "megatron-agent" and view["name"] == run_dir.name
    config = _flat(tracked_run["after_first"]["config"])  # the resolved config, run_dir/config.json
    assert set(view["params"]) == set(config)
    for key, value in config.items():
        assert view["params"][key] == (value if isinstance(value, str) else json.dumps(value)), key
    assert view["params"]["logging.mlflow_tracking_uri"] == (run_dir / "mlruns").resolve().as_uri()
    assert [row["iteration"] for row in rows] == [0, 1, 2]
    assert view["metrics"] == _mlflow_histories(rows)
    assert view["samples"] == [f"samples/iter_00000{i}.txt" for i in range(3)]
    assert view["sample_1"] == (run_dir / "samples" / "iter_000001.txt").read_text()  # what samples/ got


def test_wandb_offline_holds_the_config_every_row_and_the_samples(tracked_run):
    run_dir, rows = tracked_run["run_dir"], tracked_run["first"]
    [fragment] = tracked_run["after_first"]["wandb"]
    assert fragment["exit_code"] == 0
    config = tracked_run["after_first"]["config"]  # run_dir/config.json
    assert {k: v for k, v in fragment["config"].items() if k != "_wandb"} == config
    assert [h["_step"] for h in fragment["history"]] == [0, 1, 2]
    for history, row in zip(fragment["history"], rows):
        assert {k: history[k] for k in _numbers(row)} == pytest.approx(_numbers(row), rel=1e-12)
        episodes = (run_dir / "samples" / f"iter_00000{row['iteration']}.txt").read_text().rstrip("\n").split("\n\n")
        assert history["samples/_type"] == "table-file" and history["samples/nrows"] == len(episodes) >= 2
    table = json.loads((fragment["folder"] / "files" / fragment["history"][1]["samples/path"]).read_text())
    episodes = (run_dir / "samples" / "iter_000001.txt").read_text().rstrip("\n").split("\n\n")
    assert [row[table["columns"].index("text")] for row in table["data"]] == episodes  # what samples/ got
    assert [row[table["columns"].index("iteration")] for row in table["data"]] == [1] * len(episodes)


def test_a_resumed_run_continues_both_tracker_runs_with_each_iteration_once(tracked_run):
    run_dir, first = tracked_run["run_dir"], tracked_run["after_first"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [0, 1, 2, 3, 4]
    assert rows[:3] == tracked_run["first"] and rows == tracked_run["resumed"]
    ids = json.loads((run_dir / "trackers.json").read_text())
    assert ids == first["ids"]  # the same W&B and MLflow runs
    fragments = _wandb_fragments(run_dir, ids["wandb"]["run_id"])
    assert len(fragments) == 2 and fragments[0]["history"] == first["wandb"][0]["history"]  # offline: a new fragment
    assert [h["_step"] for h in fragments[1]["history"]] == [3, 4]
    assert fragments[1]["config"]["resume"] == str(run_dir) and fragments[1]["exit_code"] == 0
    history = fragments[0]["history"] + fragments[1]["history"]
    for entry, row in zip(history, rows, strict=True):
        assert {k: entry[k] for k in _numbers(row)} == pytest.approx(_numbers(row), rel=1e-12)
    # MLflow raised at iteration 4: one warning, dropped (its run closed as failed), the run went on
    [warning] = tracked_run["warned"]
    assert warning.startswith("tracker mlflow failed (log: OSError: the store's disk is full)")
    view = _mlflow_view(run_dir, ids["mlflow"]["run_id"])
    assert view["status"] == "FAILED"
    assert view["metrics"] == _mlflow_histories(rows[:4])  # each iteration once, up to the failure
    assert view["samples"] == [f"samples/iter_00000{i}.txt" for i in range(5)]  # iteration 4's, before its row
    assert view["params"]["iterations"] == "3"  # MLflow keeps a param as first logged
