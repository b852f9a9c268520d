from fractions import Fraction

import numpy as np
import pytest

from envs import make_env
from envs.gym_cards import RANKS, Card, evaluate_formula, hand_total, solve_points


def act(token: str) -> str:
    return f'{{"thoughts": "...", "action": "{token}"}}'


def play(env, tokens):
    return [env.step(act(t)) for t in tokens]


# -- all four games -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["numberline", "ezpoints", "points24", "blackjack"])
def test_seeded_and_rendered(name):
    a, b = make_env(name), make_env(name)
    obs_a, obs_b = a.reset(7), b.reset(7)
    assert obs_a.text == obs_b.text and np.array_equal(obs_a.image, obs_b.image)
    assert obs_a.image.shape == (300, 300, 3) and obs_a.image.dtype == np.uint8
    assert obs_a.anchor == obs_a.text
    assert len({make_env(name).reset(s).text for s in range(40)}) > 5
    text_only = make_env(name, render_image=False).reset(7)
    assert text_only.image is None and text_only.text == obs_a.text


@pytest.mark.parametrize("name", ["numberline", "ezpoints", "points24", "blackjack"])
def test_image_follows_the_state(name):
    env = make_env(name)
    first = env.reset(3).image
    token = {
        "numberline": "+" if getattr(env, "position", 0) < 5 else "-",
        "ezpoints": "+",
        "points24": "(",
        "blackjack": "stand",
    }
    token = token[name]
    obs, *_ = env.step(act(token))
    assert not np.array_equal(first, obs.image)


# -- NumberLine -----------------------------------------------------------------------


def numberline(target, position):
    env = make_env("numberline")
    env.reset(0)
    env.target, env.position = target, position
    return env


def test_numberline_hand_worked():
    env = numberline(target=3, position=1)
    rewards = [r for _, r, _, _ in play(env, ["+", "-", "+"])]
    assert rewards == [0.0, -1.0, 0.0]
    obs, reward, done, info = env.step(act("+"))
    assert (reward, done, info["won"]) == (1.0, True, True)
    assert obs.text == "Target: 3\nCurrent: 3"


def test_numberline_sparse_reward_pays_only_the_outcome():
    env = make_env("numberline", {"reward": "sparse"})
    env.reset(0)
    env.target, env.position = 3, 1
    rewards = [r for _, r, _, _ in play(env, ["+", "-", "+", "+"])]
    assert rewards == [-0.1, -0.1, -0.1, 1.0]
    with pytest.raises(ValueError, match="reward='shaped'"):
        make_env("numberline", {"reward": "shaped"})


def test_numberline_blocked_and_invalid_moves_cost_one():
    env = numberline(target=3, position=0)
    _, reward, _, info = env.step(act("-"))
    assert reward == -1.0 and env.position == 0 and info["is_action_valid"]
    _, reward, _, info = env.step("move right please")
    assert reward == -1.0 and env.position == 0 and not info["is_action_valid"]


def test_numberline_start_differs_from_target_and_ten_steps():
    for seed in range(100):
        env = make_env("numberline")
        env.reset(seed)
        assert env.target != env.position and 0 <= env.position <= 5 and 0 <= env.target <= 5
    env = numberline(target=5, position=0)
    results = play(env, ["-"] * 10)
    assert [d for _, _, d, _ in results] == [False] * 9 + [True]
    assert results[-1][3]["truncated"] and not results[-1][3]["won"]


# -- EZPoints and Points24 -----------------------------------------------------------


def points(name, ranks):
    env = make_env(name)
    env.reset(0)
    env.cards = [Card(r, "♠") for r in ranks]
    env.values = [env._value(c) for c in env.cards]
    return env


def test_ezpoints_right_formula_wins_ten():
    env = points("ezpoints", ["5", "7"])
    results = play(env, ["5", "+", "7", "="])
    assert [r for _, r, _, _ in results] == [0.0, 0.0, 0.0, 10.0]
    assert results[-1][2] and results[-1][3]["won"]


def test_ezpoints_wrong_formula_and_unused_card_lose():
    env = points("ezpoints", ["5", "7"])
    assert play(env, ["5", "*", "7", "="])[-1][1:3] == (-1.0, True)
    env = points("ezpoints", ["K", "2"])  # K counts 10
    assert play(env, ["10", "="])[-1][1:3] == (-1.0, True)  # 10 != 12 and a card unused


def test_points_illegal_number_is_a_noop_costing_one():
    env = points("ezpoints", ["5", "7"])
    obs, reward, done, info = env.step(act("9"))
    assert (reward, done) == (-1.0, False)
    assert info["is_action_valid"] and not info["legal_move"] and env.formula == []
    play(env, ["5"])
    _, reward, _, info = env.step(act("5"))  # the only 5 is used already
    assert reward == -1.0 and not info["legal_move"] and env.formula == ["5"]
    _, reward, _, info = env.step("no json here")
    assert reward == -1.0 and not info["is_action_valid"] and env.formula == ["5"]


def test_ezpoints_deal_is_always_solvable_and_steps_cap_at_eight():
    for seed in range(200):
        env = make_env("ezpoints", render_image=False)
        env.reset(seed)
        assert solve_points(env.values, 12, ("+", "*"), brackets=False) is not None, seed
    env = make_env("ezpoints", render_image=False)
    env.reset(0)
    assert [d for _, _, d, _ in play(env, ["+"] * 8)] == [False] * 7 + [True]


def test_points24_accepts_a_right_formula_and_rejects_a_wrong_one():
    right = ["8", "*", "(", "(", "4", "+", "7", ")", "-", "8", ")", "="]
    env = points("points24", ["4", "7", "8", "8"])
    results = play(env, right)
    assert [r for _, r, _, _ in results] == [0.0] * 11 + [10.0]
    assert results[-1][3]["won"] and results[-1][3]["formula"] == "8 * ( ( 4 + 7 ) - 8 )"
    assert results[-1][0].text == "Cards: 4♠ 7♠ 8♠ 8♠\nFormula: 8 * ( ( 4 + 7 ) - 8 )"

    env = points("points24", ["4", "7", "8", "8"])
    results = play(env, ["8", "+", "8", "+", "7", "+", "4", "="])  # 27
    assert results[-1][1:3] == (-1.0, True) and not results[-1][3]["won"]

    env = points("points24", ["4", "7", "8", "8"])
    results = play(env, ["8", "*", "(", "4", "-", "7", "="])  # unbalanced
    assert results[-1][1] == -1.0


def test_points24_exact_fractions_and_face_cards():
    env = points("points24", ["3", "3", "8", "8"])
    results = play(env, ["8", "/", "(", "3", "-", "8", "/", "3", ")", "="])
    assert results[-1][1] == 10.0
    env = make_env("points24", face_cards_as_10=False)
    env.reset(0)
    env.cards = [Card("J", "♠"), Card("K", "♥"), Card("A", "♦"), Card("Q", "♣")]
    env.values = [env._value(c) for c in env.cards]
    assert env.values == [11, 13, 1, 12]
    assert (
        play(env, ["13", "+", "11", "*", "1", "*", "(", "12", "/", "12", ")", "="])[-1][1] == -1.0
    )  # Q used twice
    assert "13" in env.actions


def test_evaluate_formula():
    assert evaluate_formula("1 + 2 * 3".split()) == 7
    assert evaluate_formula("( 1 + 2 ) * 3".split()) == 9
    assert evaluate_formula("8 / 3".split()) == Fraction(8, 3)
    for bad in ["1 2", "1 +", "( 1", "1 )", "1 / 0", "", "+ 1", "( )"]:
        assert evaluate_formula(bad.split()) is None, bad


# -- Blackjack ------------------------------------------------------------------------


class ScriptedDeck:
    """Stands in for the env's generator: the next ranks to be drawn, all spades."""

    def __init__(self, ranks):
        self.ranks = list(ranks)

    def integers(self, n):
        return RANKS.index(self.ranks.pop(0)) if n == 13 else 0


def blackjack(player, dealer, draws=()):
    env = make_env("blackjack")
    env.reset(0)
    env.player = [Card(r, "♥") for r in player]
    env.dealer = [Card(r, "♣") for r in dealer]
    env.rng = ScriptedDeck(draws)
    return env


def test_hand_totals():
    cards = lambda *ranks: [Card(r, "♠") for r in ranks]  # noqa: E731
    assert hand_total(cards("A", "6")) == 17
    assert hand_total(cards("A", "6", "K")) == 17
    assert hand_total(cards("A", "A", "9")) == 21
    assert hand_total(cards("K", "Q", "2")) == 22


@pytest.mark.parametrize(
    "player,dealer,draws,reward",
    [
        (["10", "6"], ["9", "7"], ["5"], -1.0),  # dealer hits 16 and makes 21
        (["10", "8"], ["A", "6"], [], 1.0),  # dealer stands on soft 17
        (["10", "2"], ["10", "6"], ["K"], 1.0),  # dealer busts
        (["10", "8"], ["9", "9"], [], 0.0),  # push
        (["A", "K"], ["10", "9"], [], 1.0),  # natural
        (["A", "K"], ["A", "Q"], [], 0.0),  # both natural
        (["7", "7", "7"], ["A", "J"], [], -1.0),  # dealer natural beats a three-card 21
    ],
)
def test_blackjack_stand(player, dealer, draws, reward):
    env = blackjack(player, dealer, draws)
    obs, r, done, info = env.step(act("stand"))
    assert r == reward and done and info["won"] == (reward > 0)
    assert "[hidden]" not in obs.text and f"(total {hand_total(env.dealer)})" in obs.text


def test_blackjack_hit_then_bust():
    env = blackjack(["10", "3"], ["9", "7"], ["5", "K"])
    obs, r, done, info = env.step(act("hit"))
    assert (r, done) == (0.0, False) and "[hidden]" in obs.text and info["player_total"] == 18
    obs, r, done, info = env.step(act("hit"))
    assert (r, done, info["outcome"]) == (-1.0, True, "loss")


def test_blackjack_invalid_is_noop_and_stalling_forfeits():
    env = blackjack(["10", "3"], ["9", "7"])
    for i in range(15):
        obs, r, done, info = env.step("I will think about it")
        assert not info["is_action_valid"] and len(env.player) == 2
        assert done == (i == 14) and r == (-1.0 if i == 14 else 0.0)
    assert info["truncated"] and info["outcome"] == "loss"


def test_blackjack_dealer_shows_one_card():
    env = make_env("blackjack")
    obs = env.reset(42)
    assert obs.text.startswith(f"Dealer: {env.dealer[0]} [hidden]\nPlayer: ")


def test_numberline_bare_action_format():
    env = make_env("numberline", {"action_format": "bare", "render_image": False})
    env.reset(0)
    env.target, env.position = 2, 0
    _, reward, _, info = env.step("so + then -")  # the first word that is an action counts
    assert (reward, env.position, info["is_action_valid"]) == (0.0, 1, True)
    _, reward, _, info = env.step('"action": "+"')  # the json form is not a bare action
    assert (reward, env.position, info["is_action_valid"]) == (-1.0, 1, False)
    _, reward, done, info = env.step(" +")
    assert (reward, done, info["won"]) == (1.0, True, True)
    with pytest.raises(ValueError, match="action_format='xml'"):
        make_env("numberline", {"action_format": "xml"})
