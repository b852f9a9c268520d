"""WebShop: the published-schema loader, the pages and actions, the purchase score, and
whole episodes through EnvManager's worker processes."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs import EnvManager, make_env, validation_seed
from envs.webshop import load_published, purchase_score
from envs.webshop.catalogue import parse_pricing
from envs.webshop.env import catalogue_for, goal_for_seed
from envs.webshop.generate import generated_records, write_generated_files
from envs.webshop.reward import (
    attribute_matches,
    normalized_colour,
    option_hits,
    token_set_similarity,
    type_reward,
)
from tests.unit.envs.test_projection import texts
from tests.unit.envs.webshop_fixture import write_fixture

FILES = ("items_shuffle_1000.json", "items_ins_v2_1000.json", "items_human_ins.json", "reviews.json")


def act(action: str) -> str:
    return f"<think>shopping</think><action>{action}</action>"


def available(obs_text: str) -> list[str]:
    return obs_text.split("Available actions:\n", 1)[1].splitlines()


def expert(obs_text: str, goal) -> str:
    """Search the instruction, open the goal's product, choose its options, buy."""
    actions = available(obs_text)
    page = obs_text.split("\nPage: ", 1)[1].split("\nAvailable actions:", 1)[0]
    if "search[<your keywords>]" in actions:
        return act(f"search[{goal.instruction}]")
    if f"click[{goal.asin.lower()}]" in actions:
        return act(f"click[{goal.asin}]")
    if "click[next >]" in actions and "click[buy now]" not in actions:
        return act("click[next >]")
    for value in goal.options:
        if f"{value} (selected)" not in page.split(" [SEP] "):
            return act(f"click[{value}]")
    return act("click[buy now]")


def wrong_buyer(obs_text: str, goal) -> str:
    """Search the instruction, open the first result that is not the goal's product, buy."""
    actions = available(obs_text)
    if "search[<your keywords>]" in actions:
        return act(f"search[{goal.instruction}]")
    if "click[buy now]" in actions:
        return act("click[buy now]")
    items = [a for a in actions if re.fullmatch(r"click\[b0[0-9a-z]{8}\]", a) and goal.asin.lower() not in a]
    return act(items[0])


def play(manager: EnvManager, seeds: list[int], policy, goals) -> tuple[list, list]:
    """Run every copy to its end with policy(obs_text, goal); the last rewards and infos."""
    observations = manager.reset(seeds)
    last_rewards, last_infos = [0.0] * manager.num_envs, [None] * manager.num_envs
    for _ in range(15):
        texts_ = [None if manager.dones[i] else policy(o.text, goals[i]) for i, o in enumerate(observations)]
        observations, rewards, dones, infos = manager.step(texts_)
        for i, text in enumerate(texts_):
            if text is not None:
                last_rewards[i], last_infos[i] = rewards[i], infos[i]
        if dones.all():
            break
    assert manager.dones.all()
    return last_rewards, last_infos


# -- the published schema -------------------------------------------------------------


def test_loader_reads_the_published_schema(tmp_path):
    catalogue = load_published(write_fixture(tmp_path), *FILES[:3], reviews_file=FILES[3])
    assert [p.asin for p in catalogue.products] == ["B0AAAAAAA1", "B0BBBBBBB2", "B0CCCCCCC3"]  # dup, nan dropped
    a, b, c = catalogue.products
    assert a.query == "shampoo" and a.features == ("Sulfate free formula.", "Long lasting scent.")
    assert a.options == (("scent", ("lavender", "rose | vanilla")), ("size", ("8 fl oz", "16 fl oz")))
    assert a.attributes == ("sulfate free", "long lasting") and a.price == 12.99
    assert a.rating == "4.5" and a.reviews == ("Lovely (5 stars) Smells great.",)
    assert b.features == ("Paraben free.",) and b.pricing == (14.0, 16.0) and 14.0 <= b.price <= 16.0
    assert c.options == () and c.reviews == () and c.rating == "N.A."
    (goal,) = catalogue.goals  # the instruction without attributes is skipped
    assert goal.asin == "B0AAAAAAA1" and goal.options == ("lavender", "16 fl oz")
    assert goal.attributes == ("sulfate free", "long lasting") and goal.price_upper in (30.0, 40.0, 50.0)
    assert goal.instruction == (
        "i want a sulfate free and long lasting shampoo in lavender scent, 16 fl oz, "
        f"and price lower than {goal.price_upper:.2f} dollars"
    )
    assert load_published(tmp_path, *FILES[:3], num_products=1).products == (a,)
    with pytest.raises(FileNotFoundError, match="items_shuffle_1000.json not found"):
        load_published(tmp_path / "nowhere", *FILES[:3])


def test_generated_files_load_like_the_published_ones(tmp_path):
    write_generated_files(tmp_path, num_products=40)
    from_files = load_published(tmp_path, *FILES[:3], reviews_file=FILES[3])
    records = generated_records(40)
    assert len(from_files.products) == 40 and len(from_files.goals) == 40
    assert records == generated_records(40)  # deterministic
    assert from_files == catalogue_for(make_env("webshop", generated_products=40).config)[0]


def test_pricing_and_similarity_helpers():
    assert parse_pricing("$12.99") == (12.99,) and parse_pricing("$1,299.00 - $1,499.00") == (1299.0, 1499.0)
    assert parse_pricing("") == (100.0,) and parse_pricing(None) == (100.0,)
    assert token_set_similarity("Sulfate-Free", "free sulfate shampoo") == 100.0  # a subset
    assert token_set_similarity("sulfate free", "paraben free") < 85
    assert token_set_similarity("", "x") == 0.0


# -- rewards ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "asin, options, expected",
    [
        # r_type 1 (same query); attributes: "sulfate free" yes, "long lasting" no; options:
        # lavender yes, 16 fl oz no (8 fl oz is 83 % alike); price 14-16 <= bound (>= 30).
        ("B0BBBBBBB2", ("lavender", "8 fl oz"), 1.0 * (1 + 1 + 1) / (2 + 2 + 1)),
        # the goal's product with the wrong size: 2 attributes, 1 option, price
        ("B0AAAAAAA1", ("lavender", "8 fl oz"), (2 + 1 + 1) / 5),
        ("B0AAAAAAA1", ("lavender", "16 fl oz"), 1.0),
        ("B0CCCCCCC3", (), 0.0),  # coffee: no title word of the goal's product, r_type 0
    ],
)
def test_purchase_scores_by_hand_through_the_process_pool(tmp_path, asin, options, expected):
    data_dir = str(write_fixture(tmp_path))
    with EnvManager("webshop", {"data_dir": data_dir}, num_groups=1, group_size=2, backend="process") as m:
        m.reset([0])
        m.step([act("search[shampoo coffee]")] * 2)
        m.step([act(f"click[{asin}]")] * 2)
        for value in options:
            m.step([act(f"click[{value}]")] * 2)
        obs, rewards, dones, infos = m.step([act("click[buy now]")] * 2)
    assert dones.all() and infos[0]["bought_asin"] == asin
    assert infos[0]["task_score"] == pytest.approx(expected, abs=1e-12)
    assert infos[0]["won"] == (expected == 1.0) and list(rewards) == [10.0 * (expected == 1.0)] * 2
    assert obs[0].anchor.startswith("done?") and "Your score" in obs[0].text


def test_score_mode_rewards_the_score(tmp_path):
    env = make_env("webshop", data_dir=str(write_fixture(tmp_path)), reward_mode="score")
    env.reset(0)
    for action in ("search[shampoo]", "click[b0bbbbbbb2]", "click[lavender]", "click[buy now]"):
        _, reward, done, info = env.step(act(action))
    assert done and reward == pytest.approx(0.6) and not info["won"]
    assert (info["r_type"], info["attribute_matches"], info["option_matches"], info["price_ok"]) == (1.0, 1, 1, True)


def test_type_reward_levels(tmp_path):
    catalogue = load_published(write_fixture(tmp_path), *FILES[:3])
    a, b, c = catalogue.products
    goal = catalogue.goals[0]
    assert type_reward(a, goal).title_score == 1.0 and type_reward(b, goal).title_score == pytest.approx(1 / 3)
    assert type_reward(b, goal).query_match and type_reward(b, goal).category_match
    assert type_reward(c, goal).r_type == 0.0


# -- the reward rules of WebShop's code (web_agent_site/engine/goal.py, normalize.py) --------
# Expected values follow those rules by hand: get_option_reward counts the goal options
# that any chosen option matches, token_set_ratio(chosen, goal) > 85 after normalize_color
# on both; thefuzz 0.19's ratios are rounded to integers (fuzz.ratio, utils.intr).


def test_similarity_is_thefuzz_token_set_ratio_rounded():
    # {x, large} holds {large}: the shared words alone equal one side, 100.
    assert token_set_similarity("x-large", "large") == 100
    # No shared word: the two sides' difflib ratio, 2 * 23 / 54 = 85.19 %, rounds to 85,
    # which is not > 85 (unrounded it would be).
    assert token_set_similarity("abcdefghijklmnopqrstuvwxxxx", "abcdefghijklmnopqrstuvwyyyy") == 85
    assert token_set_similarity("8 fl oz", "16 fl oz") == 83  # "fl oz" vs "fl oz 16": 2 * 5 / 12


def test_colour_words_as_normalize_color():
    # The first colour word in alphabetical order found inside the value, case-sensitive.
    assert normalized_colour("light pink") == "light" and normalized_colour("olive green") == "green"
    assert normalized_colour("standard") == "tan" and normalized_colour("Navy") == "Navy"
    assert normalized_colour("unscented") == "unscented"


@pytest.mark.parametrize(
    "chosen, wanted, original, strict",
    [
        # {x, large} holds {large}: 100 there; strictly a size only matches itself.
        ({"size": "x-large"}, ("large",), (True,), (False,)),
        # "forest green", "olive green" -> "green", "green"; as written 70 % alike.
        ({"color": "forest green"}, ("olive green",), (True,), (False,)),
        # "black white" -> "black", not "white"; as written {black, white} holds {white}.
        ({"color": "black white"}, ("white",), (False,), (True,)),
        # One chosen option hits both goal options there; strictly it is used once.
        ({"scent": "lavender"}, ("lavender", "lavender scent"), (True, True), (True, False)),
    ],
)
def test_option_hits_by_hand(chosen, wanted, original, strict):
    assert option_hits(chosen, wanted) == original
    assert option_hits(chosen, wanted, strict=True) == strict


def test_strict_options_setting_reaches_the_score(tmp_path):
    """The fixture's goal with "16 fl oz bottle": chosen "16 fl oz" is a subset, so both
    options hit there (score 1); strictly the size misses, (2 + 1 + 1) / 5."""
    data_dir = write_fixture(tmp_path)
    goals = json.loads((data_dir / FILES[2]).read_text(encoding="utf-8"))
    goals["B0AAAAAAA1"][0]["instruction_options"] = ["lavender", "16 fl oz bottle"]
    (data_dir / FILES[2]).write_text(json.dumps(goals), encoding="utf-8")
    scores = []
    for strict in (False, True):
        env = make_env("webshop", data_dir=str(data_dir), reward_mode="score", strict_options=strict)
        env.reset(0)
        for action in ("search[shampoo]", "click[b0aaaaaaa1]", "click[lavender]", "click[16 fl oz]", "click[buy now]"):
            *_, info = env.step(act(action))
        scores.append(info["task_score"])
    assert scores == [1.0, pytest.approx(0.8)]


def test_attributes_and_type_as_the_original(tmp_path):
    catalogue = load_published(write_fixture(tmp_path), *FILES[:3])
    a, b, _ = catalogue.products
    goal = catalogue.goals[0]
    # "shampoo sulfate" spans the title's end and the first feature: not in either text;
    # "Scent all day" is looked for as written in the lowercased texts; "scent all day"
    # is in the description; "Sulfate Free" is 100 % alike the attribute "sulfate free".
    attributes = ("shampoo sulfate", "Scent all day", "scent all day", "Sulfate Free")
    assert attribute_matches(a, replace(goal, attributes=attributes)) == 2
    # Category levels compared as split, blanks included: {A, B, ""} & {A, C, ""} is 2.
    match = type_reward(replace(b, product_category="A › B › ", name="Shampoo"),
                        replace(goal, product_category="A › C › ", name="Shampoo Shampoo Bar", query="x"))
    assert match.category_match and not match.query_match
    assert match.title_score == pytest.approx(1 / 3)  # over the goal title's nouns, repeats counted


# -- whole episodes on the generated catalogue --------------------------------------------


def test_expert_episodes_win_and_wrong_purchases_lose():
    catalogue = catalogue_for(make_env("webshop").config)[0]
    seeds = [0, 7, validation_seed(3)]
    goals = [goal_for_seed(catalogue.goals, s) for s in seeds for _ in range(2)]
    with EnvManager("webshop", None, num_groups=3, group_size=2, backend="process", num_workers=2) as m:
        rewards, infos = play(m, seeds, expert, goals)
        assert list(rewards) == [10.0] * 6
        assert all(i["won"] and i["task_score"] == 1.0 and i["bought_asin"] == i["goal_asin"] for i in infos)
        assert [i["task_type"] for i in infos] == [g.category for g in goals]
        rewards, infos = play(m, seeds, wrong_buyer, goals)
    assert list(rewards) == [0.0] * 6 and not any(i["won"] for i in infos)
    for info, goal in zip(infos, goals):
        bought = catalogue.product(info["bought_asin"])
        assert info["task_score"] == purchase_score(bought, {}, goal).score < 1.0


def test_pages_navigation_and_anchors():
    env = make_env("webshop")
    obs = env.reset(1)
    assert obs.anchor == "search" and obs.text.startswith(f"Instruction: {env.goal.instruction}\nPage: Search")
    obs, *_ = env.step(act("search[shampoo lavender]"))
    assert obs.anchor == "results?query=shampoo lavender&page=1" and 10 < len(env.results) <= 50
    assert f"Page 1 (Total results: {len(env.results)})" in obs.text
    assert "click[next >]" in available(obs.text) and "click[< prev]" not in available(obs.text)
    obs, *_ = env.step(act("click[Next >]"))
    assert obs.anchor.endswith("page=2") and "click[< prev]" in available(obs.text)
    asin = env.results[10]
    obs, *_ = env.step(act(f"click[{asin.lower()}]"))
    product = env.catalogue.product(asin)
    assert obs.anchor == f"item?query=shampoo lavender&page=2&asin={asin}" and f"Price: ${product.price:.2f}" in obs.text
    name, values = product.options[0]
    obs, *_ = env.step(act(f"click[{values[1]}]"))
    assert obs.anchor.endswith(f"&options={name}:{values[1]}") and f"{values[1]} (selected)" in obs.text
    for sub, shown in (("description", product.description), ("features", product.features[0])):
        obs, *_ = env.step(act(f"click[{sub}]"))
        assert obs.anchor.startswith(f"{sub}?") and shown in obs.text
        assert available(obs.text) == ["click[back to search]", "click[< prev]"]
        obs, *_ = env.step(act("click[< prev]"))
        assert obs.anchor.startswith("item?") and f"{values[1]} (selected)" in obs.text  # options kept
    obs, *_ = env.step(act("click[< prev]"))
    assert obs.anchor == "results?query=shampoo lavender&page=2"
    obs, _, done, info = env.step(act("click[back to search]"))
    assert obs.anchor == "search" and not done and info["page"] == "search"


def test_invalid_actions_are_no_ops_and_fifteen_steps_end_it():
    env = make_env("webshop")
    first = env.reset(2)
    bad = ["", "search[shoes]", act("click[buy now]"), act("search[]"), act("buy[now]"),
           "<action>search[x]</action>", act("search[a]") + act("search[b]")]
    for text in bad:
        obs, reward, done, info = env.step(text)
        assert (obs.text, reward, done, info["is_action_valid"]) == (first.text, 0.0, False, False)
    env.step(act("search[tea]"))
    obs, _, _, info = env.step(act("search[coffee]"))  # no search box on a results page
    assert not info["is_action_valid"] and obs.anchor == "results?query=tea&page=1"
    for _ in range(15 - len(bad) - 3):
        assert not env.step("nothing")[2]
    _, reward, done, info = env.step("nothing")
    assert done and reward == 0.0 and info["truncated"] and not info["won"]


def test_validation_goals_are_held_out():
    catalogue = catalogue_for(make_env("webshop").config)[0]
    held_out = {goal_for_seed(catalogue.goals, validation_seed(i)) for i in range(100)}
    train = {goal_for_seed(catalogue.goals, s) for s in range(1000)}
    assert len(held_out) == 30 and len(train) == 270 and not held_out & train


# -- malformed output -------------------------------------------------------------------

_ENV = make_env("webshop")
_TAG = {name: re.compile(f"<{name}>", re.I | re.A) for name in ("action", "/action", "think", "/think")}


def rule_says_valid(text: str, on_search_page: bool, clickables: tuple[str, ...]) -> bool:
    """The action rule restated: one think block closing before one action block whose
    content is search[q] (search page, q not blank) or click[x] (x on the page)."""
    found = {name: [m.start() for m in tag.finditer(text)] for name, tag in _TAG.items()}
    if any(len(v) != 1 for v in found.values()):
        return False
    if not found["think"][0] < found["/think"][0] < found["action"][0] < found["/action"][0]:
        return False
    content = text[found["action"][0] + len("<action>") : found["/action"][0]].strip()
    verb, bracket, rest = content.partition("[")
    if verb.lower() not in ("search", "click") or not bracket or not rest.endswith("]") or not rest[:-1].strip():
        return False
    if verb.lower() == "search":
        return on_search_page
    return rest[:-1].strip().lower() in clickables


VALID = [act("search[coffee beans]"), act("click[back to search]"), act("click[next >]"), act("click[buy now]")]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), moves=st.lists(st.one_of(texts, st.sampled_from(VALID)), min_size=1, max_size=8))
def test_fuzz_malformed_output_is_an_invalid_action(seed, moves):
    _ENV.reset(seed)
    for text in moves:
        expected = rule_says_valid(text, _ENV.state.kind == "search", _ENV.clickables())
        obs, reward, done, info = _ENV.step(text)
        assert info["is_action_valid"] == expected and isinstance(reward, float) and isinstance(obs.text, str)
        if done:
            break
