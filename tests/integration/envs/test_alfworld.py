"""ALFWorld through the real `alfworld` package, behind EnvManager's process backend.

The six shipped tasks (envs/data/alfworld) are turned into games once per module by
the package's own `alfworld-generate`; each is won by its expert plan, a random
admissible policy runs out of steps, malformed text is an invalid action, and equal
states across a group's copies have equal anchors.

The extra is optional (`pip install -e ".[alfworld]"`): without it these tests fail
under CI=true (the test set-up installs it) and are skipped elsewhere, with the reason.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs import EnvManager, validation_seed
from envs.alfworld import TASK_TYPES, AlfworldConfig, game_for_seed, games_root
from envs.projection import parse_tagged_action
from megatron_agent.algorithms import anchor_key
from megatron_agent.algorithms.gigpo import anchor_state_codes
from tests.integration.envs.env_job import train_two_iterations

# slow: ~30 s on 2 idle cores (games generated, two worker pools); one xdist group: made once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("alfworld")]

TRAIN_SEEDS = [0, 1, 2, 3]  # the four training games, in sorted order


def act(command: str) -> str:
    return f"<think>following the plan</think><action>{command}</action>"


def admissible(text: str) -> list[str]:
    return text.rsplit("Admissible actions: [", 1)[1].rstrip("]").split(", ")


@pytest.fixture(scope="module")
def alfworld_installed() -> None:
    missing = [name for name in ("alfworld", "textworld") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.fail(f"the alfworld extra is not installed (no {', '.join(missing)}): make test installs it "
                    "(pip install -e '.[alfworld]')")


@pytest.fixture(scope="module")
def games_dir(alfworld_installed, tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("alfworld-games"))
    games_root(AlfworldConfig().data_dir, folder)  # generated here, once; the workers find them
    return folder


@pytest.fixture(scope="module")
def seen(games_dir):
    """Full-length episodes, validation on valid_seen: 5 groups of 1 copy."""
    with EnvManager("alfworld", {"games_dir": games_dir}, num_groups=5, group_size=1, num_workers=2) as m:
        yield m


@pytest.fixture(scope="module")
def short(games_dir):
    """10-step episodes, validation on valid_unseen: 2 groups of 3 copies."""
    config = {"games_dir": games_dir, "eval_split": "valid_unseen", "max_steps": 10}
    with EnvManager("alfworld", config, num_groups=2, group_size=3, num_workers=2) as m:
        yield m


def play_plans(manager, seeds, config, groups) -> list[list[tuple]]:
    """The copies of `groups` follow their game's expert walkthrough (the others send None,
    an invalid action); per copy of `groups`, its (obs, reward, done, info) steps."""
    plans = {g: json.load(open(game_for_seed(config, seeds[g])))["walkthrough"] for g in groups}
    manager.reset(seeds)
    players = [i for i in range(manager.num_envs) if manager.group_ids[i] in plans]
    steps = {i: [] for i in players}
    t = 0
    while not manager.dones.all():
        texts = [None] * manager.num_envs
        for i in players:
            if not manager.dones[i]:
                texts[i] = act(plans[manager.group_ids[i]][t])
        observations, rewards, dones, infos = manager.step(texts)
        for i in players:
            if texts[i] is not None:
                steps[i].append((observations[i], rewards[i], dones[i], infos[i]))
        t += 1
    return list(steps.values())


def test_the_expert_plan_wins_every_shipped_game(seen, short, games_dir):
    seen_seeds = [*TRAIN_SEEDS, validation_seed(0)]
    results = play_plans(seen, seen_seeds, AlfworldConfig(games_dir=games_dir), groups=range(5))
    unseen_config = AlfworldConfig(games_dir=games_dir, eval_split="valid_unseen")
    results += play_plans(short, [validation_seed(0), 0], unseen_config, groups=[0])
    assert len(results) == 5 + short.group_size
    played = {}
    for episode in results:
        _, reward, done, info = episode[-1]
        assert done and info["won"] and reward == 10.0 and not info["truncated"]
        assert all(step[3]["is_action_valid"] and step[1] == 0.0 for step in episode[:-1])
        played[info["game"].split("/")[0], info["task_type"]] = len(episode)
    assert {task for _, task in played} == set(TASK_TYPES.values())
    assert {split for split, _ in played} == {"train", "valid_seen", "valid_unseen"}
    assert ("valid_unseen", "look_at_obj_in_light") in played and ("valid_seen", "pick_cool_then_place") in played


def test_a_group_plays_one_game_and_equal_states_share_an_anchor(short):
    observations = short.reset([0, 1])
    assert observations[0].text == observations[1].text == observations[2].text
    assert observations[0].text != observations[3].text  # another group, another game
    assert "Your task is to: " in observations[0].text and "go to desk 1" in admissible(observations[0].text)
    plans = [["go to shelf 1", "go to desk 1"], ["go to desk 1", "look"], ["look", "inventory"]]
    anchors = [o.anchor for o in observations]
    group_ids = list(short.group_ids)
    for t in range(2):
        texts = [act(plans[i][t]) for i in range(3)] + [act("look")] * 3
        observations, _, _, infos = short.step(texts)
        assert all(info["is_action_valid"] for info in infos)
        anchors += [o.anchor for o in observations]
        group_ids += list(short.group_ids)
    codes, _ = anchor_state_codes([anchor_key(a) for a in anchors], np.array(group_ids))
    start, after_one, after_two = codes[:6], codes[6:12], codes[12:]
    assert start[0] == start[1] == start[2] != start[3]
    assert after_two[0] == after_one[1]  # shelf -> desk and straight to desk: the same state
    assert after_one[0] != after_one[1]


def test_random_admissible_actions_run_out_of_steps(short):
    rng = np.random.default_rng(0)
    observations = short.reset([2, 3])
    rewards_seen = []
    steps = 0
    while not short.dones.all():
        texts = [None if short.dones[i] else act(str(rng.choice(admissible(o.text))))
                 for i, o in enumerate(observations)]
        observations, rewards, dones, infos = short.step(texts)
        rewards_seen.append(rewards)
        steps += 1
    assert steps == 10
    assert all(info["truncated"] and not info["won"] and info["is_action_valid"] for info in short.infos)
    assert not np.any(rewards_seen)


malformed = st.one_of(
    st.text(max_size=60),
    st.builds(lambda a, b: f"<think>{a}</think><action>{b}</action>", st.text(max_size=10), st.text(max_size=20)),
    st.sampled_from(["<action>go to desk 1</action>", "<think>x</think><action>go to desk 1",
                     "<think>x</think><action>go to desk 1</action><action>look</action>",
                     "<think>x</think><action>go to desk 99</action>", "<think>x</think><action>help</action>",
                     "<think>x</think><action>go to desk 1</action>", "<THINK>x</THINK><Action> LOOK </Action>"]),
)


def test_the_cpu_job_runs_two_iterations_on_alfworld(games_dir, tmp_path):
    rows = train_two_iterations(tmp_path, "alfworld", [
        f"+env_config.games_dir={games_dir}", "+env_config.max_steps=3", "loop.max_steps=3",
        "loop.prompt.max_prompt_tokens=1536"])
    assert all(any(k.startswith("train/success_rate/pick") for k in row) for row in rows)  # per task type


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=malformed)
def test_malformed_output_is_an_invalid_action_never_a_crash(short, text):
    if short.dones[0]:
        short.reset([0, 1])
    before = short.observations[0]
    observation, reward, done, info = short.step_copies({0: text})[0]
    valid = parse_tagged_action(text, tuple(admissible(before.text))) is not None
    assert not info["failed"] and info["is_action_valid"] == valid
    if not valid:
        assert observation.text == before.text and reward == 0.0 and info["action"] is None
