"""WebShop's purchase score here (envs/webshop/reward.py) against the original code's.

    python bench/webshop_reward_vs_original.py --original DIR [--products 300]
        [--spacy-model NAME | --title-nouns content-words] [--strict-options] [--show 5]

DIR is a checkout of github.com/princeton-nlp/WebShop that you supply; its
web_agent_site/engine/goal.py (`get_reward`, `get_type_reward`, `get_option_reward`) is
imported from there at run time, never copied here. It needs what that module imports:
thefuzz (WebShop pins 0.19.0, which without the optional python-Levenshtein scores with
difflib, as reward.py does; the script says which one it got), rich, spaCy and the
`en_core_web_sm` pipeline (`--spacy-model NAME` loads another installed pipeline in its
place, e.g. a renamed copy of it). `--title-nouns content-words` replaces spaCy by a
stand-in that tags reward.py's title content words as nouns: the title-noun rule then
agrees by construction and its differences go unmeasured.

Purchases are made from the generated catalogue (envs/webshop/generate.py), for every
goal: its product with the goal's options, with each option swapped for each other
value, with no option chosen, and three products of the same type and three of other
types with option values drawn from a fixed seed. Each is scored by both; the script
prints how many agree (score within 1e-6, success = score 1.0 alike) and sorts the
disagreements by the part that differs: r_type (title nouns), goal options hit (split
by the rule behind it), attributes matched. `--strict-options` scores ours with
WebShopConfig(strict_options=True). Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import types
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from envs.webshop import reward as ours  # noqa: E402
from envs.webshop.catalogue import Catalogue, Goal, Product  # noqa: E402
from envs.webshop.generate import generated_catalogue  # noqa: E402

PURCHASE_SEED = 31
OTHERS_OF_SAME_TYPE = 3
OTHERS_OF_OTHER_TYPES = 3


def stand_in_spacy() -> types.ModuleType:
    """A `spacy` module whose pipeline tags reward.py's title content words as nouns."""

    class Token:
        def __init__(self, text: str, noun: bool):
            self.text, self.pos_ = text, "NOUN" if noun else "X"

    def load(_name: str):
        def tag(text: str) -> list[Token]:
            content = set(ours.type_words(text))
            return [Token(w, w in content) for w in ours.words(text)]

        return tag

    module = types.ModuleType("spacy")
    module.load = load
    return module


def import_original(original_dir: str, spacy_model: str | None, title_nouns: str):
    """The original's goal.py (and normalize.py), from the checkout at original_dir."""
    if not os.path.isfile(os.path.join(original_dir, "web_agent_site", "engine", "goal.py")):
        sys.exit(f"{original_dir}: no web_agent_site/engine/goal.py (a checkout of princeton-nlp/WebShop?)")
    sys.path.insert(0, os.path.abspath(original_dir))
    if title_nouns == "content-words":
        sys.modules["spacy"] = stand_in_spacy()
    elif spacy_model:
        import spacy

        load = spacy.load
        spacy.load = lambda name, *a, **k: load(spacy_model if name == "en_core_web_sm" else name, *a, **k)
    try:
        importlib.import_module("rich")
    except ImportError:  # goal.py prints with rich; the reward does not use it
        sys.modules["rich"] = types.SimpleNamespace(print=print)
    try:
        goal_module = importlib.import_module("web_agent_site.engine.goal")
        normalize_module = importlib.import_module("web_agent_site.engine.normalize")
    except (ImportError, OSError) as error:
        sys.exit(f"cannot import the original's goal.py: {error!r}\n"
                 "it needs thefuzz (pip install thefuzz==0.19.0, WebShop's pin), spaCy and en_core_web_sm "
                 "(or --spacy-model NAME, or --title-nouns content-words)")
    if title_nouns == "spacy":  # the same few titles are tagged thousands of times
        tagged, nlp = {}, goal_module.nlp
        goal_module.nlp = lambda text: tagged.setdefault(text, nlp(text))
    return goal_module, normalize_module


def purchases(catalogue: Catalogue, seed: int = PURCHASE_SEED) -> list[tuple[Goal, Product, dict[str, str]]]:
    rng = np.random.default_rng(seed)
    by_query: dict[str, list[Product]] = {}
    for product in catalogue.products:
        by_query.setdefault(product.query, []).append(product)

    def drawn_options(product: Product) -> dict[str, str]:
        return {name: str(values[int(rng.integers(len(values)))]) for name, values in product.options}

    made = []
    for goal in catalogue.goals:
        product = catalogue.product(goal.asin)
        wanted = {product.option_of(v.lower()): v.lower() for v in goal.options}
        made.append((goal, product, wanted))
        for name, values in product.options:
            made += [(goal, product, {**wanted, name: v}) for v in values if v != wanted.get(name)]
        made.append((goal, product, {}))
        same = [p for p in by_query[product.query] if p.asin != product.asin]
        other = [p for p in catalogue.products if p.query != product.query]
        for pool, n in ((same, OTHERS_OF_SAME_TYPE), (other, OTHERS_OF_OTHER_TYPES)):
            for i in rng.choice(len(pool), size=n, replace=False):
                made.append((goal, pool[int(i)], drawn_options(pool[int(i)])))
    return made


def original_product(product: Product) -> dict:
    """The fields of engine.py's load_products that goal.py reads."""
    return {"query": product.query, "product_category": product.product_category, "name": product.name,
            "Title": product.name, "Description": product.description, "BulletPoints": list(product.features),
            "Attributes": list(product.attributes) or ["DUMMY_ATTR"]}


def original_goal(goal: Goal) -> dict:
    """The fields of goal.py's get_human_goals that its reward reads."""
    return {"query": goal.query, "product_category": goal.product_category, "name": goal.name,
            "attributes": list(goal.attributes), "goal_options": list(goal.options), "price_upper": goal.price_upper}


def option_reason(fuzz, normalize_color, chosen: dict[str, str], want: str) -> str:
    """Which of the original's option rules decides this goal option's hit."""
    values = list(chosen.values())

    def hit(vs: list[str], w: str) -> bool:
        return any(fuzz.token_set_ratio(v, w) > 85 for v in vs)

    if hit(values, want) != hit([normalize_color(v) for v in values], normalize_color(want)):
        return "options: colour normalised there (normalize_color)"
    if any(name == "size" and v != want and fuzz.token_set_ratio(v, want) > 85 for name, v in chosen.items()):
        return "options: size matched fuzzily there"
    return "options: other (a chosen option hitting two goal options, similarity)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--original", required=True, help="a checkout of princeton-nlp/WebShop")
    parser.add_argument("--products", type=int, default=300, help="size of the generated catalogue")
    parser.add_argument("--spacy-model", default=None, help="spaCy pipeline to load for en_core_web_sm")
    parser.add_argument("--title-nouns", choices=("spacy", "content-words"), default="spacy")
    parser.add_argument("--strict-options", action="store_true", help="ours with strict_options=True")
    parser.add_argument("--show", type=int, default=5, help="disagreements to print per category")
    args = parser.parse_args()

    goal_module, normalize_module = import_original(args.original, args.spacy_model, args.title_nouns)
    fuzz = goal_module.fuzz
    matcher = getattr(sys.modules.get(fuzz.__name__), "SequenceMatcher", None)
    print(f"original: {os.path.abspath(args.original)}; thefuzz scores with "
          f"{getattr(matcher, '__module__', '?')}.SequenceMatcher; title nouns: "
          f"{args.title_nouns if args.title_nouns != 'spacy' else args.spacy_model or 'en_core_web_sm'}")
    strict = {"strict_options": True} if args.strict_options else {}
    if strict and "strict_options" not in inspect.signature(ours.purchase_score).parameters:
        sys.exit("this reward.py has no strict_options")

    made = purchases(generated_catalogue(args.products))
    same_score = same_success = 0
    categories: Counter = Counter()
    examples: dict[str, list[str]] = {}
    for goal, product, chosen in made:
        mine = ours.purchase_score(product, chosen, goal, **strict)
        theirs, info = goal_module.get_reward(original_product(product), original_goal(goal), price=product.price,
                                              options=chosen, verbose=True)
        same_score += abs(mine.score - theirs) <= 1e-6
        same_success += (mine.score == 1.0) == (theirs == 1.0)
        if abs(mine.score - theirs) <= 1e-6:
            continue
        reasons = []
        if mine.r_type != info["r_type"]:
            reasons.append("r_type: title nouns (spaCy there, content words here)")
        _, their_attributes = goal_module.get_attribute_reward(original_product(product), original_goal(goal))
        if mine.attribute_matches != their_attributes:
            reasons.append("attributes")
        _, their_options = goal_module.get_option_reward(list(chosen.values()), list(goal.options))
        if mine.option_matches != their_options:
            reasons += sorted({option_reason(fuzz, normalize_module.normalize_color, chosen, w) for w in goal.options
                               if goal_module.get_option_reward(list(chosen.values()), [w])[1]
                               != ours.purchase_score(product, chosen, _one_option(goal, w), **strict).option_matches})
        key = " + ".join(reasons) or "other"
        categories[key, (mine.score == 1.0) != (theirs == 1.0)] += 1
        examples.setdefault(key, []).append(
            f"    goal {goal.asin} {list(goal.options)} <- {product.asin} {product.name!r} {chosen}: "
            f"here {mine.score:.4f}, there {theirs:.4f}")

    n = len(made)
    print(f"purchases: {n}; score equal (within 1e-6): {same_score}; success equal: {same_success}")
    print(f"differ: {n - same_score} ({sum(v for (_, flips), v in categories.items() if flips)} change success)")
    for key in sorted({k for k, _ in categories}):
        total = categories[key, False] + categories[key, True]
        print(f"  {total:5d}  {key}  ({categories[key, True]} of them change success)")
        for line in examples[key][: args.show]:
            print(line)


def _one_option(goal: Goal, want: str) -> Goal:
    """The goal with only one of its options (to score that option's hit alone)."""
    return Goal(goal.asin, goal.instruction, goal.attributes, (want,), goal.price_upper, goal.category,
                goal.query, goal.name, goal.product_category)


if __name__ == "__main__":
    main()
