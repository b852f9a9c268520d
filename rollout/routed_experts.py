"""Routed experts: which experts an MoE engine sent each token to, in SGLang's layout.

For routing replay (megatron_agent/training/routing_replay.py) the engine returns, per
request, the top-k expert ids of every token it fed through the model: the prompt's and the
response's but its last (never fed), so `prompt_tokens + len(output_ids) - 1` rows of
`[num_hidden_layers, k]` (a dense layer's row is 0). SGLang 0.5.23 (`return_routed_experts`
per request, `--enable-return-routed-experts` on the server) puts them in
`meta_info["routed_experts"]`: base64 of the int32 array in C order. The embedded engine
records them with forward hooks on transformers' routers (`RouteRecorder`).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

ROUTER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


@dataclass(frozen=True)
class RouteShape:
    layers: int  # num_hidden_layers: every decoder layer has a row (a dense one's is 0)
    k: int  # num_experts_per_tok
    num_experts: int


def route_shape(model_path) -> RouteShape:
    """The routes' shape of the HF model at `model_path` (a VLM's text_config)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    text = config.get("text_config", config)
    experts = text.get("num_experts") or text.get("num_local_experts")  # transformers 5 saves the latter
    if not experts or not text.get("num_experts_per_tok"):
        raise ValueError(f"{model_path} is not a mixture-of-experts model (its config.json names no experts): "
                         "it has no routes to return")
    return RouteShape(text["num_hidden_layers"], text["num_experts_per_tok"], experts)


def route_dtype(num_experts: int):
    """The smallest integer type that holds every expert id."""
    return np.uint8 if num_experts <= 256 else np.int16


class RouteRecorder:
    """Forward hooks on an HF MoE model's top-k routers (Qwen3-MoE, Qwen3-VL-MoE: the module
    at `...layers.<i>.mlp.gate` returns (logits, scores, indices)): each forward's expert ids."""

    def __init__(self, model):
        text = model.config.get_text_config()
        self.layers, self.k = text.num_hidden_layers, text.num_experts_per_tok
        self.latest: dict = {}
        for name, module in model.named_modules():
            match = ROUTER_NAME.search(name)
            if match and type(module).__name__.endswith("TopKRouter"):
                module.register_forward_hook(partial(self._keep, int(match.group(1))))

    def _keep(self, layer: int, _module, _inputs, output) -> None:
        self.latest[layer] = output[2]

    def take(self, rows: int, columns: int) -> np.ndarray:
        """The last forward's ids over its [rows, columns] tokens: int32 [rows, columns, layers, k]."""
        out = np.zeros((rows, columns, self.layers, self.k), dtype=np.int32)
        for layer, ids in self.latest.items():
            out[:, :, layer] = ids.reshape(rows, columns, self.k).cpu().numpy()
        self.latest.clear()
        return out


def is_moe(model) -> bool:
    text = model.config.get_text_config()
    return getattr(text, "num_experts", None) is not None and getattr(text, "num_experts_per_tok", None) is not None


def encode_routes(routes: np.ndarray) -> str:
    """SGLang's encoding: base64 of the int32 array's bytes."""
    return base64.b64encode(np.ascontiguousarray(routes, dtype=np.int32).tobytes()).decode("ascii")


def decode_routes(text, *, rows: int, layers: int, k: int, num_experts: int) -> np.ndarray:
    """`meta_info["routed_experts"]` -> [rows, layers, k] in `route_dtype`; ValueError naming
    what does not fit (not base64, another row count, an id out of range, an expert twice
    in one token's top-k)."""
    if type(text) is not str:
        raise ValueError(f"routed_experts is a {type(text).__name__}, not a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("routed_experts is not base64") from None
    per_row = 4 * layers * k
    if len(raw) != rows * per_row:
        raise ValueError(f"routed_experts has {len(raw)} bytes; {rows} fed tokens x {layers} layers x top-{k} "
                         f"as int32 take {rows * per_row}")
    ids = np.frombuffer(raw, dtype=np.int32).reshape(rows, layers, k)
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(f"routed_experts holds expert ids {int(ids.min())}..{int(ids.max())}, outside "
                         f"0..{num_experts - 1}")
    ordered = np.sort(ids, axis=-1)
    routed = ordered.any(axis=-1)  # a dense layer's row is all zeros
    if ((ordered[..., 1:] == ordered[..., :-1]).any(axis=-1) & routed).any():
        raise ValueError("routed_experts names one expert twice in a token's top-k")
    return ids.astype(route_dtype(num_experts))
