"""A small WebShop catalogue generated from a fixed seed, in the published files' schema.

Ten product types over five categories (beauty, fashion, grocery, electronics,
furniture); each product has a brand, three attributes of its type, values for its
type's options, a price, a description, features and a few reviews; each product has
one goal written from two of its attributes and one value of each option. The records
go through the same parser as the published files (catalogue.catalogue_from_records).

    python -m envs.webshop.generate --out DIR [--products 300]

writes DIR/items_shuffle_1000.json, items_ins_v2_1000.json, items_human_ins.json and
reviews.json, a data_dir the env can load like WebShop's own.
"""

from __future__ import annotations

import argparse
import json
from functools import lru_cache
from pathlib import Path

from envs.base import seeded_rng
from envs.webshop.catalogue import Catalogue, catalogue_from_records

GENERATOR_SEED = 2022

# (category, query, title noun, category path, attribute pool, options, price range)
PRODUCT_TYPES = (
    ("beauty", "shampoo", "Shampoo", "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
     ("sulfate free", "paraben free", "natural ingredients", "dry hair", "color treated hair", "cruelty free"),
     {"size": ("8 fl oz", "16 fl oz", "32 fl oz"), "scent": ("lavender", "coconut", "eucalyptus", "unscented")},
     (6, 30)),
    ("beauty", "face moisturizer", "Face Moisturizer", "Beauty & Personal Care › Skin Care › Face › Moisturizers",
     ("hyaluronic acid", "sensitive skin", "oil free", "fragrance free", "anti aging", "spf 30"),
     {"size": ("1.7 ounce", "3.4 ounce")}, (10, 45)),
    ("fashion", "men's t-shirt", "T-Shirt", "Clothing, Shoes & Jewelry › Men › Clothing › Shirts › T-Shirts",
     ("machine wash", "cotton spandex", "short sleeve", "relaxed fit", "moisture wicking", "long sleeve"),
     {"color": ("black", "navy", "heather grey", "white", "olive green"),
      "size": ("small", "medium", "large", "x-large")}, (9, 35)),
    ("fashion", "running shoes", "Running Shoes", "Clothing, Shoes & Jewelry › Women › Shoes › Athletic › Running",
     ("rubber sole", "lace up", "memory foam", "non slip", "breathable mesh", "lightweight"),
     {"color": ("black white", "pink", "royal blue", "grey"), "size": ("6", "7", "8", "9", "10")}, (30, 90)),
    ("grocery", "coffee beans", "Whole Bean Coffee", "Grocery & Gourmet Food › Beverages › Coffee › Whole Beans",
     ("dark roast", "medium roast", "fair trade", "usda organic", "single origin", "low acid"),
     {"size": ("12 ounce", "2 pound"), "flavor": ("french roast", "hazelnut", "vanilla", "original blend")}, (8, 40)),
    ("grocery", "herbal tea", "Herbal Tea", "Grocery & Gourmet Food › Beverages › Tea › Herbal",
     ("caffeine free", "gluten free", "non gmo", "usda organic", "individually wrapped"),
     {"flavor": ("chamomile", "peppermint", "ginger lemon", "rooibos"),
      "count": ("20 bags", "40 bags", "100 bags")}, (4, 25)),
    ("electronics", "wireless earbuds", "Wireless Earbuds", "Electronics › Headphones, Earbuds & Accessories › Earbuds",
     ("noise cancelling", "bluetooth 5.3", "water resistant", "long battery life", "charging case",
      "built in microphone"),
     {"color": ("black", "white", "midnight blue", "rose gold")}, (20, 120)),
    ("electronics", "phone case", "Phone Case", "Cell Phones & Accessories › Cases, Holsters & Sleeves › Basic Cases",
     ("shockproof", "wireless charging", "slim fit", "raised edges", "clear back"),
     {"color": ("black", "clear", "purple", "forest green"),
      "style": ("iphone 14", "iphone 15", "galaxy s23", "pixel 8")}, (8, 30)),
    ("furniture", "office chair", "Office Chair", "Home & Kitchen › Furniture › Home Office Furniture › Chairs",
     ("lumbar support", "adjustable height", "easy assemble", "swivel wheels", "high back", "breathable mesh"),
     {"color": ("black", "grey", "white", "blue")}, (60, 250)),
    ("furniture", "bookshelf", "Bookshelf", "Home & Kitchen › Furniture › Living Room Furniture › Bookcases",
     ("solid wood", "easy assemble", "storage space", "living room", "space saving"),
     {"color": ("walnut", "white", "espresso", "natural oak"), "size": ("3 tier", "5 tier")}, (35, 160)),
)
# Three brands per category, so a brand never ties products of two categories together.
BRANDS = {
    "beauty": ("Brightvale", "Lumina", "Pellucid"),
    "fashion": ("Foxglen", "Marlow", "Kestrel"),
    "grocery": ("Holloway", "Juniper & Co", "Oakridge"),
    "electronics": ("Cobalt Lane", "Northwind", "Ironbark"),
    "furniture": ("Alderfield", "Everpine", "Greyhaven"),
}
GOAL_TEMPLATES = (
    "i am looking for a {query} that is {a1} and {a2}, {options}",
    "i need {a1} {query} which is {a2}, {options}",
    "find me a {a1} and {a2} {query}, {options}",
)
REVIEW_TEMPLATES = (
    ("Great value", 5, "Exactly as described, the {a} part really shows."),
    ("Works fine", 4, "Does the job. {a} as promised."),
    ("Not for me", 2, "Expected more, although it is {a}."),
)
_ASIN_CHARS = tuple("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789")


def option_phrase(name: str, value: str) -> str:
    return value if name in value else f"{value} {name}"


def new_asin(rng, taken: set[str]) -> str:
    while True:
        asin = "B0" + "".join(rng.choice(_ASIN_CHARS, size=8))
        if asin not in taken:
            taken.add(asin)
            return asin


def pricing_text(rng, low: float, high: float) -> str:
    price = round(float(rng.uniform(low, high))) - 0.01
    if rng.random() < 0.2:
        return f"${price:.2f} - ${price + round(float(rng.uniform(2, 10))):.2f}"
    return f"${price:.2f}"


def product_record(rng, product_type: tuple, asin: str) -> tuple[dict, list[str], dict]:
    """(items_shuffle record, its attributes, its chosen option values by name)."""
    category, query, noun, path, attr_pool, option_pool, (low, high) = product_type
    brand = str(rng.choice(BRANDS[category]))
    attributes = [str(a) for a in rng.choice(attr_pool, size=3, replace=False)]
    options = {}
    for name, values in option_pool.items():
        k = int(rng.integers(2, len(values) + 1))
        options[name] = [str(v) for v in rng.choice(values, size=k, replace=False)]
    name = f"{brand} {attributes[0].title()} {noun}"
    record = {
        "asin": asin, "name": name, "category": category, "query": query, "product_category": path,
        "full_description": f"{name}. A {noun.lower()} by {brand}: {', '.join(attributes)}.",
        "small_description": [f"{a.capitalize()}." for a in attributes] + [f"Made by {brand}."],
        "pricing": pricing_text(rng, low, high),
        "customization_options": {n: [{"value": v, "image": None} for v in vs] for n, vs in options.items()},
        "images": [""],
    }
    return record, attributes, options


def goal_record(rng, query: str, attributes: list[str], options: dict) -> dict:
    a1, a2 = (str(a) for a in rng.choice(attributes, size=2, replace=False))
    wanted = {name: str(rng.choice(values)) for name, values in options.items()}
    options_text = " and ".join(option_phrase(n, v) for n, v in wanted.items())
    template = GOAL_TEMPLATES[int(rng.integers(len(GOAL_TEMPLATES)))]
    return {"instruction": template.format(query=query, a1=a1, a2=a2, options=options_text),
            "instruction_attributes": [a1, a2], "instruction_options": list(wanted.values())}


def review_record(rng, asin: str, attributes: list[str]) -> dict:
    picks = rng.choice(len(REVIEW_TEMPLATES), size=int(rng.integers(0, 3)), replace=False)
    reviews = [{"title": REVIEW_TEMPLATES[i][0], "score": REVIEW_TEMPLATES[i][1],
                "body": REVIEW_TEMPLATES[i][2].format(a=attributes[int(i) % 3])} for i in picks]
    rating = round(sum(r["score"] for r in reviews) / len(reviews), 1) if reviews else "N.A."
    return {"asin": asin, "average_rating": rating, "reviews": reviews}


def generated_records(num_products: int = 300, seed: int = GENERATOR_SEED) -> dict[str, object]:
    """The four published files' contents, keyed by file name."""
    rng = seeded_rng(seed)
    products, attributes, goals, reviews, taken = [], {}, {}, [], set()
    for n in range(num_products):
        product_type = PRODUCT_TYPES[n % len(PRODUCT_TYPES)]
        asin = new_asin(rng, taken)
        record, attrs, options = product_record(rng, product_type, asin)
        products.append(record)
        attributes[asin] = {"attributes": attrs}
        goals[asin] = [goal_record(rng, product_type[1], attrs, options)]
        reviews.append(review_record(rng, asin, attrs))
    order = rng.permutation(num_products)  # "items_shuffle": products in no particular order
    return {"items_shuffle_1000.json": [products[i] for i in order], "items_ins_v2_1000.json": attributes,
            "items_human_ins.json": goals, "reviews.json": reviews}


@lru_cache(maxsize=2)
def generated_catalogue(num_products: int = 300) -> Catalogue:
    files = generated_records(num_products)
    return catalogue_from_records(files["items_shuffle_1000.json"], files["items_ins_v2_1000.json"],
                                  files["items_human_ins.json"], files["reviews.json"])


def write_generated_files(out_dir: str | Path, num_products: int = 300) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in generated_records(num_products).items():
        (out_dir / name).write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        written.append(out_dir / name)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a generated WebShop catalogue in the published schema.")
    parser.add_argument("--out", required=True)
    parser.add_argument("--products", type=int, default=300)
    args = parser.parse_args()
    for path in write_generated_files(args.out, args.products):
        print(path)


if __name__ == "__main__":
    main()
