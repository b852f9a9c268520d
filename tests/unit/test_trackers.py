"""logging.* (megatron_agent/trackers.py): a failing tracker is dropped with one warning, the
section's checks and defaults, and MLflow's run continued on resume (a file store, in-process).
The trackers fed by a real run and read back with W&B's and MLflow's readers:
tests/integration/test_trackers.py."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from megatron_agent.run_config import ConfigError, RunConfig, load_run_config
from megatron_agent.run_dir import MetricsLog, read_metrics
from megatron_agent.trackers import LoggingConfig, Trackers, open_trackers, read_tracker_runs
from tests.unit.rollout.test_samples import sample


class FakeTracker:
    """Records what it gets; raises `RuntimeError(name)` in `fail_in` (its method's name)."""

    def __init__(self, name: str, fail_in: str | None = None):
        self.name, self.fail_in = name, fail_in
        self.rows, self.samples, self.closed = [], [], None

    def log(self, row):
        self._maybe_fail("log" if row["iteration"] == 1 else None)
        self.rows.append(row["iteration"])

    def log_samples(self, iteration, episodes):
        self._maybe_fail("log_samples")
        self.samples.append((iteration, len(episodes)))

    def close(self, failed):
        self.closed = failed
        self._maybe_fail("close")

    def _maybe_fail(self, method):
        if method is not None and method == self.fail_in:
            raise RuntimeError(f"{self.name} broke")


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_tracker_that_raises_is_warned_about_once_and_dropped_and_the_others_go_on(caplog):
    good, in_log, in_samples, in_close = (FakeTracker("good"), FakeTracker("in_log", "log"),
                                          FakeTracker("in_samples", "log_samples"), FakeTracker("in_close", "close"))
    trackers = Trackers([good, in_log, in_samples, in_close])
    episodes = [[sample(0, 0, 0, 1.0, 1.0)], [], [sample(0, 1, 0, 0.0, 0.0)]]
    with caplog.at_level(logging.WARNING, logger="megatron_agent.trackers"):
        for iteration in range(3):
            trackers.log_samples(iteration, episodes)
            trackers.log({"iteration": iteration, "x": float(iteration)})
        trackers.close()
    assert good.rows == [0, 1, 2] and good.samples == [(0, 2), (1, 2), (2, 2)] and good.closed is False
    assert in_log.rows == [0] and in_log.closed is True  # dropped at iteration 1, closed as failed
    assert in_samples.rows == [] and in_samples.closed is True
    assert in_close.rows == [0, 1, 2]
    warned = _warnings(caplog)
    assert len(warned) == 3, warned
    for name, when in (("in_log", "log"), ("in_samples", "log_samples"), ("in_close", "close")):
        [message] = [m for m in warned if f"tracker {name} failed" in m]
        assert f"({when}: RuntimeError: {name} broke)" in message


def test_close_marks_the_run_failed_only_when_an_exception_is_on_its_way():
    ended = FakeTracker("ended")
    trackers = Trackers([ended])
    with pytest.raises(ValueError):
        try:
            raise ValueError("the loop failed")
        finally:
            trackers.close()  # as the driver's `finally` closes them
    assert ended.closed is True
    fine = FakeTracker("fine")
    Trackers([fine]).close()
    assert fine.closed is False
    try:
        raise KeyError("handled by the caller before the run")
    except KeyError:
        inside = FakeTracker("inside")
        Trackers([inside]).close()  # opened and closed while the caller handles its own exception
    assert inside.closed is False


def test_a_tracker_that_fails_to_open_is_warned_about_and_left_out(tmp_path, monkeypatch, caplog):
    import megatron_agent.trackers as trackers_module

    class Opens(FakeTracker):
        def __init__(self, config, run_id):
            super().__init__("mlflow")
            self.run_id = "run-1"

    def refuses(config, run_id):
        raise ConnectionError("no network")

    monkeypatch.setattr(trackers_module, "WandbTracker", refuses)
    monkeypatch.setattr(trackers_module, "MlflowTracker", Opens)
    config = RunConfig(run_dir=str(tmp_path), logging=LoggingConfig(backends=["wandb", "mlflow"]))
    with caplog.at_level(logging.WARNING, logger="megatron_agent.trackers"):
        trackers = open_trackers(config)
    assert [t.name for t in trackers.active] == ["mlflow"]
    assert _warnings(caplog) == ["tracker wandb failed (open: ConnectionError: no network); "
                                 "the run goes on without it"]
    assert read_tracker_runs(tmp_path) == {"mlflow": {"run_id": "run-1"}}


@pytest.mark.parametrize(("overrides", "message"), [
    (["logging.backends=[tensorboard,comet]"], r"logging.backends: 'comet' is not a tracker; choose any of "
                                               r"\['tensorboard', 'wandb', 'mlflow'\]"),
    (["logging.backends=[wandb]", "logging.wandb_mode=cloud"], r"logging.wandb_mode='cloud'"),
])
def test_bad_logging_settings_are_refused_naming_them(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(overrides)


@pytest.mark.parametrize("sqlalchemy", [False, True])
def test_an_sql_store_needs_sqlalchemy(sqlalchemy, monkeypatch):
    """mlflow-skinny installs no SQLAlchemy: an SQL store is refused without it, taken with it
    (whichever this machine has)."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        (find_spec("importlib") if sqlalchemy else None) if name == "sqlalchemy" else find_spec(name, *a)))
    overrides = ["logging.backends=[mlflow]", "logging.mlflow_tracking_uri=sqlite:///runs/mlflow.db"]
    if sqlalchemy:
        assert load_run_config(overrides).logging.mlflow_tracking_uri == "sqlite:///runs/mlflow.db"
    else:
        with pytest.raises(ConfigError, match=r"need SQLAlchemy, which mlflow-skinny .* does not install"):
            load_run_config(overrides)


@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_a_tracker_whose_package_is_missing_is_refused_naming_the_extra(backend, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == backend else find_spec(name, *a))
    with pytest.raises(ConfigError, match=rf"'{backend}' needs the {backend} package, which is not installed: "
                                          r"pip install 'megatron-agent\[trackers\]'"):
        load_run_config([f"logging.backends=[tensorboard,{backend}]"])


def test_defaults_come_from_the_run_dir_then_the_environment_and_settings_win(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    section = load_run_config([f"run_dir={tmp_path / 'my-run'}"]).logging
    assert section.backends == ["tensorboard"] and section.project == "megatron-agent"
    assert (section.run_name, section.wandb_mode) == ("my-run", "online")
    assert section.mlflow_tracking_uri == f"file://{tmp_path.resolve()}/my-run/mlruns"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    section = load_run_config([f"run_dir={tmp_path / 'my-run'}"]).logging
    assert (section.wandb_mode, section.mlflow_tracking_uri) == ("offline", "http://mlflow.example:5000")
    section = load_run_config([f"run_dir={tmp_path / 'my-run'}", "logging.run_name=first", "logging.wandb_mode=online",
                               "logging.mlflow_tracking_uri=file:/elsewhere"]).logging
    assert (section.run_name, section.wandb_mode, section.mlflow_tracking_uri) == ("first", "online", "file:/elsewhere")


def test_metrics_log_leaves_tensorboard_out_when_the_backends_do(tmp_path):
    log = MetricsLog(tmp_path, [], tensorboard=False)
    log.write({"iteration": 0, "x": 1.0})
    log.close()
    assert read_metrics(tmp_path) == [{"iteration": 0, "x": 1.0}] and not (tmp_path / "tensorboard").exists()


def test_mlflow_run_is_continued_on_resume_with_each_new_iteration_once(tmp_path, monkeypatch):
    """In-process, a file store: rows as the driver passes them (a resumed run only its new
    iterations), a key that is a prefix of another (train/success_rate/numberline)."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # restored as it was after the test
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # the tracker opts in itself
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    uri = (tmp_path / "store").as_uri()

    def config(iterations, resume=None):
        return RunConfig(run_dir=str(run_dir), iterations=iterations, resume=resume,
                         logging=LoggingConfig(backends=["mlflow"], mlflow_tracking_uri=uri))

    def row(i):
        return {"iteration": i, "train/success_rate": i / 4, "train/success_rate/numberline": i / 4, "note": "text"}

    trackers = open_trackers(config(2))
    for i in range(2):
        trackers.log(row(i))
    trackers.log_samples(1, [[sample(0, 3, 0, 1.0, 1.0, won=True)]])
    trackers.close()
    run_id = read_tracker_runs(run_dir)["mlflow"]["run_id"]
    trackers = open_trackers(config(3, resume=str(run_dir)))
    trackers.log(row(2))
    assert trackers.active, "the tracker was dropped"
    trackers.close()
    assert read_tracker_runs(run_dir)["mlflow"]["run_id"] == run_id
    client = MlflowClient(uri)
    for key in ("train.success_rate", "train.success_rate.numberline"):  # the file store's keys
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, key)] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["iterations"] == "2"  # as first logged
    assert run.data.params["resume"] == "null" and run.data.params["logging.backends"] == '["mlflow"]'
    assert [f.path for f in client.list_artifacts(run_id, "samples")] == ["samples/iter_000001.txt"]
