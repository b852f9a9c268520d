"""The pages of the WebShop site, as text, and what can be clicked on each.

Pages: the search page (a search box), results (10 products a page, "Next >" and
"< Prev"), a product's item page (its options, "Description", "Features", "Reviews",
"Buy Now"), the three item sub-pages, and the done page after "Buy Now". Every page
but the search page and the done page has "Back to Search". Page text joins the page's
elements with " [SEP] ", as WebShop's simple text mode does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from envs.webshop.catalogue import Catalogue, Product

BACK_TO_SEARCH = "back to search"
NEXT_PAGE = "next >"
PREV_PAGE = "< prev"
BUY_NOW = "buy now"
SUB_PAGES = {"description": "Description", "features": "Features", "reviews": "Reviews"}
SEP = " [SEP] "


@dataclass(frozen=True)
class PageState:
    """Where the shopper is: page kind, search query and results page, product and the
    options chosen on it. `url` is the state as a string (the GiGPO anchor)."""

    kind: str = "search"  # search | results | item | description | features | reviews | done
    query: str = ""
    page: int = 1
    asin: str = ""
    options: tuple[tuple[str, str], ...] = field(default=())

    @property
    def url(self) -> str:
        if self.kind == "search":
            return "search"
        parts = [f"query={self.query}", f"page={self.page}"]
        if self.asin:
            parts.append(f"asin={self.asin}")
        if self.options:
            parts.append("options=" + ",".join(f"{k}:{v}" for k, v in self.options))
        return f"{self.kind}?" + "&".join(parts)

    def with_option(self, name: str, value: str) -> PageState:
        chosen = dict(self.options)
        chosen[name] = value
        return replace(self, options=tuple(sorted(chosen.items())))


def page_count(num_results: int, per_page: int) -> int:
    return max(1, -(-num_results // per_page))


def page_items(results: tuple[str, ...], page: int, per_page: int) -> tuple[str, ...]:
    return results[(page - 1) * per_page : page * per_page]


def clickables(state: PageState, results: tuple[str, ...], catalogue: Catalogue, per_page: int) -> tuple[str, ...]:
    """What can be clicked on the page, lowercased (the button texts, item ids, option values)."""
    if state.kind in ("search", "done"):
        return ()
    if state.kind == "results":
        nav = [BACK_TO_SEARCH]
        if state.page > 1:
            nav.append(PREV_PAGE)
        if state.page < page_count(len(results), per_page):
            nav.append(NEXT_PAGE)
        return tuple(nav) + tuple(a.lower() for a in page_items(results, state.page, per_page))
    if state.kind == "item":
        product = catalogue.product(state.asin)
        values = [v for _, vs in product.options for v in vs]
        buttons = (BACK_TO_SEARCH, PREV_PAGE, *SUB_PAGES, BUY_NOW)
        return tuple(dict.fromkeys((*buttons[:2], *values, *buttons[2:])))
    return (BACK_TO_SEARCH, PREV_PAGE)


def render(state: PageState, results: tuple[str, ...], catalogue: Catalogue, per_page: int, score: float = 0.0) -> str:
    if state.kind == "search":
        return "Search"
    if state.kind == "done":
        return SEP.join(("Thank you for shopping with us!", f"Your score (min 0.0, max 1.0): {score:.4f}"))
    if state.kind == "results":
        return render_results(state, results, catalogue, per_page)
    product = catalogue.product(state.asin)
    if state.kind == "item":
        return render_item(product, dict(state.options))
    return SEP.join(("Back to Search", "< Prev", *sub_page_elements(product, state.kind)))


def render_results(state: PageState, results: tuple[str, ...], catalogue: Catalogue, per_page: int) -> str:
    elements = ["Back to Search", f"Page {state.page} (Total results: {len(results)})"]
    if state.page > 1:
        elements.append("< Prev")
    if state.page < page_count(len(results), per_page):
        elements.append("Next >")
    for asin in page_items(results, state.page, per_page):
        product = catalogue.product(asin)
        elements += [asin, product.name, price_tag(product)]
    return SEP.join(elements)


def render_item(product: Product, chosen: dict[str, str]) -> str:
    elements = ["Back to Search", "< Prev"]
    for name, values in product.options:
        elements.append(name)
        elements += [f"{v} (selected)" if chosen.get(name) == v else v for v in values]
    elements += [product.name, f"Price: ${product.price:.2f}", f"Rating: {product.rating}",
                 "Description", "Features", "Reviews", "Buy Now"]
    return SEP.join(elements)


def sub_page_elements(product: Product, kind: str) -> tuple[str, ...]:
    if kind == "description":
        return (product.description or "No description.",)
    if kind == "features":
        return product.features or ("No features.",)
    return product.reviews or ("No reviews.",)


def price_tag(product: Product) -> str:
    return " to ".join(f"${p:.2f}" for p in product.pricing)
