"""The AppWorld side of envs/appworld.py: one AppWorld task world, driven over JSON lines.

Runs under the python of the AppWorld venv (`.venv-appworld`, MEGATRON_AGENT_APPWORLD_PYTHON),
never in the project's venv: AppWorld pins pydantic 1, an older pytest, psutil and rich.
It imports nothing of the project. Started as `python -P envs/appworld_server.py` (-P: this
folder must not shadow the `appworld` package with envs/appworld.py).

One request per stdin line, one reply per stdout line:

    {"cmd": "tasks", "dataset": "train"}           -> {"ok": true, "task_ids": [...]}
    {"cmd": "reset", "task_id": "...",
     "experiment": "...", "timeout_s": 30}         -> {"ok": true, "instruction": ..., "supervisor": {...}}
    {"cmd": "execute", "code": "..."}              -> {"ok": true, "output": ..., "completed": bool}
    {"cmd": "evaluate"}                            -> {"ok": true, "success": bool, "num_tests": n,
                                                       "passed": [...], "failed": [...]}
    {"cmd": "close"}                               -> exits
An exception in a command is {"ok": false, "error": traceback}; the process goes on.
Whatever AppWorld prints goes to stderr, so stdout carries only the replies. Each world
writes its state under APPWORLD_ROOT/experiments/outputs/<experiment>/, removed at exit.
"""

import json
import os
import shutil
import sys
import traceback


class WorldHolder:
    def __init__(self):
        self.world = None
        self.output_dirs = set()

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
        output = self.world.execute(code)
        return {"output": output, "completed": bool(self.world.task_completed())}

    def evaluate(self):
        tracker = self.world.evaluate(suppress_errors=True)
        return {
            "success": bool(tracker.success),
            "num_tests": int(tracker.num_tests),
            "passed": [p["requirement"] for p in tracker.passes],
            "failed": [f["requirement"] for f in tracker.failures],
        }

    def drop_world(self):
        if self.world is not None:
            self.world.close()
            self.world = None

    def cleanup(self):
        self.drop_world()
        for directory in self.output_dirs:
            shutil.rmtree(directory, ignore_errors=True)


def serve(requests, replies):
    holder = WorldHolder()
    try:
        for line in requests:
            if not line.strip():
                continue
            request = json.loads(line)
            cmd = request.pop("cmd")
            if cmd == "close":
                break
            try:
                reply = {"ok": True, **getattr(holder, cmd)(**request)}
            except Exception:
                reply = {"ok": False, "error": traceback.format_exc()}
            replies.write(json.dumps(reply) + "\n")
            replies.flush()
    finally:
        holder.cleanup()


def main():
    replies = os.fdopen(os.dup(1), "w")  # the protocol's own copy of stdout
    os.dup2(2, 1)  # anything printed (AppWorld's warnings, print()) lands on stderr
    sys.stdout = sys.stderr
    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
