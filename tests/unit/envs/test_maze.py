"""KeyMaze: the rules on a map small enough to check by hand, and the expert against them."""

import pytest

from envs.maze import MazeConfig, MazeEnv, moves_to_goal, parse_layout
from envs.registry import make_env

# Row 1: start cells; the key is down a dead end (2, 1); the door (1, 4) walls off the goal.
SMALL = "/".join(["#######",
                  "#...DG#",
                  "#K#####",
                  "#######"])


def test_moves_to_goal_on_a_map_counted_by_hand():
    distance = moves_to_goal(SMALL)
    # Without the key: from (1, 3) left to (1, 1), down to the key, back up, right to the goal: 2+1+1+4 = 8.
    assert distance[(1, 3, False)] == 8
    assert distance[(1, 1, False)] == 6
    assert distance[(2, 1, True)] == 5
    assert distance[(1, 3, True)] == 2
    assert (1, 4, False) not in distance  # the locked door is a wall


def test_the_expert_wins_in_the_shortest_number_of_moves_from_every_start():
    env = MazeEnv(MazeConfig())
    distance = moves_to_goal(env.config.layout)
    assert min(distance[(*s, False)] for s in env.starts) >= env.config.min_solution_moves
    for seed in range(50):
        obs = env.reset(seed)
        expected, moves, done = distance[(*env.state[:2], False)], 0, False
        while not done:
            obs, reward, done, info = env.step(env.expert_action())
            moves += 1
        assert info["won"] and reward == 1.0 and moves == expected
        assert obs.text == obs.anchor and "key yes" in obs.text


def test_walls_the_locked_door_and_text_that_names_no_move_leave_the_state_alone():
    env = make_env("maze", {"layout": SMALL, "min_solution_moves": 1, "max_steps": 5})
    env.reset(0)
    env.state = (1, 3, False)
    obs, reward, done, info = env.step("right")  # the door, no key
    assert env.state == (1, 3, False) and obs.text == "position 1 3 key no" and reward == 0.0
    assert info["is_action_valid"] and not done
    _, _, _, info = env.step("jump")
    assert env.state == (1, 3, False) and not info["is_action_valid"]
    env.step("up")  # a wall
    assert env.state == (1, 3, False)
    env.step("left")
    obs, _, done, info = env.step("left down")  # the first move named
    assert env.state == (1, 1, False) and done and info["truncated"] and not info["won"]  # 5 steps


def test_the_key_opens_the_door():
    env = make_env("maze", {"layout": SMALL, "min_solution_moves": 1})
    env.reset(0)
    env.state = (1, 1, False)
    env.step("down")
    assert env.state == (2, 1, True)
    for move in ("up", "right", "right", "right"):
        env.step(move)
    assert env.state == (1, 4, True)
    _, reward, done, info = env.step("right")
    assert (reward, done, info["won"]) == (1.0, True, True)


@pytest.mark.parametrize("layout", ["#####/#.G.#/#####", "#####/#KDGX#/#####"])
def test_a_layout_without_exactly_one_key_door_and_goal_is_refused(layout):
    parse_layout.cache_clear()
    with pytest.raises(ValueError, match="one K, one D and one G"):
        MazeEnv(MazeConfig(layout=layout))
