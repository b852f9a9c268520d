"""The AppWorld worker's JSON-lines protocol without AppWorld: every malformed request gets
one error reply naming what is wrong and the server goes on (envs/appworld_server.py);
every malformed reply fails only the env copy that got it, with a clear message, never
the run (envs/appworld.py). The real server is tested in tests/integration/envs/."""

from __future__ import annotations

import io
import json
import sys

import pytest

from envs import EnvManager
from envs.appworld_server import serve


class RecordingHolder:
    """Stands in for the AppWorld world: records what reaches it."""

    def __init__(self):
        self.calls = []

    def tasks(self, dataset):
        self.calls.append(("tasks", dataset))
        return {"task_ids": ["t_1"]}

    def reset(self, task_id, experiment, timeout_s):
        self.calls.append(("reset", task_id, experiment, timeout_s))
        return {"instruction": "do it", "supervisor": {}}

    def execute(self, code):
        self.calls.append(("execute", code))
        return {"output": "ran", "completed": False}

    def evaluate(self):
        self.calls.append(("evaluate",))
        return {"success": True, "num_tests": 1, "passed": ["a"], "failed": []}

    def cleanup(self):
        self.calls.append(("cleanup",))


VALID = [
    ({"cmd": "tasks", "dataset": "train"}, ("tasks", "train")),
    ({"cmd": "reset", "task_id": "venmopay_1", "experiment": "megatron-agent-1f", "timeout_s": 30},
     ("reset", "venmopay_1", "megatron-agent-1f", 30)),
    ({"cmd": "execute", "code": "print(1)"}, ("execute", "print(1)")),
    ({"cmd": "evaluate"}, ("evaluate",)),
]
# (request line, the field the error names or None, a word of the message)
MALFORMED = [
    ("not json", None, "JSON"),
    ("[" * 50_000, None, "JSON"),  # nested past the parser's recursion limit
    ("5", None, "object"), ("[]", None, "object"), ("null", None, "object"), ('"tasks"', None, "object"),
    ("{}", "cmd", "cmd"),
    ('{"cmd": 5}', "cmd", "cmd"),
    ('{"cmd": "cleanup"}', "cmd", "cmd"),  # a method of the world holder, not a command
    ('{"cmd": "__init__"}', "cmd", "cmd"),
    ('{"cmd": "drop_world"}', "cmd", "cmd"),
    ('{"cmd": "tasks"}', "dataset", "needs"),
    ('{"cmd": "tasks", "dataset": "../../etc"}', "dataset", "plain name"),
    ('{"cmd": "tasks", "dataset": ""}', "dataset", "plain name"),
    ('{"cmd": "tasks", "dataset": ".hidden"}', "dataset", "plain name"),
    ('{"cmd": "tasks", "dataset": ["train"]}', "dataset", "plain name"),
    ('{"cmd": "tasks", "dataset": "train", "extra": 1}', "extra", "no field"),
    ('{"cmd": "evaluate", "code": "x"}', "code", "no field"),
    ('{"cmd": "reset", "task_id": "a/b", "experiment": "e", "timeout_s": 5}', "task_id", "plain name"),
    ('{"cmd": "reset", "task_id": "a", "experiment": "/tmp/x", "timeout_s": 5}', "experiment", "plain name"),
    ('{"cmd": "reset", "task_id": "a", "experiment": "e", "timeout_s": true}', "timeout_s", "integer"),
    ('{"cmd": "reset", "task_id": "a", "experiment": "e", "timeout_s": 0}', "timeout_s", "integer"),
    ('{"cmd": "reset", "task_id": "a", "experiment": "e", "timeout_s": 1.5}', "timeout_s", "integer"),
    ('{"cmd": "reset", "task_id": "a", "experiment": "e", "timeout_s": "5"}', "timeout_s", "integer"),
    ('{"cmd": "reset", "task_id": "a", "experiment": "e", "timeout_s": 1e400}', "timeout_s", "integer"),
    ('{"cmd": "reset", "task_id": "a", "experiment": "e", "timeout_s": 100000000000000000000}', "timeout_s",
     "integer"),
    ('{"cmd": "execute", "code": 5}', "code", "string"),
    ('{"cmd": "execute", "code": null}', "code", "string"),
    ('{"cmd": "execute"}', "code", "needs"),
]


def test_each_malformed_request_gets_one_error_and_the_server_goes_on():
    lines, expected = [], []
    for (valid, call), (bad, field, word) in zip(VALID * 8, MALFORMED):
        lines += [bad, json.dumps(valid)]
        expected += [("error", field, word), ("ok", call)]
    lines.append(json.dumps({"cmd": "close"}))
    lines.append(json.dumps(VALID[0][0]))  # after close: never answered
    holder, replies = RecordingHolder(), io.StringIO()
    serve(io.StringIO("\n".join(lines) + "\n"), replies, holder)

    answered = [json.loads(line) for line in replies.getvalue().splitlines()]
    assert len(answered) == len(expected)
    for reply, want in zip(answered, expected):
        if want[0] == "ok":
            assert reply["ok"] is True, reply
        else:
            assert reply["ok"] is False and want[2] in reply["error"], (want, reply)
            assert reply.get("field") == want[1], (want, reply)
            assert "Traceback" not in reply["error"]
    assert holder.calls == [call for kind, call in (w[:2] for w in expected) if kind == "ok"] + [("cleanup",)]


def test_execute_or_evaluate_before_a_reset_is_an_error_not_a_crash():
    from envs.appworld_server import WorldHolder

    replies = io.StringIO()
    serve(io.StringIO('{"cmd": "execute", "code": "print(1)"}\n{"cmd": "evaluate"}\n'), replies, WorldHolder())
    answered = [json.loads(line) for line in replies.getvalue().splitlines()]
    assert [r["ok"] for r in answered] == [False, False]
    assert all("reset first" in r["error"] for r in answered)


FAKE_SERVER = """
import json, sys
script = json.load(open("replies.json"))
seen = {}
for line in sys.stdin:
    cmd = json.loads(line)["cmd"]
    if cmd == "close":
        break
    n = seen[cmd] = seen.get(cmd, 0) + 1
    reply = script[cmd][min(n, len(script[cmd])) - 1]
    if reply is None:
        sys.exit(3)
    sys.stdout.write(reply + "\\n")
    sys.stdout.flush()
"""
OK_EXECUTE = '{"ok": true, "output": "ran", "completed": false}'
DONE_EXECUTE = '{"ok": true, "output": "done", "completed": true}'


@pytest.fixture
def fake_appworld(tmp_path):
    """An AppWorld config whose server is FAKE_SERVER answering from `script(replies)`."""
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    python.chmod(0o755)
    (tmp_path / "data" / "tasks").mkdir(parents=True)

    def script(**replies):
        base = {"tasks": ['{"ok": true, "task_ids": ["t_1"]}'],
                "reset": ['{"ok": true, "instruction": "pay Kyle", "supervisor": {"first_name": "J", '
                          '"last_name": "W", "email": "j@w", "phone_number": "1"}}'],
                "execute": [OK_EXECUTE], "evaluate": ['{"ok": true, "success": true, "num_tests": 2, '
                                                      '"passed": ["a", "b"], "failed": []}']}
        (tmp_path / "replies.json").write_text(json.dumps({**base, **replies}))
        return {"python": str(python), "root": str(tmp_path), "max_steps": 3}

    return script


@pytest.mark.parametrize("execute, message", [
    (["not json"], "malformed reply to 'execute'"),
    (["[1]"], "malformed reply to 'execute'"),
    (['{"ok": "yes", "output": "x", "completed": false}'], "malformed reply to 'execute'"),
    (['{"ok": true}'], "output is None, not a str"),
    (['{"ok": true, "output": 5, "completed": false}'], "output is 5, not a str"),
    (['{"ok": true, "output": "x", "completed": "no"}'], "completed is 'no', not a bool"),
    ([None], "died before replying to 'execute' (exit code 3)"),
    (['{"ok": false, "error": "boom"}'], "AppWorld 'execute' failed:\nboom"),
])
def test_a_malformed_reply_fails_only_that_copy(fake_appworld, execute, message):
    config = fake_appworld(execute=[OK_EXECUTE, *execute])  # copy 0's first step is fine, its second gets this
    with EnvManager("appworld", config, num_groups=1, group_size=2, backend="inline") as envs:
        envs.reset([0])
        envs.step(["<code>a</code>", "<code>b</code>"])
        observations, rewards, dones, infos = envs.step(["<code>a</code>", "<code>b</code>"])
        assert dones[0] and infos[0]["failed"] and message in infos[0]["error"], infos[0]
        assert rewards[0] == 0.0
        observations = envs.reset([0])  # the failed copy's next episode starts on a fresh server
        assert all("pay Kyle" in o.text for o in observations)


@pytest.mark.parametrize("evaluate, message", [
    ('{"ok": true, "success": true, "num_tests": NaN, "passed": [], "failed": []}', "num_tests is nan"),
    ('{"ok": true, "success": 1, "num_tests": 1, "passed": [], "failed": []}', "success is 1, not a bool"),
    ('{"ok": true, "success": true, "num_tests": 1, "passed": [1], "failed": []}', "passed holds a non-string"),
    ('{"ok": true, "success": true, "num_tests": 1, "passed": ["a", "b", "c"], "failed": []}', "3 of 1 checks"),
])
def test_a_malformed_evaluation_fails_the_copy_and_gives_no_reward(fake_appworld, evaluate, message):
    config = fake_appworld(execute=[DONE_EXECUTE], evaluate=[evaluate])
    with EnvManager("appworld", config, num_groups=1, group_size=1, backend="inline") as envs:
        envs.reset([0])
        _, rewards, dones, infos = envs.step(["<code>apis.supervisor.complete_task()</code>"])
        assert dones[0] and infos[0]["failed"] and message in infos[0]["error"] and rewards[0] == 0.0


def test_text_utf8_cannot_hold_reaches_the_observation_as_valid_text(fake_appworld):
    """A lone surrogate (JSON "\\ud800") in the output would fail the tokenizer: it becomes '?'."""
    config = fake_appworld(execute=['{"ok": true, "output": "a\\ud800b", "completed": false}'])
    with EnvManager("appworld", config, num_groups=1, group_size=1, backend="inline") as envs:
        envs.reset([0])
        observations, _, dones, infos = envs.step(["<code>print(1)</code>"])
        assert not infos[0]["failed"] and infos[0]["is_action_valid"]
        assert "a?b" in observations[0].text
        observations[0].text.encode("utf-8")
