"""WebShop's reward: how well the bought product (with its chosen options) fits the goal.

    r = r_type * (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[y_price <= u_price])
               / (|U_att| + |U_opt| + 1)

(Yao et al. 2022, eq. 1.) U is the goal, Y the purchase:

- a goal attribute is matched when a product attribute is similar to it (token-set
  similarity > 85 of 100) or it occurs in the product's title, features or description;
- a goal option is matched by a chosen option: exactly for an option named "size",
  by token-set similarity > 85 otherwise; each chosen option matches one goal option;
- r_type is 0, 0.1, 0.5 or 1 from the query, the category path and the title words
  (`type_reward`).

Where this differs from WebShop's code (docs/environments.md says why): token-set
similarity is difflib's ratio instead of Levenshtein's (thefuzz); title "nouns" are
the title's content words (no spaCy tagger); colours are not normalised; option
matches count goal options hit by chosen options (the paper's intersection), not
chosen options found anywhere in the product text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from difflib import SequenceMatcher

from envs.webshop.catalogue import Goal, Product

MATCH_THRESHOLD = 85.0
EXACT_MATCH_OPTIONS = ("size",)
_NON_ALNUM = re.compile(r"[^0-9a-z]+")
# Words that are never a product type (spaCy would not tag them as nouns).
_NOT_TYPE_WORDS = frozenset(
    "a an and the of for with in on by to from or at as is are be it its this that "
    "new pack count set x fl oz ounce ounces inch inches lb lbs ml cm mm kg g".split()
)


def words(text: str) -> list[str]:
    return _NON_ALNUM.sub(" ", text.lower()).split()


def token_set_similarity(a: str, b: str) -> float:
    """0-100: how alike two phrases are as sets of words; 100 when one's words are a
    subset of the other's (the token-set ratio of fuzzy matching)."""
    set_a, set_b = set(words(a)), set(words(b))
    if not set_a or not set_b:
        return 0.0
    common = " ".join(sorted(set_a & set_b))
    left = " ".join(filter(None, (common, " ".join(sorted(set_a - set_b)))))
    right = " ".join(filter(None, (common, " ".join(sorted(set_b - set_a)))))
    if common and (left == common or right == common):
        return 100.0
    pairs = ((common, left), (common, right), (left, right))
    return 100.0 * max(SequenceMatcher(None, x, y).ratio() for x, y in pairs)


def type_words(title: str) -> set[str]:
    return {w for w in words(title) if w.isalpha() and len(w) > 1 and w not in _NOT_TYPE_WORDS}


def category_levels(path: str) -> set[str]:
    return {level.strip() for level in path.split("›") if level.strip()}


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
    title_score = len(type_words(product.name) & wanted) / len(wanted) if wanted else 0.2
    return TypeMatch(
        query_match=product.query == goal.query,
        category_match=len(category_levels(product.product_category) & category_levels(goal.product_category)) >= 2,
        title_score=title_score,
    )


def attribute_matches(product: Product, goal: Goal) -> int:
    text = " ".join((product.name, " ".join(product.features), product.description)).lower()
    return sum(
        any(token_set_similarity(have, want) > MATCH_THRESHOLD for have in product.attributes) or want.lower() in text
        for want in goal.attributes
    )


def option_matches(chosen: dict[str, str], goal: Goal) -> int:
    unused = dict(chosen)
    hits = 0
    for want in goal.options:
        for name, value in unused.items():
            exact = name.lower() in EXACT_MATCH_OPTIONS
            if (value == want) if exact else token_set_similarity(value, want) > MATCH_THRESHOLD:
                hits += 1
                del unused[name]
                break
    return hits


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


def purchase_score(product: Product, chosen: dict[str, str], goal: Goal) -> PurchaseScore:
    r_type = type_reward(product, goal).r_type
    n_att = attribute_matches(product, goal)
    n_opt = option_matches(chosen, goal)
    price_ok = product.price <= goal.price_upper
    score = r_type * (n_att + n_opt + int(price_ok)) / (len(goal.attributes) + len(goal.options) + 1)
    return PurchaseScore(score, r_type, n_att, n_opt, price_ok)
