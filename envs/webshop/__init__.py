"""WebShop (Yao et al. 2022): find and buy the product an instruction asks for.

Modules: catalogue.py (products and goals, the published files' loader), generate.py
(the small generated catalogue), pages.py (the site's pages as text), reward.py (the
purchase score), env.py (the environment, registered as "webshop").
"""

from envs.registry import register_env
from envs.webshop.catalogue import Catalogue, Goal, Product, load_published
from envs.webshop.env import WebShopConfig, WebShopEnv, parse_webshop_action
from envs.webshop.reward import purchase_score

register_env("webshop", WebShopEnv, WebShopConfig)

__all__ = ["Catalogue", "Goal", "Product", "WebShopConfig", "WebShopEnv", "load_published",
           "parse_webshop_action", "purchase_score"]
