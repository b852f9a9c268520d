"""AppWorld (experimental): API-driven tasks in simulated apps, solved by writing Python.

The real AppWorld engine (`pip install appworld`, then `appworld install`) runs each task
world: the model's `<code>...</code>` cells are executed by `AppWorld.execute`, the episode
ends when the code calls `apis.supervisor.complete_task(...)` (`task_completed()`) or at
max_steps, and `AppWorld.evaluate()` runs the task's checks.

AppWorld pins packages the project's venv cannot take (pydantic 1, an older pytest, psutil,
rich), so it lives in a venv of its own. This module imports nothing of it: each env copy
starts one `envs/appworld_server.py` process under that venv's python and speaks JSON
lines to it (one process per copy, since AppWorld keeps one world per process).

Where things are:
- `python`: the AppWorld venv's python; default $MEGATRON_AGENT_APPWORLD_PYTHON, else this
  checkout's `.venv-appworld/bin/python` when it exists.
- `root`: the APPWORLD_ROOT holding `data/` (tasks, base_dbs, api_docs); default
  $APPWORLD_ROOT. AppWorld's own data bundle is a download (`appworld download data`);
  `envs/data/appworld/make_appworld_tasks.py` writes a small one of ours.

Text (and what the agent loop shows): the task, the supervisor, the step count, the last
execution output (truncated to `max_output_chars`). The anchor is `step <n>` plus that
output: the raw state of the world as the model sees it, no instruction (shared by the
group) and no history.
Reward at the end of the episode: `success_reward` when every check passes (`won`), else
0, or `success_reward * passed/total` with `partial_credit=True`. Invalid text is a no-op
(reward 0) that counts as a step. Info extras: `task_id`, `num_tests`, `num_passed`,
`task_score` (passed/total), `failed_checks`, `completed`, `truncated`.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from envs.base import Observation, make_info
from envs.projection import single_block
from envs.registry import register_env

SERVER_SCRIPT = Path(__file__).with_name("appworld_server.py")
PYTHON_ENV_VAR = "MEGATRON_AGENT_APPWORLD_PYTHON"
CHECKOUT_VENV_PYTHON = Path(__file__).resolve().parent.parent / ".venv-appworld" / "bin" / "python"
INVALID_ACTION_OUTPUT = "Invalid action: write one block of Python code as <code>...</code>."
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")  # a dataset or task name, as the server takes it


@dataclass
class AppWorldConfig:
    python: str | None = None  # None: $MEGATRON_AGENT_APPWORLD_PYTHON, else .venv-appworld
    root: str | None = None  # None: $APPWORLD_ROOT
    dataset: str = "train"  # data/datasets/<dataset>.txt lists the task ids
    max_steps: int = 50
    max_output_chars: int = 2000
    success_reward: float = 10.0
    partial_credit: bool = False
    execution_timeout_s: int = 60  # AppWorld's own limit per code cell
    # Host memory one copy's AppWorld server process takes, for planning a run's memory
    # (envs.registry.memory_problem). Measured here (psutil RSS of envs/appworld_server.py,
    # AppWorld 0.1.3.post1, the small generated task set): 124 MiB after `tasks`, 244 MiB
    # after the first reset, 255 MiB after its first episode, then +1.3 MiB per episode.
    # AppWorld's own data bundle (bigger databases) may take more: raise it for that.
    server_memory_mb: int = 320

    def copy_memory_bytes(self) -> int:
        """What one env copy costs in host memory: its AppWorld server process."""
        return self.server_memory_mb * 2**20

    def validate(self) -> None:
        if not NAME.fullmatch(self.dataset):
            raise ValueError(f"dataset={self.dataset!r} must be a plain name (data/datasets/<dataset>.txt)")
        for key in ("max_steps", "execution_timeout_s"):
            if isinstance(getattr(self, key), bool) or not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)!r} must be an integer >= 1")
        if self.max_output_chars < 0 or self.server_memory_mb < 0:
            raise ValueError("max_output_chars and server_memory_mb must be >= 0")


def parse_code_action(text: object) -> str | None:
    """The code of the one `<code>...</code>` block (tags ASCII-case-insensitive, each
    once, in order, non-blank content); None when invalid. Text outside is ignored."""
    if not isinstance(text, str):
        return None
    block = single_block(text, "code")
    if block is None or not block[2].strip():
        return None
    return block[2]


def truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... ({len(text) - limit} more characters)"


class AppWorldMissing(FileNotFoundError):
    """The AppWorld venv or its data is not where the config says."""


def resolve_paths(config: AppWorldConfig) -> tuple[str, str]:
    python = config.python or os.environ.get(PYTHON_ENV_VAR)
    if not python and CHECKOUT_VENV_PYTHON.exists():
        python = str(CHECKOUT_VENV_PYTHON)
    root = config.root or os.environ.get("APPWORLD_ROOT")
    if not python or not os.path.exists(python):
        raise AppWorldMissing(
            f"AppWorld's python not found ({python!r}): set {PYTHON_ENV_VAR} or config python to a "
            "venv with `pip install appworld` and `appworld install` done (make .venv-appworld)"
        )
    if not root or not os.path.isdir(os.path.join(root, "data", "tasks")):
        raise AppWorldMissing(
            f"AppWorld data not found: {root!r} has no data/tasks. Set APPWORLD_ROOT or config root to a "
            "folder holding AppWorld's data (`appworld download data`, a download) or build a small one "
            "with envs/data/appworld/make_appworld_tasks.py"
        )
    return python, os.path.abspath(root)


class AppWorldServerError(RuntimeError):
    """The AppWorld server failed a request, died, hung or answered out of protocol. The
    env copy's episode ends as failed (the worker catches it); the run goes on."""


MAX_REPLY_CHARS = 16 * 2**20  # a reply line (the server cuts outputs at 1M characters; JSON escapes grow them)


def valid_text(text: str) -> str:
    """`text` with what UTF-8 cannot encode (lone surrogates) replaced by '?': it goes to the tokenizer."""
    return text.encode("utf-8", "replace").decode("utf-8")


def reply_field(reply: dict, cmd: str, name: str, kind: type):
    value = reply.get(name)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise AppWorldServerError(f"AppWorld server's reply to {cmd!r}: {name} is {value!r:.80}, "
                                  f"not a {kind.__name__}")
    return value


def text_list(reply: dict, cmd: str, name: str) -> list[str]:
    values = reply_field(reply, cmd, name, list)
    if not all(isinstance(v, str) for v in values):
        raise AppWorldServerError(f"AppWorld server's reply to {cmd!r}: {name} holds a non-string")
    return [valid_text(v) for v in values]


class AppWorldServer:
    """One envs/appworld_server.py process; request() sends one JSON line, reads one back.
    The server exits by itself when this process is gone (--parent-pid)."""

    def __init__(self, python: str, root: str, reply_timeout_s: float):
        env = {**os.environ, "APPWORLD_ROOT": root}
        self.reply_timeout_s = reply_timeout_s
        self.proc = subprocess.Popen(
            [python, "-P", "-u", str(SERVER_SCRIPT), "--parent-pid", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=root, text=True,
        )

    def request(self, cmd: str, **fields) -> dict:
        """The server's reply (a dict, "ok" popped); AppWorldServerError when it fails the
        request, dies, says nothing within reply_timeout_s or says something out of protocol
        (then it is killed: the next line could not be trusted to answer the next request)."""
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise AppWorldServerError(f"AppWorld server died (exit code {self.proc.poll()})") from None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.reply_timeout_s)
        if not ready:
            self.kill()
            raise AppWorldServerError(f"AppWorld server gave no reply to {cmd!r} within {self.reply_timeout_s:.0f} s")
        line = self.proc.stdout.readline(MAX_REPLY_CHARS + 1)
        if not line:
            self.kill()
            raise AppWorldServerError(f"AppWorld server died before replying to {cmd!r} "
                                      f"(exit code {self.proc.returncode})")
        try:
            if not line.endswith("\n"):
                raise ValueError(f"a line of more than {MAX_REPLY_CHARS} characters")
            reply = json.loads(line)
            if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
                raise ValueError("not a JSON object with a boolean 'ok'")
        except (ValueError, RecursionError) as err:
            self.kill()
            raise AppWorldServerError(f"AppWorld server sent a malformed reply to {cmd!r} ({err}): "
                                      f"{line[:200]!r}") from None
        if not reply.pop("ok"):
            raise AppWorldServerError(f"AppWorld {cmd!r} failed:\n{reply.get('error')!s:.20000}")
        return reply

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "close"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


class AppWorldEnv:
    @staticmethod
    def instructions_for(config: AppWorldConfig) -> str:
        return (
            "You are an agent acting for your supervisor in AppWorld, a world of apps (venmo, spotify, "
            "gmail, amazon, ...). Each turn, write Python code in one <code>...</code> block; it runs in "
            "a persistent interpreter where `apis.<app>.<api>(...)` calls an app. Look up APIs with "
            "`apis.api_docs.show_api_descriptions(app_name=...)` and `apis.api_docs.show_api_doc(app_name=..., "
            "api_name=...)`; your supervisor's account passwords are in "
            "`apis.supervisor.show_account_passwords()`. Print what you need to see. When done, call "
            "`apis.supervisor.complete_task(answer=...)` (answer only when the task asks a question)."
        )

    def __init__(self, config: AppWorldConfig):
        config.validate()
        self.config = config
        self.python, self.root = resolve_paths(config)
        self.server: AppWorldServer | None = None
        self.task_ids: list[str] = []
        self.experiment = f"megatron-agent-{uuid.uuid4().hex}"  # copies of one task never share outputs

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.close()
            self.server = None

    def __del__(self):
        self.close()

    def _server(self) -> AppWorldServer:
        if self.server is None or self.server.proc.poll() is not None:
            self.server = AppWorldServer(self.python, self.root, self.config.execution_timeout_s + 120)
            self.task_ids = text_list(self.server.request("tasks", dataset=self.config.dataset), "tasks", "task_ids")
            if not self.task_ids:
                raise AppWorldMissing(f"dataset {self.config.dataset!r} under {self.root} lists no task")
        return self.server

    def _obs(self) -> Observation:
        output = truncate(self.last_output, self.config.max_output_chars)
        s = self.supervisor
        text = (
            f"Task: {self.instruction}\n"
            f"Supervisor: {s['first_name']} {s['last_name']} (email {s['email']}, phone {s['phone_number']})\n"
            f"Step: {self.steps}/{self.config.max_steps}\n"
            f"Last output:\n{output}"
        )
        return Observation(text=text, image=None, anchor=f"step {self.steps}\n{output}")

    def reset(self, seed: int) -> Observation:
        server = self._server()
        self.task_id = self.task_ids[int(seed) % (1 << 30) % len(self.task_ids)]
        world = server.request(
            "reset", task_id=self.task_id, experiment=self.experiment, timeout_s=self.config.execution_timeout_s
        )
        self.instruction = valid_text(reply_field(world, "reset", "instruction", str))
        supervisor = reply_field(world, "reset", "supervisor", dict)
        self.supervisor = {k: valid_text(reply_field(supervisor, "reset", k, str))
                           for k in ("first_name", "last_name", "email", "phone_number")}
        self.steps, self.last_output = 0, "(nothing run yet)"
        return self._obs()

    def step(self, text: str):
        if self.server is None:
            raise RuntimeError("AppWorld env stepped before reset")
        code = parse_code_action(text)
        self.steps += 1
        completed = False
        if code is None:
            self.last_output = INVALID_ACTION_OUTPUT
        else:
            result = self.server.request("execute", code=valid_text(code))
            self.last_output = valid_text(reply_field(result, "execute", "output", str))
            completed = reply_field(result, "execute", "completed", bool)
        truncated = not completed and self.steps >= self.config.max_steps
        extras = {"task_id": self.task_id, "completed": completed, "truncated": truncated}
        if not (completed or truncated):
            return self._obs(), 0.0, False, make_info(code is not None, False, **extras)
        checks = self.server.request("evaluate")
        num_tests = reply_field(checks, "evaluate", "num_tests", int)
        passed, failed = text_list(checks, "evaluate", "passed"), text_list(checks, "evaluate", "failed")
        won = reply_field(checks, "evaluate", "success", bool)
        if num_tests < 0 or len(passed) > max(1, num_tests):
            raise AppWorldServerError(f"AppWorld server's evaluation: {len(passed)} of {num_tests} checks passed")
        score = len(passed) / max(1, num_tests)
        reward = self.config.success_reward * (score if self.config.partial_credit else float(won))
        extras.update(num_tests=num_tests, num_passed=len(passed), task_score=score, failed_checks=failed)
        return self._obs(), reward, True, make_info(code is not None, won, **extras)


register_env("appworld", AppWorldEnv, AppWorldConfig)
