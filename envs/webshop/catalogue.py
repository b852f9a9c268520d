"""Products and goals of WebShop, read from the published data files' schema.

The published files (Yao et al. 2022, github.com/princeton-nlp/WebShop, `data/`):

- `items_shuffle_1000.json` (or `items_shuffle.json`, 1.18M): a JSON list of products,
  each with `asin`, `name`, `category`, `query`, `product_category` ("A › B › C"),
  `full_description`, `small_description` (a list of bullet points or one string),
  `pricing` ("$12.99" or "$10.00 - $20.00"), `customization_options`
  ({option name: [{"value": ..., "image": ...}, ...]} or null), `images`.
- `items_ins_v2_1000.json`: {asin: {"attributes": [...], ...}}, the product's attributes.
- `items_human_ins.json`: {asin: [{"instruction", "instruction_attributes",
  "instruction_options"}, ...]}, the human-written goals (instruction_options: a list
  of option values, or {option name: value}).
- `reviews.json` (optional): [{"asin", "average_rating", "reviews": [{"title", "score"
  or "stars", "body" or "review"}]}].

`catalogue_from_records` builds the same Catalogue from the in-memory records the
generator (generate.py) makes, so both paths share one parser.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from envs.base import seeded_rng

# WebShop's price bound for a goal: two of the first four multiples of 10 above the
# product's price are drawn and the larger is the bound.
PRICE_STEPS = tuple(10.0 * i for i in range(1, 100))
NO_PRICE_BOUND = 1_000_000.0
DEFAULT_PRICE = 100.0


@dataclass(frozen=True)
class Product:
    asin: str
    name: str
    category: str
    query: str
    product_category: str
    description: str
    features: tuple[str, ...]
    pricing: tuple[float, ...]
    price: float  # the one price a buyer pays (drawn in the range, as WebShop does)
    options: tuple[tuple[str, tuple[str, ...]], ...]  # ((option name, (values...)), ...)
    attributes: tuple[str, ...]
    rating: str = "N.A."
    reviews: tuple[str, ...] = ()

    def option_of(self, value: str) -> str | None:
        """The option name a value belongs to (the first, when two share a value)."""
        for name, values in self.options:
            if value in values:
                return name
        return None

    def search_text(self) -> str:
        option_words = " ".join(v for _, values in self.options for v in values)
        return " ".join((self.description, " ".join(self.features), " ".join(self.attributes), option_words))


@dataclass(frozen=True)
class Goal:
    asin: str  # the product the instruction was written for
    instruction: str
    attributes: tuple[str, ...]
    options: tuple[str, ...]  # option values, as the goal file writes them (colour words are case-sensitive)
    price_upper: float
    category: str
    query: str
    name: str
    product_category: str


@dataclass(frozen=True)
class Catalogue:
    products: tuple[Product, ...]
    goals: tuple[Goal, ...]

    def product(self, asin: str) -> Product:
        return self._by_asin()[asin]

    def _by_asin(self) -> dict[str, Product]:
        cached = self.__dict__.get("_index")
        if cached is None:
            cached = {p.asin: p for p in self.products}
            object.__setattr__(self, "_index", cached)
        return cached


def parse_pricing(pricing: object) -> tuple[float, ...]:
    """"$12.99" -> (12.99,); "$10.00 - $20.00" -> (10.0, 20.0); missing -> (100.0,)."""
    if not pricing or not isinstance(pricing, str):
        return (DEFAULT_PRICE,)
    prices = []
    for piece in pricing.split("$")[1:]:
        digits = re.sub(r"[^\d.]", "", piece)
        try:
            prices.append(float(digits))
        except ValueError:
            continue
    return tuple(prices[:2]) or (DEFAULT_PRICE,)


def paid_price(pricing: tuple[float, ...], asin: str) -> float:
    """One price per product: the price, or a draw in the range seeded by the asin."""
    if len(pricing) == 1:
        return round(pricing[0], 2)
    rng = seeded_rng(int.from_bytes(asin.encode()[:8].ljust(8, b"\0"), "little"))
    return round(float(rng.uniform(pricing[0], pricing[1])), 2)


def parse_options(customization: object) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Option names and values lowercased, "/" written " | ", as WebShop shows them."""
    if not isinstance(customization, dict):
        return ()
    options = []
    for name, contents in customization.items():
        if not contents:
            continue
        values = tuple(
            dict.fromkeys(str(c["value"]).strip().replace("/", " | ").lower() for c in contents if "value" in c)
        )
        if values:
            options.append((str(name).lower(), values))
    return tuple(options)


def review_lines(record: dict | None) -> tuple[str, tuple[str, ...]]:
    if not record:
        return "N.A.", ()
    lines = []
    for r in record.get("reviews") or []:
        score = r.get("score", r.get("stars", ""))
        body = r.get("body", r.get("review", ""))
        lines.append(f"{r.get('title', '')} ({score} stars) {body}".strip())
    return str(record.get("average_rating", "N.A.")), tuple(lines)


def product_from_record(record: dict, attributes: dict, reviews: dict) -> Product:
    asin = str(record["asin"])
    bullets = record.get("small_description") or []
    pricing = parse_pricing(record.get("pricing"))
    rating, review_texts = review_lines(reviews.get(asin))
    return Product(
        asin=asin,
        name=str(record.get("name", "")),
        category=str(record.get("category", "")),
        query=str(record.get("query", "")).lower().strip(),
        product_category=str(record.get("product_category", "")),
        description=str(record.get("full_description") or ""),
        features=tuple(map(str, bullets)) if isinstance(bullets, list) else (str(bullets),),
        pricing=pricing,
        price=paid_price(pricing, asin),
        options=parse_options(record.get("customization_options")),
        attributes=tuple(attributes.get(asin, {}).get("attributes") or ()),
        rating=rating,
        reviews=review_texts,
    )


def price_bound(price: float, rng: np.random.Generator) -> float:
    steps = [p for p in PRICE_STEPS if p > price][:4]
    if len(steps) < 2:
        return NO_PRICE_BOUND
    return float(max(rng.choice(steps, size=2, replace=False)))


def goals_from_records(products: tuple[Product, ...], human_ins: dict, seed: int) -> list[Goal]:
    """One Goal per human instruction with attributes, in product order; the price
    bound is drawn per goal from `seed` (WebShop draws it at load time too)."""
    rng = seeded_rng(seed)
    goals = []
    for product in products:
        for ins in human_ins.get(product.asin) or []:
            attributes = tuple(ins.get("instruction_attributes") or ())
            if not attributes:
                continue  # WebShop skips these too
            options = ins.get("instruction_options") or []
            options = tuple(options.values()) if isinstance(options, dict) else tuple(options)
            upper = float(ins["price_upper"]) if "price_upper" in ins else price_bound(product.price, rng)
            text = str(ins["instruction"]).strip().strip(".")
            if upper < NO_PRICE_BOUND and "price_upper" not in ins:
                text += f", and price lower than {upper:.2f} dollars"
            goals.append(
                Goal(product.asin, text, attributes, tuple(str(o) for o in options), upper,
                     product.category, product.query, product.name, product.product_category)
            )
    return goals


def catalogue_from_records(
    products: list[dict], attributes: dict, human_ins: dict, reviews: list | None = None,
    num_products: int | None = None, seed: int = 233,
) -> Catalogue:
    """Products (first `num_products`, duplicates and malformed asins dropped, as
    WebShop does) and their goals, shuffled with a fixed seed."""
    by_asin_reviews = {str(r["asin"]): r for r in reviews or []}
    kept, seen = [], set()
    for record in products[:num_products] if num_products else products:
        asin = str(record.get("asin", "nan"))
        if asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        kept.append(product_from_record(record, attributes, by_asin_reviews))
    kept = tuple(kept)
    goals = goals_from_records(kept, human_ins, seed)
    order = seeded_rng(seed).permutation(len(goals))
    return Catalogue(kept, tuple(goals[i] for i in order))


def _read_json(path: Path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_published(
    data_dir: str | Path, products_file: str, attributes_file: str, goals_file: str,
    reviews_file: str = "reviews.json", num_products: int | None = None,
) -> Catalogue:
    """The published WebShop files in `data_dir` (reviews optional)."""
    data_dir = Path(data_dir)
    for name in (products_file, attributes_file, goals_file):
        if not (data_dir / name).is_file():
            raise FileNotFoundError(
                f"{data_dir / name} not found: WebShop's data files (see docs/environments.md, WebShop)"
            )
    reviews_path = data_dir / reviews_file
    catalogue = catalogue_from_records(
        _read_json(data_dir / products_file),
        _read_json(data_dir / attributes_file),
        _read_json(data_dir / goals_file),
        _read_json(reviews_path) if reviews_path.is_file() else None,
        num_products=num_products,
    )
    if not catalogue.goals:
        raise ValueError(f"{data_dir}: no goal of {goals_file} is about a product of {products_file}")
    return catalogue
