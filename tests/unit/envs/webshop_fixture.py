"""Three products in WebShop's published file schema, written by hand for the tests.

A is the goal's product (shampoo); B is another shampoo that shares one goal
attribute and one goal option; C is coffee (another product type). "nan" and a
duplicate of A are dropped by the loader, as WebShop drops them.
"""

from __future__ import annotations

import json
from pathlib import Path

SHAMPOO_PATH = "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos"

PRODUCT_A = {
    "asin": "B0AAAAAAA1", "name": "Herbwell Lavender Shampoo", "category": "beauty", "query": "Shampoo ",
    "product_category": SHAMPOO_PATH,
    "full_description": "A gentle shampoo that keeps its scent all day.",
    "small_description": ["Sulfate free formula.", "Long lasting scent."],
    "pricing": "$12.99",
    "customization_options": {
        "Scent": [{"value": "Lavender", "image": None}, {"value": "Rose/Vanilla", "image": None}],
        "Size": [{"value": "8 fl oz", "image": None}, {"value": "16 fl oz", "image": None}],
    },
    "images": ["a.jpg"],
}
PRODUCT_B = {
    "asin": "B0BBBBBBB2", "name": "Moonrise Gentle Shampoo", "category": "beauty", "query": "shampoo",
    "product_category": SHAMPOO_PATH,
    "full_description": "Everyday shampoo.",
    "small_description": "Paraben free.",
    "pricing": "$14.00 - $16.00",
    "customization_options": {
        "scent": [{"value": "lavender"}, {"value": "coconut"}],
        "size": [{"value": "8 fl oz"}, {"value": "32 fl oz"}],
    },
    "images": ["b.jpg"],
}
PRODUCT_C = {
    "asin": "B0CCCCCCC3", "name": "Roastery Dark Coffee Beans", "category": "grocery", "query": "coffee beans",
    "product_category": "Grocery & Gourmet Food › Beverages › Coffee",
    "full_description": "Whole beans, dark roast.", "small_description": [],
    "pricing": "$250.00", "customization_options": None, "images": ["c.jpg"],
}
PRODUCTS = [PRODUCT_A, PRODUCT_B, PRODUCT_C, {**PRODUCT_A, "name": "duplicate"}, {**PRODUCT_C, "asin": "nan"}]
ATTRIBUTES = {
    "B0AAAAAAA1": {"attributes": ["sulfate free", "long lasting"], "instruction": "unused"},
    "B0BBBBBBB2": {"attributes": ["sulfate free", "paraben free"]},
    "B0CCCCCCC3": {"attributes": ["dark roast"]},
}
HUMAN_INS = {
    "B0AAAAAAA1": [
        {"instruction": "i want a sulfate free and long lasting shampoo in lavender scent, 16 fl oz.",
         "instruction_attributes": ["sulfate free", "long lasting"],
         "instruction_options": ["lavender", "16 fl oz"]},
        {"instruction": "no attributes: skipped", "instruction_attributes": [], "instruction_options": []},
    ],
}
REVIEWS = [{"asin": "B0AAAAAAA1", "average_rating": 4.5,
            "reviews": [{"title": "Lovely", "stars": 5, "review": "Smells great."}]}]
FILES = {"items_shuffle_1000.json": PRODUCTS, "items_ins_v2_1000.json": ATTRIBUTES,
         "items_human_ins.json": HUMAN_INS, "reviews.json": REVIEWS}


def write_fixture(data_dir: Path) -> Path:
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, content in FILES.items():
        (data_dir / name).write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
    return data_dir
