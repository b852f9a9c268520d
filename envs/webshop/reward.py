"""WebShop's reward: how well the bought product (with its chosen options) fits the goal.

    r = r_type * (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[y_price <= u_price])
               / (|U_att| + |U_opt| + 1)

(Yao et al. 2022, eq. 1), with the rules of WebShop's code, which made the published
numbers (web_agent_site/engine/goal.py: `get_reward`, `get_type_reward`,
`get_attribute_reward`, `get_option_reward`; engine/normalize.py: `normalize_color`).
U is the goal, Y the purchase:

- a goal attribute is matched when a product attribute is similar to it (token-set
  similarity > 85 of 100) or it occurs in the product's lowercased title, features or
  description;
- a goal option is matched when any chosen option is similar to it (> 85), both first
  reduced to their colour word (`normalized_colour`); a chosen option may match several
  goal options, and sizes are compared like any option ("x-large" matches "large");
- r_type is 0, 0.1, 0.5 or 1 from the query, the category path and the title nouns
  (`type_reward`).

Similarity is thefuzz 0.19's token_set_ratio (WebShop's pin, which without the optional
python-Levenshtein scores with difflib): an integer 0-100, so "> 85" means 85.5 or more.
Where it still differs (docs/environments.md, WebShop, gives the measured effect): the
title "nouns" are the title's content words here, spaCy's noun and proper-noun tags
there; goal options given as {name: value} are compared as their values. `strict_options=True` (WebShopConfig) keeps a stricter option rule: a size only
matches itself, colours are not reduced, and each chosen option matches one goal option.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher

from envs.webshop.catalogue import Goal, Product

MATCH_THRESHOLD = 85
EXACT_MATCH_OPTIONS = ("size",)  # strict_options only
_NON_ALNUM = re.compile(r"[^0-9a-z]+")
_NON_WORD = re.compile(r"\W")
_LATIN1_SUPPLEMENT = dict.fromkeys(range(0x80, 0x100))  # thefuzz's force_ascii drops these
# Words that are never a product type (spaCy would not tag them as nouns).
_NOT_TYPE_WORDS = frozenset(
    "a an and the of for with in on by to from or at as is are be it its this that "
    "new pack count set x fl oz ounce ounces inch inches lb lbs ml cm mm kg g".split()
)
# The colour words of WebShop's normalize.py (COLOR_SET), in alphabetical order: the
# first one found in an option value names its colour.
COLOUR_WORDS = tuple(sorted("""
    alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux bronze
    brown burgundy camel camo caramel champagne charcoal cheetah chestnut chocolate
    christmas coffee cognac copper coral cranberry cream crystal dark denim eggplant
    elephant espresso fuchsia gold granite grape graphite grass gray green grey heather
    indigo ivory ivy khaki lavender lemon leopard light lilac lime magenta maroon mauve
    merlot midnight mint mocha multicolor mushroom mustard natural navy nude olive orange
    peach pewter pink plum purple rainbow red rose royal rust sand sapphire seashell silver
    skull slate steel stone stonewash sunflower tan taupe teal tiger turquoise violet
    walnut wheat white wine yellow
""".split()))


def words(text: str) -> list[str]:
    return _NON_ALNUM.sub(" ", text.lower()).split()


def similarity_tokens(text: str) -> set[str]:
    """The words thefuzz compares: U+0080-U+00FF dropped, non-word characters made
    spaces, lowercased (its full_process with force_ascii)."""
    return set(_NON_WORD.sub(" ", text.translate(_LATIN1_SUPPLEMENT)).lower().split())


def _percent_alike(a: str, b: str) -> int:
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * SequenceMatcher(None, a, b).ratio()))


def token_set_similarity(a: str, b: str) -> int:
    """0-100: how alike two phrases are as sets of words; 100 when one's words are a
    subset of the other's. The shared words, sorted, are compared with each side's
    shared-then-own words, and the two sides with each other; the best rounded
    percentage counts (thefuzz 0.19 token_set_ratio, argument order kept)."""
    tokens_a, tokens_b = similarity_tokens(a), similarity_tokens(b)
    if not tokens_a or not tokens_b:
        return 0
    shared = " ".join(sorted(tokens_a & tokens_b))
    side_a = " ".join(filter(None, (shared, " ".join(sorted(tokens_a - tokens_b)))))
    side_b = " ".join(filter(None, (shared, " ".join(sorted(tokens_b - tokens_a)))))
    return max(_percent_alike(shared, side_a), _percent_alike(shared, side_b), _percent_alike(side_a, side_b))


def normalized_colour(value: str) -> str:
    """The first colour word (alphabetically) inside the value, case-sensitive; the value
    itself when none is (normalize_color's rule): "light pink" -> "light"."""
    return next((colour for colour in COLOUR_WORDS if colour in value), value)


def type_words(title: str) -> list[str]:
    """Stand-in for the title's spaCy nouns: its content words, in order, repeats kept."""
    return [w for w in words(title) if w.isalpha() and len(w) > 1 and w not in _NOT_TYPE_WORDS]


def category_levels(path: str) -> set[str]:
    return {level.strip() for level in path.split("›")}


@dataclass(frozen=True)
class TypeMatch:
    query_match: bool
    category_match: bool
    title_score: float

    @property
    def r_type(self) -> float:
        if self.title_score == 0.0:
            return 0.0
        if self.title_score < 0.1:
            return 0.1
        if self.query_match or self.category_match or self.title_score > 0.2:
            return 1.0
        return 0.5


def type_reward(product: Product, goal: Goal) -> TypeMatch:
    wanted = type_words(goal.name)
    shared = set(type_words(product.name)) & set(wanted)
    return TypeMatch(
        query_match=product.query == goal.query,
        category_match=len(category_levels(product.product_category) & category_levels(goal.product_category)) >= 2,
        title_score=len(shared) / len(wanted) if wanted else 0.2,
    )


def attribute_matches(product: Product, goal: Goal) -> int:
    texts = (product.name.lower(), " ".join(product.features).lower(), product.description.lower())
    return sum(
        any(token_set_similarity(have, want) > MATCH_THRESHOLD for have in product.attributes)
        or any(want in text for text in texts)
        for want in goal.attributes
    )


def option_hits(chosen: dict[str, str], goal_options: Sequence[str], strict: bool = False) -> tuple[bool, ...]:
    """Per goal option, whether the chosen options ({option name: value}) match it."""
    if not strict:
        have = [normalized_colour(value) for value in chosen.values()]
        return tuple(
            any(token_set_similarity(h, normalized_colour(want)) > MATCH_THRESHOLD for h in have)
            for want in goal_options
        )
    unused, hits = dict(chosen), []
    for want in goal_options:
        match = next((name for name, value in unused.items()
                      if (value.lower() == want.lower() if name.lower() in EXACT_MATCH_OPTIONS
                          else token_set_similarity(value, want) > MATCH_THRESHOLD)), None)
        hits.append(match is not None)
        unused.pop(match, None)
    return tuple(hits)


def option_matches(chosen: dict[str, str], goal: Goal, strict: bool = False) -> int:
    return sum(option_hits(chosen, goal.options, strict))


@dataclass(frozen=True)
class PurchaseScore:
    score: float
    r_type: float
    attribute_matches: int
    option_matches: int
    price_ok: bool

    def as_info(self) -> dict:
        return {"r_type": self.r_type, "attribute_matches": self.attribute_matches,
                "option_matches": self.option_matches, "price_ok": self.price_ok}


def purchase_score(product: Product, chosen: dict[str, str], goal: Goal, strict_options: bool = False) -> PurchaseScore:
    r_type = type_reward(product, goal).r_type
    n_att = attribute_matches(product, goal)
    n_opt = option_matches(chosen, goal, strict_options)
    price_ok = product.price <= goal.price_upper
    # In goal.py's order of operations, so equal counts give bit-equal scores.
    score = (n_att + n_opt + int(price_ok)) / (len(goal.attributes) + len(goal.options) + 1) * r_type
    return PurchaseScore(score, r_type, n_att, n_opt, price_ok)
