"""The AppWorld env on the real AppWorld engine (its own venv), through EnvManager.

The data folder is built once per module by envs/data/appworld/make_appworld_tasks.py
(three Venmo tasks; AppWorld's own data bundle is a download). The AppWorld venv is
`.venv-appworld` or $MEGATRON_AGENT_APPWORLD_PYTHON; without one these tests fail, with
the reason (make test installs it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs import EnvManager
from envs.appworld import (
    CHECKOUT_VENV_PYTHON,
    INVALID_ACTION_OUTPUT,
    PYTHON_ENV_VAR,
    AppWorldConfig,
    AppWorldEnv,
    AppWorldMissing,
    parse_code_action,
)
from tests.integration.envs.env_job import train_two_iterations
from tests.process_tree import alive_under

pytestmark = pytest.mark.slow  # each AppWorld process spends ~7 s CPU building its apps' routes

ROOT = Path(__file__).resolve().parents[3]
BUILDER = ROOT / "envs" / "data" / "appworld" / "make_appworld_tasks.py"
TRAIN_TASKS = ["venmopay_1", "venmobalance_1", "venmorequest_1"]  # seed g -> task g


@pytest.fixture(scope="module")
def appworld_python() -> str:
    python = os.environ.get(PYTHON_ENV_VAR) or str(CHECKOUT_VENV_PYTHON)
    if not Path(python).exists():
        pytest.fail(f"no AppWorld venv: {python} does not exist (`make test` installs it; "
                    f"`make .venv-appworld/.installed` alone, or set {PYTHON_ENV_VAR})")
    return python


@pytest.fixture(scope="module")
def appworld_root(appworld_python, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("appworld-root")
    subprocess.run([appworld_python, "-P", str(BUILDER), "--root", str(root)], check=True,
                   stdout=subprocess.DEVNULL, timeout=300)
    return root


def solution_steps(root: Path, task_id: str) -> list[str]:
    return json.loads((root / "data" / "tasks" / task_id / "ground_truth" / "solution_steps.json").read_text())


def code(cell: str) -> str:
    return f"<think>run the next cell</think>\n<code>\n{cell}\n</code>"


WRONG_EPISODE = [
    "I will pay Kyle now.",  # no tag: invalid, a no-op step
    code("apis.venmo.create_transaction(receiver_email='nobody@example.com', amount=5)"),  # AppWorld's error
    code("apis.supervisor.complete_task(answer=1)"),  # ends the episode, checks fail
]


def test_expert_wins_and_a_wrong_episode_fails_in_the_same_group(appworld_python, appworld_root):
    """Copy 2g plays task g's solution, copy 2g+1 the wrong episode: same task, same
    seed, separate worlds. Tasks 0 and 2 here (task 1's expert plays in the next test)."""
    config = {"python": appworld_python, "root": str(appworld_root), "max_steps": 5}
    played = {0: TRAIN_TASKS[0], 1: TRAIN_TASKS[2]}
    with EnvManager("appworld", config, num_groups=2, group_size=2, num_workers=2) as envs:
        observations = envs.reset([0, 2])
        for g in played:
            assert observations[2 * g].text == observations[2 * g + 1].text
            assert "Supervisor: Joyce Weaver" in observations[2 * g].text
        assert "Venmo" in envs.instructions or "venmo" in envs.instructions
        steps = {g: solution_steps(appworld_root, task_id) for g, task_id in played.items()}
        assert all(len(s) == len(WRONG_EPISODE) for s in steps.values())
        for t in range(len(WRONG_EPISODE)):
            texts = [code(steps[i // 2][t]) if i % 2 == 0 else WRONG_EPISODE[t] for i in range(4)]
            observations, rewards, dones, infos = envs.step(texts)
            if t == 0:
                assert not any(infos[i]["is_action_valid"] for i in (1, 3))
                assert INVALID_ACTION_OUTPUT in observations[1].text
                assert "logged in to venmo" in observations[0].text
                assert observations[0].anchor == "step 1\nlogged in to venmo\n"
            if t == 1:
                assert "Execution failed" in observations[1].text and infos[1]["is_action_valid"]
        assert dones.all()
        for g, task_id in played.items():
            expert, wrong = infos[2 * g], infos[2 * g + 1]
            assert (expert["task_id"], wrong["task_id"]) == (task_id, task_id)
            assert expert["won"] and rewards[2 * g] == 10.0 and expert["task_score"] == 1.0
            assert expert["completed"] and not expert["failed"] and expert["failed_checks"] == []
            assert not wrong["won"] and rewards[2 * g + 1] == 0.0 and wrong["task_score"] < 1.0
            assert wrong["failed_checks"] and not wrong["failed"]


def test_question_task_then_max_steps_with_partial_credit_and_malformed_text(appworld_python, appworld_root):
    """Task 1 (a question) solved with its answer, after two cells AppWorld itself does not
    survive (a KeyboardInterrupt escapes its `except Exception`; a printed lone surrogate
    fails its log writer at every later cell): both are failed executions, valid actions,
    and the world goes on to the win. Then, in the same world process, an episode of
    malformed text only: every step invalid, none crashes, max_steps ends it."""
    config = {"python": appworld_python, "root": str(appworld_root), "max_steps": 5, "partial_credit": True}
    malformed = ["", "<code></code>", "<code>print(1)", "<code>a</code><code>b</code>", None]
    with EnvManager("appworld", config, num_groups=1, group_size=1, backend="inline") as envs:
        envs.reset([1])
        for cell, shown in ((code("raise KeyboardInterrupt"), "Execution failed. Traceback:\nKeyboardInterrupt"),
                            (code("print('a' + chr(0xd800) + 'b')"), "Last output:\na?b")):
            observations, _, dones, infos = envs.step([cell])
            assert infos[0]["is_action_valid"] and not infos[0]["failed"] and not dones[0], infos[0]
            assert shown in observations[0].text
        for cell in solution_steps(appworld_root, TRAIN_TASKS[1]):
            observations, rewards, dones, infos = envs.step([code(cell)])
        assert dones[0] and infos[0]["won"] and rewards[0] == 10.0 and infos[0]["completed"]
        envs.reset([1])  # venmobalance_1: "no payment made" passes on a no-op episode
        for text in malformed:
            _, rewards, dones, infos = envs.step([text])
            assert not infos[0]["is_action_valid"] and not infos[0]["failed"]
        assert dones[0] and infos[0]["truncated"] and not infos[0]["won"]
        assert infos[0]["num_passed"] == 1 and infos[0]["num_tests"] == 2
        assert rewards[0] == pytest.approx(5.0)  # 10 * 1/2 with partial_credit
        # What the run's memory plan takes one copy to cost (envs.registry.memory_problem),
        # against this server after its two episodes.
        import psutil

        rss = psutil.Process(envs.workers[0].shard.envs[0].server.proc.pid).memory_info().rss
        assert rss <= AppWorldConfig().copy_memory_bytes(), f"one AppWorld server holds {rss / 2**20:.0f} MiB"


def test_the_cpu_job_runs_two_iterations_on_appworld(appworld_python, appworld_root, tmp_path):
    train_two_iterations(tmp_path, "appworld", ["env_config.max_steps=2", "loop.max_steps=2"],
                         {"APPWORLD_ROOT": str(appworld_root), "MEGATRON_AGENT_APPWORLD_PYTHON": appworld_python})


def test_nothing_the_trainer_started_outlives_it(appworld_python, appworld_root, tmp_path):
    """SIGKILL the trainer alone (not its process group), as the kernel's OOM killer would,
    while its two env worker processes start their copies' AppWorld servers (three each,
    one after the other): within a few seconds nothing it started is left, neither the
    engine, nor the workers, nor a server, nor one started after the kill."""
    import psutil

    log = tmp_path / "trainer.log"
    with log.open("w") as out:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "megatron_agent.cli", "train", "env=appworld", "env_backend=process",
             "env_workers=2", "num_groups=1", "group_size=6", "iterations=1", "stop_success=null",
             "loop.sampling.max_new_tokens=16", "tiny_model.tokenizer=bpe", "val_every=0", "save_every=0",
             "env_config.max_steps=2", "loop.max_steps=2", f"run_dir={tmp_path / 'run'}"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "APPWORLD_ROOT": str(appworld_root), PYTHON_ENV_VAR: appworld_python})
    started: dict = {}
    try:
        root = psutil.Process(trainer.pid)
        deadline = time.monotonic() + 240
        while sum("appworld_server.py" in " ".join(p.cmdline()) for p in started.values() if p.is_running()) < 2:
            assert trainer.poll() is None and time.monotonic() < deadline, \
                "the trainer started no AppWorld server:\n" + log.read_text()[-3000:]
            for pid, proc in alive_under([root]).items():
                try:
                    proc.cmdline()  # kept while it can be read
                    started.setdefault(pid, proc)
                except psutil.Error:
                    pass
            time.sleep(0.1)
        kinds = " ".join(" ".join(p.cmdline()) for p in started.values() if p.is_running())
        assert "rollout.engine_server" in kinds and "spawn_main" in kinds  # the engine and the env workers

        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        deadline, left = time.monotonic() + 5, alive_under(started.values())
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = alive_under(left.values())  # and anything they started since
        assert not left, f"alive {time.monotonic() - deadline + 5:.1f} s after the trainer was killed: " + "; ".join(
            f"{pid}: {' '.join(p.cmdline())[:120]}" for pid, p in left.items() if p.is_running())
    finally:
        if trainer.poll() is None:
            trainer.kill()
        for proc in alive_under(started.values()).values():
            try:
                proc.kill()
            except psutil.Error:
                pass


def test_a_busy_appworld_server_ends_with_the_process_that_started_it(appworld_python, appworld_root):
    """A server's parent is an env worker, or the trainer itself under the inline backend
    (which starts servers from the rollout's pool threads, so no PR_SET_PDEATHSIG): the
    server watches its parent. Killed while the server runs a cell that never ends (its
    stdin closing is not seen then), it is gone within a few seconds."""
    import psutil

    starter = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from envs.appworld import AppWorldServer\n"
         "server = AppWorldServer(sys.argv[1], sys.argv[2], 600)\n"
         "server.request('tasks', dataset='train')\n"
         "server.request('reset', task_id='venmopay_1', experiment='busy-server', timeout_s=600)\n"
         "server.proc.stdin.write('{\"cmd\": \"execute\", \"code\": \"while True: pass\"}\\n')\n"
         "server.proc.stdin.flush()\n"
         "print(server.proc.pid, flush=True)\n"
         "time.sleep(600)\n", appworld_python, str(appworld_root)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    server = None
    try:
        server = psutil.Process(int(starter.stdout.readline()))  # its cell is sent: it runs until killed
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait()
        assert not alive_under(wait_gone([server], 5)), "the AppWorld server outlived its parent"
    finally:
        starter.kill()
        if server is not None and server.is_running():
            server.kill()


def wait_gone(procs, seconds: float) -> list:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and alive_under(procs):
        time.sleep(0.1)
    return procs


def test_missing_venv_or_data_is_a_clear_error(tmp_path):
    with pytest.raises(AppWorldMissing, match=PYTHON_ENV_VAR):
        AppWorldEnv(AppWorldConfig(python=str(tmp_path / "no-python"), root=str(tmp_path)))
    python = tmp_path / "python"
    python.touch()
    with pytest.raises(AppWorldMissing, match="make_appworld_tasks.py"):
        AppWorldEnv(AppWorldConfig(python=str(python), root=str(tmp_path)))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("<>/codeCODEı xy\n\t")), max_size=40))
def test_code_is_parsed_strictly(text):
    """Valid iff `<code>` and `</code>` (ASCII-case-insensitive) occur once each, in order,
    around non-blank content; the content is returned as is."""
    lowered = "".join(c.lower() if c.isascii() else c for c in text)
    opens, closes = lowered.count("<code>"), lowered.count("</code>")
    expected = None
    if opens == 1 and closes == 1 and lowered.index("<code>") < lowered.index("</code>"):
        content = text[lowered.index("<code>") + 6 : lowered.index("</code>")]
        expected = content if content.strip() else None
    assert parse_code_action(text) == expected


def test_code_parser_examples():
    assert parse_code_action("<think>x</think><CODE>print(1)</Code> trailing") == "print(1)"
    assert parse_code_action("```python\nprint(1)\n```") is None
    assert parse_code_action(b"<code>1</code>") is None
    assert parse_code_action("<cοde>1</cοde>") is None  # Greek omicron: not a tag
