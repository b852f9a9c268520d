"""Build a small AppWorld data folder (APPWORLD_ROOT/data) with a few tasks of our own.

Run with the python of the AppWorld venv (it imports `appworld`; after `appworld install`):

    .venv-appworld/bin/python envs/data/appworld/make_appworld_tasks.py --root /tmp/appworld-root

AppWorld's own data bundle (its ~750 tasks and their base databases) is a download this
project cannot reach; this script writes the same on-disk layout from the installed
package alone, so the real AppWorld engine (its apps, code execution, evaluator) runs on
it:

    data/api_docs/standard/<app>.json      API docs, built from the apps' source
    data/base_dbs/<app>.db                 empty databases (every app's schema)
    data/tasks/<task_id>/specs.json        instruction, supervisor, datetime, db_version
    data/tasks/<task_id>/dbs/<app>.jsonl   the task's world, as changes on base_dbs
    data/tasks/<task_id>/ground_truth/     answer.json, evaluation.py, test_data.json,
                                           public_data.json, private_data.json,
                                           metadata.json (minimal mode), and ours:
                                           solution_steps.json (the expert's code cells)
    data/datasets/<name>.txt               task ids, one a line ("train" and "dev")

Every task is the supervisor Joyce Weaver's, on 2023-05-18 12:00, with a Venmo account.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from textwrap import dedent

DATETIME = "2023-05-18T12:00:00"
SUPERVISOR = {
    "first_name": "Joyce",
    "last_name": "Weaver",
    "email": "joyce-weav@gmail.com",
    "phone_number": "3155673041",
}
FRIEND = {
    "first_name": "Kyle",
    "last_name": "Moore",
    "email": "kyle.moore@gmail.com",
    "phone_number": "2123334455",
}
VENMO_PASSWORD = "Vx3#mQ9pLz"
FRIEND_VENMO_PASSWORD = "Kt7!wR2nBs"

LOGIN_CELL = dedent(
    """\
    passwords = {a["account_name"]: a["password"] for a in apis.supervisor.show_account_passwords()}
    profile = apis.supervisor.show_profile()
    token = apis.venmo.login(username=profile["email"], password=passwords["venmo"])["access_token"]
    print("logged in to venmo")"""
)

EVALUATE_PAYMENT = dedent(
    '''\
    def evaluate(test, public_data, private_data, main_user, models, ground_truth_answer):
        payments = models.end.venmo.Transaction.all()
        with test("""exactly one Venmo payment was made"""):
            test.case(len(payments), "==", 1)
        with test("""the payment went from the supervisor to the friend"""):
            sender = models.end.venmo.User.by_id(payments[0].sender_id)
            receiver = models.end.venmo.User.by_id(payments[0].receiver_id)
            test.case(sender.email, "==", main_user.email)
            test.case(receiver.email, "==", public_data.receiver_email)
        with test("""the amount and the note are the ones asked for"""):
            test.case(payments[0].amount, "==", public_data.amount)
            test.case(payments[0].description.strip().lower(), "==", public_data.note)
        with test("""the task was marked complete with no answer"""):
            task = models.end.supervisor.Task.first()
            test.case(task.status, "==", "success")
            test.answer(json.loads(task.answer), ground_truth_answer)
    '''
)

EVALUATE_QUESTION = dedent(
    '''\
    def evaluate(test, public_data, private_data, main_user, models, ground_truth_answer):
        with test("""no Venmo payment was made"""):
            test.case(models.end.venmo.Transaction.count(), "==", 0)
        with test("""the task was marked complete with the right answer"""):
            task = models.end.supervisor.Task.first()
            test.case(task.status, "==", "success")
            test.answer(json.loads(task.answer), ground_truth_answer)
    '''
)

# Each task: its world (Venmo balances), instruction, checks and the expert's code cells.
TASKS = {
    "venmopay_1": {
        "instruction": "Send $25 to my friend Kyle Moore (kyle.moore@gmail.com) on Venmo with the note 'pizza'.",
        "balances": (120.0, 40.0),
        "public_data": {"receiver_email": FRIEND["email"], "amount": 25.0, "note": "pizza"},
        "answer": None,
        "evaluation": EVALUATE_PAYMENT,
        "requirements": (
            "exactly one Venmo payment was made",
            "the payment went from the supervisor to the friend",
            "the amount and the note are the ones asked for",
            "the task was marked complete with no answer",
        ),
        "solution_steps": [
            LOGIN_CELL,
            'apis.venmo.create_transaction(receiver_email="kyle.moore@gmail.com", amount=25, '
            'description="pizza", access_token=token)',
            "apis.supervisor.complete_task()",
        ],
    },
    "venmobalance_1": {
        "instruction": "What is my current Venmo balance, in dollars? Answer with the number only.",
        "balances": (87.5, 40.0),
        "public_data": {},
        "answer": 87.5,
        "evaluation": EVALUATE_QUESTION,
        "requirements": (
            "no Venmo payment was made",
            "the task was marked complete with the right answer",
        ),
        "solution_steps": [
            LOGIN_CELL,
            'balance = apis.venmo.show_venmo_balance(access_token=token)["venmo_balance"]\nprint(balance)',
            "apis.supervisor.complete_task(answer=balance)",
        ],
    },
    "venmorequest_1": {
        "instruction": "Kyle Moore owes me $12 for lunch. Send him a payment request for it on Venmo with the note 'lunch'.",
        "balances": (60.0, 40.0),
        "public_data": {"sender_email": FRIEND["email"], "amount": 12.0, "note": "lunch"},
        "answer": None,
        "evaluation": dedent(
            '''\
            def evaluate(test, public_data, private_data, main_user, models, ground_truth_answer):
                requests = models.end.venmo.PaymentRequest.all()
                with test("""exactly one payment request was made, and no payment"""):
                    test.case(len(requests), "==", 1)
                    test.case(models.end.venmo.Transaction.count(), "==", 0)
                with test("""the request asks the friend for the amount with the note"""):
                    asker = models.end.venmo.User.by_id(requests[0].sender_id)
                    payer = models.end.venmo.User.by_id(requests[0].receiver_id)
                    test.case(asker.email, "==", main_user.email)
                    test.case(payer.email, "==", public_data.sender_email)
                    test.case(requests[0].amount, "==", public_data.amount)
                    test.case(requests[0].description.strip().lower(), "==", public_data.note)
                with test("""the task was marked complete with no answer"""):
                    task = models.end.supervisor.Task.first()
                    test.case(task.status, "==", "success")
                    test.answer(json.loads(task.answer), ground_truth_answer)
            '''
        ),
        "requirements": (
            "exactly one payment request was made, and no payment",
            "the request asks the friend for the amount with the note",
            "the task was marked complete with no answer",
        ),
        "solution_steps": [
            LOGIN_CELL,
            'apis.venmo.create_payment_request(user_email="kyle.moore@gmail.com", amount=12, '
            'description="lunch", access_token=token)',
            "apis.supervisor.complete_task()",
        ],
    },
}
DATASETS = {"train": ["venmopay_1", "venmobalance_1", "venmorequest_1"], "dev": ["venmobalance_1"]}


def write_json(obj, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def write_api_docs(data_dir: str) -> None:
    from appworld.apps import get_all_apps
    from appworld.collections.api_docs import ApiDocCollection

    docs = ApiDocCollection.build(load_apps=tuple(get_all_apps(skip_admin=True)))
    for app_name, api_docs in docs.items():
        # The loader drops canary_string and expects it present.
        out = {name: {**doc, "canary_string": ""} for name, doc in api_docs.items()}
        write_json(out, os.path.join(data_dir, "api_docs", "standard", f"{app_name}.json"))


def write_base_dbs(data_dir: str) -> None:
    from appworld.apps import get_all_apps
    from appworld.collections.models import ModelCollection

    models = ModelCollection.load(to_db_home_path=":memory:empty", load_apps=get_all_apps(), create_db=True)
    models.save(db_home_path=os.path.join(data_dir, "base_dbs"), format="full", delete_if_exists=True)
    models.close()


def populate_world(models, task_id: str, spec: dict) -> None:
    """The supervisor and a friend (admin), the supervisor app's task and passwords, and
    both Venmo accounts."""
    people = []
    for person, birthday, sex in ((SUPERVISOR, "1990-04-12", "female"), (FRIEND, "1989-09-30", "male")):
        people.append(models.admin.MainUser.create_save(**person, birthday=birthday, sex=sex))
    supervisor = models.supervisor.Supervisor.create_save(**SUPERVISOR, birthday="1990-04-12", sex="female")
    models.supervisor.Task.create_save(supervisor_id=supervisor.id, instruction=spec["instruction"])
    models.supervisor.AccountPassword.create_save(
        supervisor_id=supervisor.id, account_name="venmo", password=VENMO_PASSWORD
    )
    for person, password, balance in zip(
        (SUPERVISOR, FRIEND), (VENMO_PASSWORD, FRIEND_VENMO_PASSWORD), spec["balances"]
    ):
        models.venmo.User.create_save(
            first_name=person["first_name"], last_name=person["last_name"], email=person["email"],
            password=password, venmo_balance=balance, verified=True,
        )


def write_task(data_dir: str, task_id: str, spec: dict) -> None:
    from appworld.apps import get_all_apps
    from appworld.collections.models import ModelCollection
    from appworld.common.constants import DB_VERSION

    task_dir = os.path.join(data_dir, "tasks", task_id)
    write_json(
        {"instruction": spec["instruction"], "supervisor": SUPERVISOR, "datetime": DATETIME, "db_version": DB_VERSION},
        os.path.join(task_dir, "specs.json"),
    )
    models = ModelCollection.load(
        to_db_home_path=f":memory:build-{task_id}",
        from_db_home_path=os.path.join(data_dir, "base_dbs"),
        load_apps=get_all_apps(),
    )
    populate_world(models, task_id, spec)
    models.save(db_home_path=os.path.join(task_dir, "dbs"), format="changes", delete_if_exists=True)
    models.close()

    truth = os.path.join(task_dir, "ground_truth")
    os.makedirs(truth, exist_ok=True)
    with open(os.path.join(truth, "evaluation.py"), "w") as f:
        f.write("import json\n\n\n" + spec["evaluation"])
    with open(os.path.join(truth, "answer.json"), "w") as f:
        f.write(json.dumps(spec["answer"]))
    write_json(spec["public_data"], os.path.join(truth, "public_data.json"))
    write_json({}, os.path.join(truth, "private_data.json"))
    write_json(
        [{"requirement": r, "label": "no_op_fail"} for r in spec["requirements"]],
        os.path.join(truth, "test_data.json"),
    )
    # minimal mode has no required_apps.json, so the counts it would give are stated here
    metadata = {"difficulty": 1, "mode": "minimal", "num_apps": 1, "num_apis": 3,
                "num_solution_code_lines": sum(len(c.splitlines()) for c in spec["solution_steps"])}
    write_json(metadata, os.path.join(truth, "metadata.json"))
    write_json(spec["solution_steps"], os.path.join(truth, "solution_steps.json"))


def build(root: str) -> None:
    os.environ["APPWORLD_ROOT"] = root
    from datetime import datetime

    from appworld.apps.api_lib import set_local_date_and_time

    clock = set_local_date_and_time(datetime.fromisoformat(DATETIME))  # records dated like the task
    data_dir = os.path.join(root, "data")
    shutil.rmtree(data_dir, ignore_errors=True)
    write_api_docs(data_dir)
    write_base_dbs(data_dir)
    for task_id, spec in TASKS.items():
        write_task(data_dir, task_id, spec)
    for name, task_ids in DATASETS.items():
        os.makedirs(os.path.join(data_dir, "datasets"), exist_ok=True)
        with open(os.path.join(data_dir, "datasets", f"{name}.txt"), "w") as f:
            f.write("\n".join(task_ids) + "\n")
    clock.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="the APPWORLD_ROOT to write data/ into")
    build(os.path.abspath(parser.parse_args().root))


if __name__ == "__main__":
    main()
