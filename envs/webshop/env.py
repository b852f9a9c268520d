"""The WebShop environment: find and buy the product an instruction asks for.

The model writes `<think>...</think><action>search[query]</action>` on the search page
or `<action>click[element]</action>` with an element the page lists. Anything else
(no or repeated tags, another verb, a search without a search box, an element not on
the page) is an invalid action: a no-op, reward 0, one of the max_steps (15) steps.

"Buy Now" ends the episode: the purchase's score r in [0, 1] (reward.py) is
info["task_score"]; `won` is r == 1. The reward is 10 x won (reward_mode="success",
verl-agent / GiGPO's WebShop) or r itself (reward_mode="score", the WebShop paper's RL
reward). Running out of steps ends the episode with reward 0.

Seeds pick goals: training seed s plays training goal s % n; validation seed i
(VALIDATION_SEED_OFFSET + i) plays held-out goal i % m. The held-out goals are the first
min(500, len(goals) // 10) of the shuffled goals (WebShop tests on its first 500).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import lru_cache

from envs.base import VALIDATION_SEED_OFFSET, Observation, make_info
from envs.projection import action_block
from envs.retrievers import BM25Retriever, Passage
from envs.webshop.catalogue import Catalogue, Goal, load_published
from envs.webshop.generate import generated_catalogue
from envs.webshop.pages import (
    BACK_TO_SEARCH,
    BUY_NOW,
    NEXT_PAGE,
    PREV_PAGE,
    SUB_PAGES,
    PageState,
    clickables,
    render,
)
from envs.webshop.reward import purchase_score

INSTRUCTIONS = (
    "You are shopping on WebShop, a simplified online store. Each observation gives your "
    "instruction, the current page (its elements separated by [SEP]) and the actions "
    "available on it. Search with keywords, open products, choose the options the "
    "instruction asks for and buy the product that fits it best. Reason inside "
    "<think> </think>, then write exactly one available action inside <action> </action>: "
    "search[your keywords] on a page with a search box, or click[element] with an element "
    "listed, for example <action>click[buy now]</action>."
)
REWARD_MODES = ("success", "score")
SUCCESS_REWARD = 10.0
_VERB_ARG = re.compile(r"(search|click)\[(.*)\]", re.IGNORECASE | re.ASCII | re.DOTALL)


@dataclass
class WebShopConfig:
    # A directory with WebShop's published data files; None: the generated catalogue.
    data_dir: str | None = None
    products_file: str = "items_shuffle_1000.json"
    attributes_file: str = "items_ins_v2_1000.json"
    goals_file: str = "items_human_ins.json"
    reviews_file: str = "reviews.json"  # optional
    num_products: int | None = None  # the first N products of products_file
    generated_products: int = 300  # size of the generated catalogue (data_dir None)
    max_steps: int = 15
    reward_mode: str = "success"
    require_think: bool = True
    search_results: int = 50  # results kept per search (WebShop: 50)
    results_per_page: int = 10
    # Options matched strictly (a size only by itself, colours not reduced to their colour
    # word, a chosen option for one goal option); False: WebShop's rules (reward.py).
    strict_options: bool = False


def parse_webshop_action(text: object, require_think: bool = True) -> tuple[str, str] | None:
    """`<action>search[q]</action>` -> ("search", q); `<action>click[x]</action>` ->
    ("click", x). One action block (and, with require_think, one think block closing
    before it) whose stripped content is verb[argument] with a non-blank argument."""
    action = action_block(text, require_think)
    if action is None:
        return None
    match = _VERB_ARG.fullmatch(action.strip())
    if match is None or not match.group(2).strip():
        return None
    return match.group(1).lower(), match.group(2).strip()


@lru_cache(maxsize=4)
def cached_catalogue(config_key: tuple) -> tuple[Catalogue, BM25Retriever]:
    """One catalogue and one BM25 index per data set per worker process."""
    data_dir, products_file, attributes_file, goals_file, reviews_file, num_products, generated = config_key
    if data_dir is None:
        catalogue = generated_catalogue(generated)
    else:
        catalogue = load_published(data_dir, products_file, attributes_file, goals_file, reviews_file, num_products)
    passages = [Passage(p.asin, p.name, p.search_text()) for p in catalogue.products]
    return catalogue, BM25Retriever(passages)


def catalogue_for(config: WebShopConfig) -> tuple[Catalogue, BM25Retriever]:
    return cached_catalogue((config.data_dir, config.products_file, config.attributes_file, config.goals_file,
                             config.reviews_file, config.num_products, config.generated_products))


def goal_for_seed(goals: tuple[Goal, ...], seed: int) -> Goal:
    held_out = min(500, len(goals) // 10)
    seed = int(seed)
    if seed >= VALIDATION_SEED_OFFSET and held_out:
        return goals[(seed - VALIDATION_SEED_OFFSET) % held_out]
    train = goals[held_out:]
    return train[seed % VALIDATION_SEED_OFFSET % len(train)]


class WebShopEnv:
    @staticmethod
    def instructions_for(config: WebShopConfig) -> str:
        return INSTRUCTIONS

    def __init__(self, config: WebShopConfig):
        if config.reward_mode not in REWARD_MODES:
            raise ValueError(f"reward_mode={config.reward_mode!r}; choose one of {REWARD_MODES}")
        self.config = config
        self.catalogue, self.retriever = catalogue_for(config)
        self.goal: Goal | None = None
        self.state = PageState()
        self.results: tuple[str, ...] = ()
        self.steps = 0
        self.score = 0.0

    # -- what the model sees ------------------------------------------------------
    def clickables(self) -> tuple[str, ...]:
        return clickables(self.state, self.results, self.catalogue, self.config.results_per_page)

    def available_actions(self) -> list[str]:
        search = ["search[<your keywords>]"] if self.state.kind == "search" else []
        return search + [f"click[{c}]" for c in self.clickables()]

    def _observation(self) -> Observation:
        page = render(self.state, self.results, self.catalogue, self.config.results_per_page, self.score)
        text = "\n".join((f"Instruction: {self.goal.instruction}", f"Page: {page}",
                          "Available actions:", *self.available_actions()))
        return Observation(text=text, image=None, anchor=self.state.url)

    # -- episode ------------------------------------------------------------------
    def reset(self, seed: int) -> Observation:
        self.goal = goal_for_seed(self.catalogue.goals, seed)
        self.state, self.results, self.steps, self.score = PageState(), (), 0, 0.0
        return self._observation()

    def step(self, text: str) -> tuple[Observation, float, bool, dict]:
        if self.goal is None:
            raise RuntimeError("step() before reset()")
        if self.state.kind == "done" or self.steps >= self.config.max_steps:
            return self._observation(), 0.0, True, self._info(None, False)
        action = self._validate(parse_webshop_action(text, self.config.require_think))
        self.steps += 1
        extras = {}
        if action is not None:
            extras = self._apply(*action)
        bought = self.state.kind == "done"
        won = bought and self.score == 1.0
        reward = (SUCCESS_REWARD * won if self.config.reward_mode == "success" else self.score) if bought else 0.0
        done = bought or self.steps >= self.config.max_steps
        info = self._info(action, won, truncated=done and not bought, **extras)
        return self._observation(), float(reward), done, info

    def _info(self, action: tuple[str, str] | None, won: bool, **extras) -> dict:
        return make_info(
            action is not None, won,
            action=f"{action[0]}[{action[1]}]" if action else None,
            task_score=self.score, task_type=self.goal.category, page=self.state.kind,
            available_actions=self.available_actions(), **extras,
        )

    def _validate(self, action: tuple[str, str] | None) -> tuple[str, str] | None:
        if action is None:
            return None
        verb, arg = action
        if verb == "search":
            return (verb, arg.lower()) if self.state.kind == "search" else None
        arg = arg.lower()
        return (verb, arg) if arg in self.clickables() else None

    def _apply(self, verb: str, arg: str) -> dict:
        state = self.state
        if verb == "search":
            hits = self.retriever.search(arg, self.config.search_results)
            self.results = tuple(p.id for p, _ in hits)
            self.state = PageState("results", query=arg, page=1)
        elif arg == BACK_TO_SEARCH:
            self.state, self.results = PageState(), ()
        elif state.kind == "results" and arg in (NEXT_PAGE, PREV_PAGE):
            self.state = replace(state, page=state.page + (1 if arg == NEXT_PAGE else -1))
        elif state.kind == "results":
            asin = next(a for a in self.results if a.lower() == arg)
            self.state = replace(state, kind="item", asin=asin, options=())
        elif state.kind == "item" and arg == PREV_PAGE:
            self.state = replace(state, kind="results", asin="", options=())
        elif state.kind == "item" and arg in SUB_PAGES:
            self.state = replace(state, kind=arg)
        elif state.kind == "item" and arg == BUY_NOW:
            return self._buy()
        elif state.kind == "item":
            product = self.catalogue.product(state.asin)
            self.state = state.with_option(product.option_of(arg), arg)
        else:  # "< prev" on a sub-page
            self.state = replace(state, kind="item")
        return {}

    def _buy(self) -> dict:
        product = self.catalogue.product(self.state.asin)
        result = purchase_score(product, dict(self.state.options), self.goal, self.config.strict_options)
        self.score = result.score
        self.state = replace(self.state, kind="done")
        return {"bought_asin": product.asin, "goal_asin": self.goal.asin, **result.as_info()}
