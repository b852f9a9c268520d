"""The Slurm scripts in slurm/, run with bash (not sbatch) against stub executables.

Each stub (scontrol, srun, hostname, ray, megatron-agent, python, curl) appends its argv
to a log, one call a line, fields separated by tabs, and answers what the scripts ask:
two nodes, node1 at 10.0.0.1, a Ray cluster with STUB_RAY_GPUS GPUs. The srun stub drops
its own options and runs the rest, so `srun -w node1 ray start ...` logs both calls.
Sleeps are set to 0; the stubs that stand for long-running processes sleep until the
script's trap kills them.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

SLURM_DIR = Path(__file__).resolve().parents[2] / "slurm"
TRAIN = SLURM_DIR / "train.sbatch"
FLEET = SLURM_DIR / "sglang_fleet.sbatch"
RECIPE = SLURM_DIR / "gigpo_qwen3vl_moe.sbatch"

LOG_CALL = 'name=$(basename "$0"); (IFS=$\'\\t\'; printf "%s\\n" "$name${IFS}$*") >>"$STUB_LOG"\n'
LOG_ENV = ('echo "$name:$1 MEGATRON_AGENT_ENGINE_TOKEN=$MEGATRON_AGENT_ENGINE_TOKEN RAY_ADDRESS=$RAY_ADDRESS'
           ' RAY_AUTH_MODE=$RAY_AUTH_MODE RAY_AUTH_TOKEN=$RAY_AUTH_TOKEN" >>"$STUB_LOG.env"\n')

STUBS = {
    "scontrol": """
if [ "$1 $2" = "show hostnames" ]; then printf '%s\\n' ${STUB_NODES:-node1 node2}; fi
""",
    # Drop srun's options (-w takes a value), run the command "on" that node.
    "srun": """
while [ $# -gt 0 ]; do
  case "$1" in
    -w) export SLURMD_NODENAME="$2"; shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
exec "$@"
""",
    "hostname": """
case "$SLURMD_NODENAME" in node1) echo "fe80::1 10.0.0.1 172.17.0.1" ;; *) echo "10.0.0.9" ;; esac
""",
    "ray": LOG_ENV + """
case "$1" in
  start) exec sleep 30 >/dev/null 2>&1 </dev/null ;;
  status) printf 'Node status\\nActive:\\n (no active nodes)\\nTotal Usage:\\n 0.0/64.0 CPU\\n 0.0/%s.0 GPU\\n' "${STUB_RAY_GPUS:-16}" ;;
esac
""",
    "megatron-agent": LOG_ENV + """
if [ "$2" = "--dry-run" ] && [ -n "$STUB_DRY_RUN_FAIL" ]; then echo "error: bad configuration: parallel: stub" >&2; exit 2; fi
if [ -e "$STUB_DIR/fail_once" ]; then rm "$STUB_DIR/fail_once"; exit 3; fi
""",
    "python": "exec sleep 30 >/dev/null 2>&1 </dev/null\n",
    "curl": "",
}


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + LOG_CALL + body)
        path.chmod(0o755)
    return tmp_path


def base_env(tmp_path: Path, **settings: str) -> dict[str, str]:
    env = {
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "STUB_LOG": str(tmp_path / "calls.log"),
        "STUB_DIR": str(tmp_path),
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "megatron-agent",
        "SLURM_GPUS_ON_NODE": "8",
        "PROJECT_DIR": str(tmp_path),
        "VENV": "",
        "HEAD_START_SECONDS": "0",
        "POLL_SECONDS": "0",
        "WAIT_TIMEOUT": "3",
        "EXTRA_OVERRIDES": "model=qwen3-8b model_dir=/models/q",
    }
    env.update(settings)
    return env


def run_train(tmp_path: Path, *args: str, **settings: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(TRAIN), *args], env=base_env(tmp_path, **settings), cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)


def calls(tmp_path: Path, name: str | None = None) -> list[list[str]]:
    log = tmp_path / "calls.log"
    rows = [line.split("\t") for line in log.read_text().splitlines()] if log.exists() else []
    return [row for row in rows if name is None or row[0] == name]


def train_argv(tmp_path: Path) -> list[str]:
    (row,) = calls(tmp_path, "megatron-agent")
    return row[1:]


def env_rows(tmp_path: Path) -> list[tuple[str, dict[str, str]]]:
    """What the ray and megatron-agent stubs saw in their environment: ("name:first arg", variables)."""
    log = tmp_path / "calls.log.env"
    rows = log.read_text().splitlines() if log.exists() else []
    return [(row.split()[0], dict(field.split("=", 1) for field in row.split()[1:])) for row in rows]


def engine_keys(tmp_path: Path) -> dict[str, set[str]]:
    """MEGATRON_AGENT_ENGINE_TOKEN as each stubbed command saw it."""
    keys: dict[str, set[str]] = {}
    for name, variables in env_rows(tmp_path):
        keys.setdefault(name, set()).add(variables["MEGATRON_AGENT_ENGINE_TOKEN"])
    return keys


def write_key(path: Path, key: str) -> None:
    path.write_text(key + "\n")
    path.chmod(0o600)


def test_every_sbatch_script_parses():
    scripts = sorted(SLURM_DIR.glob("*.sbatch"))
    assert {p.name for p in scripts} >= {"train.sbatch", "sglang_fleet.sbatch"}
    for script in scripts:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"


def test_train_starts_ray_on_every_node_then_trains(stubs):
    result = run_train(stubs, "seed=3", "actor.lr=1e-4", RAY_PORT="6380", ENGINE_GPUS="4", GPUS_PER_ENGINE="2",
                       EXTRA_OVERRIDES="algorithm=gigpo env=sokoban  model_dir=/models/q")
    assert result.returncode == 0, result.stderr

    sruns = calls(stubs, "srun")
    assert all("--overlap" in row for row in sruns)
    # The head's IP is asked of the head node; the first IPv4 address is used.
    assert sruns[0][-4:] == ["-w", "node1", "hostname", "--ip-address"]
    starts = {row[row.index("-w") + 1]: row[row.index("ray"):] for row in sruns if "ray" in row}
    assert set(starts) == {"node1", "node2"}
    head, worker = starts["node1"], starts["node2"]
    assert head[:3] == ["ray", "start", "--head"]
    assert {"--node-ip-address=10.0.0.1", "--port=6380", "--num-gpus=8", "--block"} <= set(head)
    assert '--resources={"rollout_node": 1}' in head  # rollout.node_resource=rollout_node: a worker per node
    assert worker[:2] == ["ray", "start"] and "--head" not in worker
    assert {"--address=10.0.0.1:6380", "--num-gpus=8", "--block", '--resources={"rollout_node": 1}'} <= set(worker)
    assert ["ray", "status", "--address=10.0.0.1:6380"] in calls(stubs, "ray")

    assert train_argv(stubs) == [
        "train", "backend=gpu", "placement.launcher=ray", "placement.ray_address=auto",
        "placement.trainer_ranks=12",  # 2 nodes x 8 GPUs - 4 engine GPUs
        "placement.gpus_per_trainer=1", "placement.colocate=false",
        "engine.num_engines=2", "engine.gpus_per_engine=2",
        f"run_dir={stubs}/runs/megatron-agent-4242",
        "algorithm=gigpo", "env=sokoban", "model_dir=/models/q",  # EXTRA_OVERRIDES, then "$@"
        "seed=3", "actor.lr=1e-4",
    ]
    # One auth token for the job, the same in every Ray process and the driver.
    env_rows = (stubs / "calls.log.env").read_text().splitlines()
    tokens = {row.split("RAY_AUTH_TOKEN=")[1] for row in env_rows}
    assert len(tokens) == 1 and re.fullmatch(r"[0-9a-f]{64}", tokens.pop())
    assert all("RAY_AUTH_MODE=token" in row for row in env_rows)
    assert {row.split()[0] for row in env_rows} >= {"ray:start", "ray:status", "megatron-agent:train"}
    (train_env,) = [row for row in env_rows if row.startswith("megatron-agent:train")]
    assert "RAY_ADDRESS=10.0.0.1:6380 " in train_env  # placement.ray_address=auto finds it
    assert "stopping Ray on node1 node2" in result.stdout


def test_train_exits_with_the_train_status(stubs):
    (stubs / "fail_once").touch()
    failed = run_train(stubs)
    assert failed.returncode == 3
    assert "stopping Ray" in failed.stdout  # the trap ran
    assert run_train(stubs).returncode == 0


@pytest.mark.parametrize(("settings", "named"), [
    ({"ENGINE_GPUS": "3", "GPUS_PER_ENGINE": "2"}, "ENGINE_GPUS=3 is not divisible by GPUS_PER_ENGINE=2"),
    ({"ENGINE_GPUS": "16"}, "ENGINE_GPUS=16 leaves no GPU for training"),
    ({"ENGINE_GPUS": "0"}, "ENGINE_GPUS=0 leaves no rollout engine"),
    ({"GPUS_PER_ENGINE": "0"}, "GPUS_PER_ENGINE=0"),
    ({"GPUS_PER_ENGINE": "16", "ENGINE_GPUS": "16"}, "GPUS_PER_ENGINE=16 is more than GPUS_PER_NODE=8"),
    ({"RAY_PORT": "abc"}, "RAY_PORT='abc'"),
    ({"COLOCATE": "yes"}, "COLOCATE='yes'"),
    ({"RAY_AUTH_MODE": "off"}, "RAY_AUTH_MODE='off'"),
    ({"COLOCATE": "true", "ENGINE_GPUS": "8"}, "ENGINE_GPUS=8 must be 0 with COLOCATE=true"),
    ({"VENV": "/nonexistent"}, "VENV=/nonexistent"),
    ({"EXTRA_OVERRIDES": "model=qwen3-8b model_dir=/path/to/Qwen3-8B"}, "model_dir=/path/to/Qwen3-8B is a placeholder"),
])
def test_bad_setting_fails_before_any_srun(stubs, settings, named):
    result = run_train(stubs, **settings)
    assert result.returncode != 0
    assert named in result.stderr
    assert calls(stubs, "srun") == [] and calls(stubs, "megatron-agent") == []


def test_train_takes_model_dir_from_the_arguments_over_the_placeholder(stubs):
    result = run_train(stubs, "model_dir=/models/real", EXTRA_OVERRIDES="model=qwen3-8b model_dir=/path/to/Qwen3-8B")
    assert result.returncode == 0, result.stderr
    assert train_argv(stubs)[-3:] == ["model=qwen3-8b", "model_dir=/path/to/Qwen3-8B", "model_dir=/models/real"]


def test_train_fails_when_the_cluster_never_has_all_gpus(stubs):
    result = run_train(stubs, STUB_RAY_GPUS="8")
    assert result.returncode != 0
    assert "the Ray cluster has 8 of 16 GPUs" in result.stderr
    assert calls(stubs, "megatron-agent") == []
    assert "stopping Ray on node1 node2" in result.stdout


def test_train_colocated_uses_every_gpu_for_training_and_engines(stubs):
    result = run_train(stubs, COLOCATE="true", ENGINE_GPUS="0", GPUS_PER_ENGINE="4")
    assert result.returncode == 0, result.stderr
    argv = train_argv(stubs)
    assert {"placement.trainer_ranks=16", "placement.colocate=true", "engine.num_engines=4",
            "engine.gpus_per_engine=4"} <= set(argv)


def test_train_uses_the_fleet_urls_and_resumes_in_place(stubs):
    urls = stubs / "fleet.urls"
    urls.write_text("http://node7:30000\nhttp://node7:30001\n\n")
    write_key(stubs / "fleet.urls.key", "f1eet" * 8)
    result = run_train(stubs, ENGINE_GPUS="0", ENGINE_URLS_FILE=str(urls), RESUME="runs/old")
    assert result.returncode == 0, result.stderr
    argv = train_argv(stubs)
    assert "engine.urls=[http://node7:30000,http://node7:30001]" in argv
    assert not any(a.startswith(("engine.num_engines", "engine.gpus_per_engine")) for a in argv)
    assert {"placement.trainer_ranks=16", "run_dir=runs/old", "resume=runs/old"} <= set(argv)


def test_train_hands_its_engines_a_fresh_key_through_ray_unprinted(stubs):
    result = run_train(stubs)
    assert result.returncode == 0, result.stderr
    keys = engine_keys(stubs)
    (key,) = set().union(*keys.values())  # one key for the job, in every Ray process and the driver
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    assert {"ray:start", "ray:status", "megatron-agent:train"} <= set(keys)
    assert key not in result.stdout + result.stderr
    assert not any(key in arg for arg in train_argv(stubs))  # not an override: config.json would keep it
    ray_token = {v["RAY_AUTH_TOKEN"] for _, v in env_rows(stubs)}
    assert key not in ray_token
    # A key given in the environment is used as is.
    (stubs / "calls.log.env").unlink()
    assert run_train(stubs, MEGATRON_AGENT_ENGINE_TOKEN="mine").returncode == 0
    assert set().union(*engine_keys(stubs).values()) == {"mine"}


def test_train_passes_the_fleet_key_to_ray_and_the_trainer_unprinted(stubs):
    urls = stubs / "fleet.urls"
    urls.write_text("http://node7:30000\n")
    write_key(stubs / "fleet.urls.key", "k" * 64)
    result = run_train(stubs, ENGINE_GPUS="0", ENGINE_URLS_FILE=str(urls), MEGATRON_AGENT_ENGINE_TOKEN="stale")
    assert result.returncode == 0, result.stderr
    keys = engine_keys(stubs)
    assert keys["ray:start"] == keys["megatron-agent:train"] == {"k" * 64}  # the fleet's key wins
    assert "k" * 64 not in result.stdout + result.stderr
    # ENGINE_KEY_FILE names another file.
    write_key(stubs / "elsewhere.key", "e" * 64)
    (stubs / "calls.log.env").unlink()
    result = run_train(stubs, ENGINE_GPUS="0", ENGINE_URLS_FILE=str(urls), ENGINE_KEY_FILE=str(stubs / "elsewhere.key"))
    assert result.returncode == 0, result.stderr
    assert engine_keys(stubs)["megatron-agent:train"] == {"e" * 64}


def test_train_refuses_a_fleet_without_its_key(stubs):
    urls = stubs / "fleet.urls"
    urls.write_text("http://node7:30000\n")
    result = run_train(stubs, ENGINE_GPUS="0", ENGINE_URLS_FILE=str(urls), MEGATRON_AGENT_ENGINE_TOKEN="guess")
    assert result.returncode != 0
    assert f"ENGINE_KEY_FILE={urls}.key is missing or empty" in result.stderr
    assert calls(stubs, "srun") == [] and calls(stubs, "ray") == [] and calls(stubs, "megatron-agent") == []
    (stubs / "fleet.urls.key").write_text("\n")
    result = run_train(stubs, ENGINE_GPUS="0", ENGINE_URLS_FILE=str(urls))
    assert result.returncode != 0 and "holds no key" in result.stderr
    assert calls(stubs, "megatron-agent") == []


def test_train_waits_for_the_fleet_urls_file_and_gives_up(stubs):
    result = run_train(stubs, ENGINE_GPUS="0", ENGINE_URLS_FILE=str(stubs / "missing.urls"))
    assert result.returncode != 0
    assert "missing.urls did not appear" in result.stderr
    assert calls(stubs, "megatron-agent") == []


@contextlib.contextmanager
def running_fleet(stubs, env, urls):
    """The fleet script, entered once it wrote its URL file; cancelled (SIGTERM) on leaving.
    Yields a dict that then holds its stdout, stderr and exit code."""
    proc = subprocess.Popen(["bash", str(FLEET)], env=env, cwd=stubs, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    ended = {}
    try:
        deadline = time.monotonic() + 15
        while not urls.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert urls.exists(), proc.stderr.read() if proc.poll() is not None else "no URL file"
        yield ended
        proc.send_signal(signal.SIGTERM)
        ended["out"], ended["err"] = proc.communicate(timeout=15)
        ended["returncode"] = proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()


def test_fleet_writes_urls_when_healthy_and_removes_them_on_cancel(stubs):
    urls = stubs / "fleet.urls"
    env = base_env(stubs, MODEL_PATH="/models/q", TP_SIZE="4", URLS_FILE=str(urls),
                   SGLANG_ARGS="--mem-fraction-static 0.8")
    with running_fleet(stubs, env, urls) as ended:
        assert urls.read_text().split() == ["http://node1:30000", "http://node1:30001",
                                            "http://node2:30000", "http://node2:30001"]
    assert ended["returncode"] == 143, ended["err"]
    assert not urls.exists()
    servers = {(row[row.index("-w") + 1], row[row.index("--port") + 1]): row
               for row in calls(stubs, "srun")}
    assert set(servers) == {("node1", "30000"), ("node1", "30001"), ("node2", "30000"), ("node2", "30001")}
    second = servers[("node2", "30001")]
    assert second[second.index("python"):second.index("python") + 3] == ["python", "-m", "sglang.launch_server"]
    for flag, value in [("--model-path", "/models/q"), ("--host", "0.0.0.0"), ("--tp-size", "4"),
                        ("--base-gpu-id", "4"), ("--mem-fraction-static", "0.8")]:
        assert second[second.index(flag) + 1] == value
    assert len(calls(stubs, "curl")) >= 4


def test_fleet_makes_a_key_for_every_server_and_hands_it_over_unprinted(stubs):
    urls, key_file = stubs / "runs" / "fleet.urls", stubs / "runs" / "fleet.urls.key"
    env = base_env(stubs, MODEL_PATH="/models/q", TP_SIZE="4", URLS_FILE=str(urls),
                   MEGATRON_AGENT_ENGINE_TOKEN="from-the-submit-environment")
    with running_fleet(stubs, env, urls) as ended:
        key = key_file.read_text().strip()
        assert re.fullmatch(r"[0-9a-f]{64}", key)  # a fresh key, not the one in the environment
        assert key_file.stat().st_mode & 0o777 == 0o600
    assert key not in ended["out"] + ended["err"]  # never in the job's log
    assert not key_file.exists() and not urls.exists()  # removed with the fleet
    servers = calls(stubs, "python")
    assert len(servers) == 4
    for row in servers:
        assert row[1:3] == ["-m", "sglang.launch_server"]
        assert row[row.index("--api-key") + 1] == key and row.count("--api-key") == 1
        assert row[row.index("--host") + 1] == "0.0.0.0"
    assert all(key not in "\t".join(row) for row in calls(stubs, "srun"))  # off srun's recorded command line


def test_fleet_step_refuses_to_start_a_server_without_the_key(stubs):
    # The snippet each srun step runs, given an environment without the key.
    text = FLEET.read_text()
    snippet = re.search(r"^with_key='(.*)'$", text, re.M).group(1)
    result = subprocess.run(["bash", "-c", snippet, "sglang-server", "python", "-m", "sglang.launch_server"],
                            env=base_env(stubs), cwd=stubs, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "the API key did not reach the server step" in result.stderr
    assert calls(stubs, "python") == []


def test_fleet_refuses_an_api_key_in_sglang_args(stubs):
    result = subprocess.run(["bash", str(FLEET)], env=base_env(stubs, MODEL_PATH="/m", SGLANG_ARGS="--api-key mine"),
                            cwd=stubs, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "SGLANG_ARGS sets --api-key" in result.stderr
    assert calls(stubs, "srun") == []


def test_fleet_refuses_a_tp_size_that_does_not_divide_the_node(stubs):
    result = subprocess.run(["bash", str(FLEET)], env=base_env(stubs, MODEL_PATH="/m", TP_SIZE="3"),
                            cwd=stubs, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert "TP_SIZE=3" in result.stderr
    assert calls(stubs, "srun") == []


# ---- gigpo_qwen3vl_moe.sbatch: the recipe over train.sbatch --------------------------------


def run_recipe(tmp_path: Path, *args: str, nodes: int = 4, **settings: str) -> subprocess.CompletedProcess:
    """The recipe on `nodes` stub nodes; it finds train.sbatch under PROJECT_DIR (the test's folder)."""
    (tmp_path / "slurm").mkdir(exist_ok=True)
    if not (tmp_path / "slurm" / "train.sbatch").exists():
        (tmp_path / "slurm" / "train.sbatch").symlink_to(TRAIN)
    names = " ".join(f"node{i}" for i in range(1, nodes + 1))
    env = base_env(tmp_path, **{"SLURM_JOB_NODELIST": f"node[1-{nodes}]", "STUB_NODES": names,
                                "STUB_RAY_GPUS": str(8 * nodes), "SLURM_JOB_NAME": "gigpo-qwen3vl-moe",
                                "MODEL_PATH": "/models/vl", **settings})
    return subprocess.run(["bash", str(RECIPE), *args], env={k: v for k, v in env.items() if v is not None},
                          cwd=tmp_path, capture_output=True, text=True, timeout=30)


def test_recipe_checks_its_configuration_then_trains_on_the_node_split(stubs):
    result = run_recipe(stubs, "iterations=50")
    assert result.returncode == 0, result.stderr
    dry, train = calls(stubs, "megatron-agent")
    recipe = ["algorithm=gigpo", "env=sokoban-visual", "model=qwen3-vl-30b-a3b", "model_dir=/models/vl", "iterations=50"]
    assert train[1:] == [
        "train", "backend=gpu", "placement.launcher=ray", "placement.ray_address=auto",
        "placement.trainer_ranks=16",  # 2 of the 4 nodes train; the other 2 serve
        "placement.gpus_per_trainer=1", "placement.colocate=false",
        "engine.num_engines=4", "engine.gpus_per_engine=4",
        f"run_dir={stubs}/runs/gigpo-qwen3vl-moe-4242", *recipe,
    ]
    # The dry run checked exactly what trains (less the run directory), before any srun.
    assert dry[1:3] == ["train", "--dry-run"]
    assert dry[3:] == [a for a in train[2:] if not a.startswith("run_dir=")]
    rows = [row[0] for row in calls(stubs)]
    assert rows.index("megatron-agent") < rows.index("srun")
    assert "Ray cluster up: 32 GPUs on 4 nodes" in result.stdout
    # The check ran with a stand-in key; Ray and the trainer get train.sbatch's fresh one.
    keys = engine_keys(stubs)
    (fresh,) = keys["megatron-agent:train"] - {"dry-run-check"}
    assert "dry-run-check" in keys["megatron-agent:train"] and keys["ray:status"] == {fresh}
    assert re.fullmatch(r"[0-9a-f]{64}", fresh)


def test_recipe_stops_when_the_configuration_does_not_fit(stubs):
    result = run_recipe(stubs, STUB_DRY_RUN_FAIL="1")
    assert result.returncode == 2
    assert "the configuration does not fit 4 nodes x 8 GPUs" in result.stderr
    assert "parallel: stub" in result.stderr  # the dry run's own message stays in the log
    assert len(calls(stubs, "megatron-agent")) == 1 and calls(stubs, "srun") == [] and calls(stubs, "ray") == []


def test_recipe_dry_run_alone_on_a_login_node_reads_the_header(stubs):
    result = run_recipe(stubs, DRY_RUN="true", SLURM_JOB_NODELIST=None)
    assert result.returncode == 0, result.stderr
    ((_, *argv),) = calls(stubs, "megatron-agent")
    assert argv[:2] == ["train", "--dry-run"]
    # #SBATCH --nodes=4 in the header: 2 nodes of trainer ranks, 2 of engines
    assert {"placement.trainer_ranks=16", "engine.num_engines=4"} <= set(argv)
    assert calls(stubs, "srun") == [] and calls(stubs, "scontrol") == []
    result = run_recipe(stubs, DRY_RUN="true", SLURM_JOB_NODELIST=None, NODES="6", ENGINE_NODES="2")
    assert result.returncode == 0, result.stderr
    assert "placement.trainer_ranks=32" in calls(stubs, "megatron-agent")[-1]


@pytest.mark.parametrize(("settings", "named"), [
    ({"MODEL_PATH": "/path/to/Qwen3-VL-30B-A3B"}, "MODEL_PATH=/path/to/Qwen3-VL-30B-A3B is a placeholder"),
    ({"ENGINE_NODES": "4"}, "ENGINE_NODES=4 must leave at least one of the 4 nodes"),
    ({"GPUS_PER_ENGINE": "3"}, "GPUS_PER_ENGINE=3 does not divide the engines' 16 GPUs"),
    ({"DRY_RUN": "yes"}, "DRY_RUN='yes'"),
    ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST is not set"),
])
def test_recipe_bad_setting_fails_before_anything_runs(stubs, settings, named):
    result = run_recipe(stubs, **settings)
    assert result.returncode == 2 and named in result.stderr
    assert calls(stubs, "megatron-agent") == [] and calls(stubs, "srun") == []


def recipe_dry_run_argv(stubs: Path, nodes: int, **settings: str) -> list[str]:
    """The `megatron-agent train --dry-run ...` command the recipe issues on `nodes` nodes."""
    result = run_recipe(stubs, nodes=nodes, DRY_RUN="true", **settings)
    assert result.returncode == 0, result.stderr
    return calls(stubs, "megatron-agent")[-1][1:]


@pytest.mark.parametrize(("nodes", "settings", "refused"), [
    (4, {}, None),                       # 16 trainer ranks: TP 4 x EP 16
    (6, {"ENGINE_NODES": "2"}, None),    # 32
    (5, {}, "etp*ep*pp = 1*16*1 = 16 does not divide the world size 24"),  # 3 trainer nodes
    (3, {"ENGINE_NODES": "2"}, "does not divide the world size 8"),
])
def test_recipe_dry_run_resolves_the_full_config_against_the_node_count(stubs, capsys, monkeypatch, nodes, settings,
                                                                        refused):
    """The real `megatron-agent train --dry-run` on the command the recipe builds, with the
    published Qwen3-VL-30B-A3B config.json as the model."""
    import json

    from megatron_agent.cli import main
    from tests.unit.test_presets import QWEN3_VL_30B_A3B

    model = stubs / "Qwen3-VL-30B-A3B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_VL_30B_A3B))
    argv = [a.replace("model_dir=/models/vl", f"model_dir={model}") for a in recipe_dry_run_argv(stubs, nodes, **settings)]
    monkeypatch.setenv("MEGATRON_AGENT_ENGINE_TOKEN", "dry-run-check")  # as the recipe sets it for the check
    capsys.readouterr()
    status = main(argv)
    out, err = capsys.readouterr()
    if refused:
        assert status == 2 and "bad configuration: parallel:" in err and refused in err
        return
    assert status == 0, err
    config = json.loads(out)
    ranks = 8 * nodes // 2 if not settings else 8 * (nodes - int(settings["ENGINE_NODES"]))
    assert config["placement"]["trainer_ranks"] == ranks
    assert config["parallel"] | {"vpp": None} == dict(tp=4, pp=1, vpp=None, cp=1, ep=16, etp=1, sequence_parallel=True)
    assert config["actor"]["lr"] == 1e-6 and config["actor"]["params_dtype"] == "bf16"
    assert config["algorithm"]["advantage_estimator"] == "gigpo"
    assert config["env"] == "sokoban" and config["env_config"]["render_image"] is True
    assert config["model_dir"] == str(model) and "model: qwen3_vl_moe (with vision tower), 48 layers" in err
    assert (config["engine"]["server"], config["engine"]["gpus_per_engine"]) == ("sglang", 4)
    assert config["engine"]["num_engines"] == 8 * (nodes - ranks // 8) // 4
    assert f"layout: {ranks} trainer ranks = DP {ranks // 4} x TP 4 x PP 1; experts: EP 16" in err
