"""The AppWorld side of envs/appworld.py: one AppWorld task world, driven over JSON lines.

Runs under the python of the AppWorld venv (`.venv-appworld`, MEGATRON_AGENT_APPWORLD_PYTHON),
never in the project's venv: AppWorld pins pydantic 1, an older pytest, psutil and rich.
It imports nothing of the project. Started as
`python -P envs/appworld_server.py [--parent-pid PID]` (-P: this folder must not shadow
the `appworld` package with envs/appworld.py).

One request per stdin line, one reply per stdout line:

    {"cmd": "tasks", "dataset": "train"}           -> {"ok": true, "task_ids": [...]}
    {"cmd": "reset", "task_id": "...",
     "experiment": "...", "timeout_s": 30}         -> {"ok": true, "instruction": ..., "supervisor": {...}}
    {"cmd": "execute", "code": "..."}              -> {"ok": true, "output": ..., "completed": bool}
    {"cmd": "evaluate"}                            -> {"ok": true, "success": bool, "num_tests": n,
                                                       "passed": [...], "failed": [...]}
    {"cmd": "close"}                               -> exits

Every request is checked before AppWorld sees it: a line that is not a JSON object, an
unknown command, a missing, unknown or ill-typed field, a name that is not a plain file
name (dataset, task_id and experiment become paths), or `execute`/`evaluate` before a
`reset` gets {"ok": false, "error": ..., "field": ...} (field: the one at fault, when
one is). An exception inside AppWorld gets {"ok": false, "error": traceback}. The process
goes on after either.

What the model's code does is an execution result, never an error: AppWorld answers
"Execution failed. Traceback: ..." for its exceptions, and so does this server for the
ones AppWorld lets through (KeyboardInterrupt, GeneratorExit). Output is valid UTF-8 (a
lone surrogate printed by the code becomes "?", where AppWorld's own log writer would
fail on it for the rest of the episode) and at most MAX_OUTPUT_CHARS long.

Whatever AppWorld prints goes to stderr, so stdout carries only the replies. Each world
writes its state under APPWORLD_ROOT/experiments/outputs/<experiment>/, removed when the
server closes (not when it is killed: ~60 KiB per world stay). With --parent-pid, the
server exits when that process is no longer its parent (the env worker or trainer that
started it died, however), within PARENT_POLL_S, even in the middle of a cell.
"""

import json
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback

# Bound before AppWorld is imported: while a cell runs, its safety guard replaces process
# functions (os._exit, os.kill, ...) with no-ops, and the parent watch must still work.
_exit, _getppid, _sleep = os._exit, os.getppid, time.sleep

PARENT_POLL_S = 0.2
MAX_OUTPUT_CHARS = 1_000_000
MAX_CODE_CHARS = 1_000_000
MAX_TIMEOUT_S = 24 * 3600
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")


class BadRequest(ValueError):
    def __init__(self, message, field=None):
        super().__init__(message)
        self.field = field


def check_name(value, field):
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise BadRequest(f"{field} must be a plain name (letters, digits, '_', '.', '-'; at most 200), "
                         f"got {value!r:.80}", field)
    return value


def check_timeout(value, field):
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TIMEOUT_S:
        raise BadRequest(f"{field} must be an integer number of seconds in [1, {MAX_TIMEOUT_S}], got {value!r:.80}",
                         field)
    return value


def check_code(value, field):
    if not isinstance(value, str):
        raise BadRequest(f"{field} must be a string, got {type(value).__name__}", field)
    if len(value) > MAX_CODE_CHARS:
        raise BadRequest(f"{field} has {len(value)} characters, more than {MAX_CODE_CHARS}", field)
    return value


# command -> {field: check}
COMMANDS = {
    "tasks": {"dataset": check_name},
    "reset": {"task_id": check_name, "experiment": check_name, "timeout_s": check_timeout},
    "execute": {"code": check_code},
    "evaluate": {},
    "close": {},
}


def parse_request(line):
    """(command, its checked fields) of one request line; BadRequest when it is not one."""
    try:
        request = json.loads(line)
    except (ValueError, RecursionError) as err:
        raise BadRequest(f"not a JSON line: {type(err).__name__}: {str(err)[:200]}") from None
    if not isinstance(request, dict):
        raise BadRequest(f"a request is a JSON object, got {type(request).__name__}")
    cmd = request.pop("cmd", None)
    if not isinstance(cmd, str) or cmd not in COMMANDS:
        raise BadRequest(f"cmd must be one of {sorted(COMMANDS)}, got {cmd!r:.80}", "cmd")
    checks = COMMANDS[cmd]
    for field in request:
        if field not in checks:
            raise BadRequest(f"{cmd!r} takes no field {field!r:.80} (its fields: {sorted(checks)})", field)
    for field, check in checks.items():
        if field not in request:
            raise BadRequest(f"{cmd!r} needs the field {field!r}", field)
        check(request[field], field)
    return cmd, request


def valid_text(text):
    """`text` with what UTF-8 cannot encode (lone surrogates) replaced by '?'."""
    return text.encode("utf-8", "replace").decode("utf-8")


def cut(text, limit=MAX_OUTPUT_CHARS):
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... ({len(text) - limit} more characters)"


def execution_failed(err):
    return "Execution failed. Traceback:\n" + "".join(traceback.format_exception_only(type(err), err)).strip()


class WorldHolder:
    def __init__(self):
        self.world = None
        self.output_dirs = set()

    def current_world(self):
        if self.world is None:
            raise BadRequest("no task world: send a reset first")
        return self.world

    def tasks(self, dataset):
        from appworld.task import load_task_ids

        return {"task_ids": load_task_ids(dataset_name=dataset)}

    def reset(self, task_id, experiment, timeout_s):
        from appworld import AppWorld

        self.drop_world()
        self.world = AppWorld(task_id=task_id, experiment_name=experiment, timeout_seconds=timeout_s)
        self.output_dirs.add(self.world.base_output_directory)
        task = self.world.task
        supervisor = {k: task.supervisor[k] for k in ("first_name", "last_name", "email", "phone_number")}
        return {"instruction": task.instruction, "supervisor": supervisor}

    def execute(self, code):
        world = self.current_world()
        try:
            output = world.execute(valid_text(code))
        except UnicodeEncodeError:
            # The cell printed text UTF-8 cannot hold: AppWorld ran it, saved the world, kept
            # the text in its interaction log and failed writing the log (and would again at
            # every later cell). Keep the log as valid text.
            for entry in world.environment_io:
                for key in ("input", "output"):
                    if isinstance(entry.get(key), str):
                        entry[key] = valid_text(entry[key])
            world.save_logs()
            output = world.environment_io[-1]["output"]
        except Exception:
            raise
        except BaseException as err:  # raised by the cell, past AppWorld's own `except Exception`
            if getattr(world, "null_patch_unsafe_execution", False):
                world.safety_guard.disable()  # what AppWorld does after a cell that returns
            output = execution_failed(err)
        return {"output": cut(valid_text(output)), "completed": bool(world.task_completed())}

    def evaluate(self):
        tracker = self.current_world().evaluate(suppress_errors=True)
        return {
            "success": bool(tracker.success),
            "num_tests": int(tracker.num_tests),
            "passed": [valid_text(str(p["requirement"])) for p in tracker.passes],
            "failed": [valid_text(str(f["requirement"])) for f in tracker.failures],
        }

    def drop_world(self):
        if self.world is not None:
            self.world.close()
            self.world = None

    def cleanup(self):
        self.drop_world()
        for directory in self.output_dirs:
            shutil.rmtree(directory, ignore_errors=True)


def answer(holder, line):
    """The reply to one request line, and whether it asked to close."""
    try:
        cmd, fields = parse_request(line)
        if cmd == "close":
            return None, True
        return {"ok": True, **getattr(holder, cmd)(**fields)}, False
    except BadRequest as err:
        return {"ok": False, "error": str(err), **({"field": err.field} if err.field else {})}, False
    except BaseException:  # noqa: BLE001 - AppWorld's fault goes back to the caller, the server goes on
        return {"ok": False, "error": traceback.format_exc()}, False


def serve(requests, replies, holder=None):
    holder = WorldHolder() if holder is None else holder
    try:
        for line in requests:
            if not line.strip():
                continue
            reply, close = answer(holder, line)
            if close:
                break
            replies.write(json.dumps(reply) + "\n")
            replies.flush()
    finally:
        holder.cleanup()


def end_with_parent(parent_pid):
    """Exit once `parent_pid` is no longer this process's parent. Its world's outputs stay
    (a cell may be running, and AppWorld's guard then blocks file removal)."""

    def watch():
        while _getppid() == parent_pid:
            _sleep(PARENT_POLL_S)
        _exit(1)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def parent_pid_argument(argv):
    if len(argv) == 2 and argv[0] == "--parent-pid" and argv[1].isdigit():
        return int(argv[1])
    if argv:
        raise SystemExit(f"usage: appworld_server.py [--parent-pid PID], got {argv}")
    return None


def main(argv=None):
    parent_pid = parent_pid_argument(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller handles Ctrl-C and closes this server
    replies = os.fdopen(os.dup(1), "w")  # the protocol's own copy of stdout
    os.dup2(2, 1)  # anything printed (AppWorld's warnings, print()) lands on stderr
    sys.stdout = sys.stderr
    holder = WorldHolder()
    if parent_pid is not None:
        end_with_parent(parent_pid)
    serve(sys.stdin, replies, holder)
    replies.flush()
    sys.stderr.flush()
    _exit(0)  # the world is closed and its outputs removed; tearing down AppWorld's modules takes seconds


if __name__ == "__main__":
    main()
