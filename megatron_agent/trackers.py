"""Experiment trackers beside metrics.jsonl and TensorBoard: W&B and MLflow (`logging.backends`).

    trackers = open_trackers(config)              # rank 0; the backends logging.backends lists
    trackers.log(row)                             # each metrics row, at step row["iteration"]
    trackers.log_samples(iteration, episodes)     # the episodes samples/iter_N.txt gets
    trackers.close()

Each tracker gets the resolved config as its run's config (W&B: nested, as W&B wants it;
MLflow: flattened dotted keys as params), every metrics row's numbers at step = the
iteration, and the sample episodes (a W&B Table, an MLflow text artifact). Their run ids go to
run_dir/trackers.json, so a run resumed from that directory (`resume=`) continues the same
W&B and MLflow runs and logs only the iterations it runs (the rows before its checkpoint
are already there). A tracker that raises, when it opens, logs or closes, is warned about
once and dropped: the run never stops for one. TensorBoard is MetricsLog's (run_dir.py).
Nothing here imports wandb or mlflow until a tracker opens; `logging_problem` checks the
section before any process starts (run_config.py).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_agent.run_dir import checkpoint_name, episode_lines

log = logging.getLogger(__name__)

BACKENDS = ("tensorboard", "wandb", "mlflow")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # the module each imports
INSTALL = "pip install 'megatron-agent[trackers]'"
WANDB_MODES = ("online", "offline", "disabled")
TRACKERS_FILE = "trackers.json"
MLFLOW_PARAM_VALUE_CHARS = 6000  # MLflow refuses longer param values (MAX_PARAM_VAL_LENGTH)


@dataclass
class LoggingConfig:
    """Where the metrics go beside run_dir/metrics.jsonl. None: resolved when the config loads
    (`resolve_logging`), so run_dir/config.json shows the value used."""

    backends: list[str] = field(default_factory=lambda: ["tensorboard"])  # any of BACKENDS
    project: str = "megatron-agent"  # the W&B project, the MLflow experiment
    run_name: str | None = None  # None: the run directory's name
    wandb_mode: str | None = None  # online, offline or disabled; None: $WANDB_MODE, else online
    # None: $MLFLOW_TRACKING_URI, else file:<run_dir>/mlruns (MLflow's file store, no server)
    mlflow_tracking_uri: str | None = None


def resolve_logging(section: LoggingConfig, run_dir: str) -> None:
    """Fill the section's None defaults in place (from the run directory and the environment)."""
    if section.run_name is None:
        section.run_name = Path(run_dir).resolve().name
    if section.wandb_mode is None:
        section.wandb_mode = os.environ.get("WANDB_MODE") or "online"
    if section.mlflow_tracking_uri is None:
        section.mlflow_tracking_uri = (os.environ.get("MLFLOW_TRACKING_URI")
                                       or (Path(run_dir).resolve() / "mlruns").as_uri())


def logging_problem(section: LoggingConfig) -> str | None:
    """Why the resolved section cannot work (None: it can): a backend not in BACKENDS, one
    whose package is not installed, a W&B mode W&B does not have, an MLflow SQL store
    without SQLAlchemy (mlflow-skinny has none)."""
    for backend in section.backends:
        if backend not in BACKENDS:
            return f"logging.backends: {backend!r} is not a tracker; choose any of {list(BACKENDS)}"
        if importlib.util.find_spec(PACKAGES[backend]) is None:
            return (f"logging.backends: {backend!r} needs the {PACKAGES[backend]} package, which is not "
                    f"installed: {INSTALL}")
    if "wandb" in section.backends and section.wandb_mode not in (None, *WANDB_MODES):  # None: resolved later
        return f"logging.wandb_mode={section.wandb_mode!r} (or $WANDB_MODE); choose one of {list(WANDB_MODES)}"
    if "mlflow" in section.backends and section.mlflow_tracking_uri:
        scheme = urllib.parse.urlparse(section.mlflow_tracking_uri).scheme.lower()
        if scheme not in ("", "file", "http", "https") and not scheme.startswith("databricks"):
            from mlflow.store.db.db_types import DATABASE_ENGINES

            if any(scheme.startswith(db) for db in DATABASE_ENGINES) and importlib.util.find_spec("sqlalchemy") is None:
                return (f"logging.mlflow_tracking_uri={section.mlflow_tracking_uri!r}: MLflow's SQL stores need "
                        "SQLAlchemy, which mlflow-skinny (the trackers extra) does not install; pip install mlflow, "
                        "or use a file: store or an http(s) tracking server")
    return None


class Trackers:
    """The run's open trackers. One that raises is warned about once and dropped."""

    def __init__(self, opened: list):
        self.active = opened
        self.handled_before = sys.exc_info()[1]  # opened inside an except block: not this run's failure

    def log(self, row: dict) -> None:
        self._each("log", row)

    def log_samples(self, iteration: int, episodes: list) -> None:
        episodes = [steps for steps in episodes if steps]
        if episodes:
            self._each("log_samples", iteration, episodes)

    def close(self) -> None:
        """Called from the driver's `finally`: a run ending in an exception is marked failed."""
        failed = sys.exc_info()[1] not in (None, self.handled_before)
        for tracker in self.active:
            try:
                tracker.close(failed)
            except Exception as err:  # a tracker never stops the run
                _warn(tracker.name, "close", err)
        self.active = []

    def _each(self, method: str, *args) -> None:
        for tracker in list(self.active):
            try:
                getattr(tracker, method)(*args)
            except Exception as err:
                _warn(tracker.name, method, err)
                self.active.remove(tracker)
                try:
                    tracker.close(True)
                except Exception:  # it has been warned about already
                    pass


def _warn(name: str, when: str, err: Exception) -> None:
    log.warning("tracker %s failed (%s: %s: %s); the run goes on without it", name, when, type(err).__name__, err)


def open_trackers(config) -> Trackers:
    """The trackers `config.logging.backends` lists (TensorBoard is MetricsLog's), each
    continuing its run of `config.resume`'s trackers.json where there is one."""
    section = config.logging
    resolve_logging(section, config.run_dir)
    run_dir = Path(config.run_dir)
    earlier = read_tracker_runs(Path(config.resume)) if config.resume else {}
    opened = []
    for name, make in (("wandb", WandbTracker), ("mlflow", MlflowTracker)):
        if name not in section.backends:
            continue
        try:
            tracker = make(config, earlier.get(name, {}).get("run_id"))
        except Exception as err:
            _warn(name, "open", err)
            continue
        write_tracker_run(run_dir, name, tracker.run_id)
        opened.append(tracker)
    return Trackers(opened)


def read_tracker_runs(run_dir: Path) -> dict:
    path = Path(run_dir) / TRACKERS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_tracker_run(run_dir: Path, name: str, run_id: str) -> None:
    runs = read_tracker_runs(run_dir)
    runs[name] = {"run_id": run_id}
    path = run_dir / TRACKERS_FILE
    path.with_suffix(".tmp").write_text(json.dumps(runs, indent=2))
    os.replace(path.with_suffix(".tmp"), path)


def numeric(row: dict) -> dict:
    """The row's numbers, as MetricsLog gives TensorBoard (the iteration is the step)."""
    return {key: value for key, value in row.items() if key != "iteration" and isinstance(value, int | float)}


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """{dotted key: value as text} of a nested config (lists and None as JSON)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


def episode_summary(steps: list) -> dict:
    first = steps[0]
    return {"traj_id": first.traj_id, "group_id": first.group_id, "env_seed": first.env_seed,
            "episode_return": float(first.episode_return), "won": bool(steps[-1].won), "steps": len(steps),
            "text": "\n".join(episode_lines(steps))}


class WandbTracker:
    """A W&B run in run_dir/wandb; offline mode writes there only (`wandb sync` uploads it).
    A resumed run passes the stored id: online with resume="allow" (W&B continues the run
    after its last step), offline as a new fragment with that id, which `wandb sync` joins."""

    name = "wandb"

    def __init__(self, config, run_id: str | None):
        import wandb

        section = config.logging
        online = section.wandb_mode == "online"
        self.run = wandb.init(
            project=section.project, name=section.run_name, dir=str(Path(config.run_dir).resolve()),
            mode=section.wandb_mode, id=run_id, resume="allow" if run_id and online else None,
            config=asdict(config), reinit="create_new",
            # console off: W&B would wrap stdout/stderr (the progress display's); silent: no banner
            settings=wandb.Settings(silent=True, console="off", disable_git=True))
        self.run_id = self.run.id
        log.info("W&B run %s (%s): %s", self.run_id, section.wandb_mode,
                 self.run.url if online else self.run.settings.sync_dir)

    def log(self, row: dict) -> None:
        self.run.log(numeric(row), step=row["iteration"])

    def log_samples(self, iteration: int, episodes: list) -> None:
        import wandb

        rows = [episode_summary(steps) for steps in episodes]
        table = wandb.Table(columns=["iteration", *rows[0]], data=[[iteration, *row.values()] for row in rows])
        self.run.log({"samples": table}, step=iteration)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def mlflow_key(key: str, file_store: bool) -> str:
    return key.replace("/", ".") if file_store else key


class MlflowTracker:
    """An MLflow run in experiment `logging.project`, through MlflowClient (no global active
    run). A file: store (MLflow's default here) needs MLFLOW_ALLOW_FILE_STORE, set for it:
    MLflow 3 keeps that store in maintenance mode and refuses it otherwise. It keeps each
    metric in a file named by its key, so `train/success_rate` and
    `train/success_rate/numberline` cannot both be there: on a file store the keys' `/` are
    `.`. A resumed run reopens the stored run and adds the params it lacks (MLflow refuses
    changed values: those stay as the first run logged them)."""

    name = "mlflow"

    def __init__(self, config, run_id: str | None):
        section = config.logging
        uri = section.mlflow_tracking_uri
        self.file_store = urllib.parse.urlparse(uri).scheme in ("", "file")
        if self.file_store:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = client = MlflowClient(uri)
        params = flat_params(asdict(config))
        if run_id:
            client.update_run(run_id, status="RUNNING")
            params = {k: v for k, v in params.items() if k not in client.get_run(run_id).data.params}
        else:
            experiment = client.get_experiment_by_name(section.project)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(section.project)
            run_id = client.create_run(experiment_id, run_name=section.run_name).info.run_id
        self.run_id = run_id
        client.log_batch(run_id, params=[Param(k, v[:MLFLOW_PARAM_VALUE_CHARS]) for k, v in params.items()])
        log.info("MLflow run %s at %s", run_id, uri)

    def log(self, row: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(key, self.file_store), float(value), now,
                                                           row["iteration"]) for key, value in numeric(row).items()])

    def log_samples(self, iteration: int, episodes: list) -> None:
        text = "\n\n".join("\n".join(episode_lines(steps)) for steps in episodes) + "\n"
        self.client.log_text(self.run_id, text, f"samples/{checkpoint_name(iteration)}.txt")

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
