"""What an engine answers to /generate, checked before the rollout uses it
(rollout/engine_client.py): `GenerateOutput`, and `generate_outputs(payload, n)`, which
raises `MalformedAnswer` naming the first problem.

An answer is SGLang's layout (its JSON contract, sglang 0.5.23
`sglang/api/v1/api_types.py` `decode_GenerateResponse`, `decode_GenerateMetaInfo`,
`decode_LogprobEntry`): per prompt an object with `text` (a string), `output_ids` (token
ids), `meta_info` (an object: `output_token_logprobs`, one `[logprob, token_id, text]`
per output token; `finish_reason`, an object with a `type`, or a string;
`weight_version`; `prompt_tokens`). A single prompt may be answered with its object
alone. Stricter than the contract where the trainer needs it: every logprob a finite
number (NaN, +-Infinity or null would poison the importance ratios), the logprobs' token
ids the output ids, ids non-negative integers. A malformed answer is the engine's fault:
the client treats it as a failed server (rollout/engine_client.py).

The embedded engine adds `meta_info.output_token_weight_versions` (one per output token)
when a request's tokens span a weight update (paused in place); SGLang has no such field,
so its answers' tokens all count as of their `weight_version`.

Asked for routed experts (`route_shape`), each answer must carry them
(`meta_info.routed_experts`, rollout/routed_experts.py) for its `prompt_tokens + len(output_ids) - 1`
fed tokens; only a request aborted before it started (no output) may come without.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rollout.routed_experts import RouteShape, decode_routes, route_dtype


class MalformedAnswer(ValueError):
    """An engine's answer that does not have the protocol's shape or values."""


@dataclass
class GenerateOutput:
    output_ids: list[int]
    logprobs: list[float]  # one per output token
    finish_reason: str  # "stop" | "length" | "abort"
    text: str
    weight_version: str
    server: str
    routed_experts: np.ndarray | None = None  # [fed tokens, layers, k], when asked
    # one weight version per output token, for an answer joined across a weight update
    # (rollout/partial_rollout.py); None: all of them `weight_version`
    token_versions: list[str] | None = None


def _token_id(value, where: str) -> int:
    if type(value) is not int or value < 0:
        raise MalformedAnswer(f"{where} is not a token id: {_brief(value)}")
    return value


def _brief(value) -> str:
    text = repr(value) if isinstance(value, (int, float, bool, type(None))) else type(value).__name__
    return text[:40]


def _logprob(entry, where: str) -> tuple[float, int]:
    if type(entry) not in (list, tuple) or len(entry) < 2:
        raise MalformedAnswer(f"{where} is not a [logprob, token_id, text] entry: {_brief(entry)}")
    lp = entry[0]
    if type(lp) not in (int, float) or not math.isfinite(lp):
        raise MalformedAnswer(f"{where} has logprob {_brief(lp)}, not a finite number")
    return float(lp), _token_id(entry[1], f"{where}'s token id")


def generate_output(item, server: str, k: int = 0, route_shape: RouteShape | None = None
                    ) -> tuple[GenerateOutput, dict]:
    """One prompt's answer -> (its GenerateOutput, its meta_info); with `route_shape`, its
    routed experts too."""
    where = f"answer {k}"
    if type(item) is not dict:
        raise MalformedAnswer(f"{where} is not an object: {_brief(item)}")
    meta = item.get("meta_info")
    if type(meta) is not dict:
        raise MalformedAnswer(f"{where} has no meta_info object")
    entries = meta.get("output_token_logprobs")
    entries = [] if entries is None else entries
    if type(entries) is not list:
        raise MalformedAnswer(f"{where}'s output_token_logprobs is not a list")
    pairs = [_logprob(e, f"{where}'s output_token_logprobs[{i}]") for i, e in enumerate(entries)]
    ids = item.get("output_ids")
    if ids is None:
        ids = [t for _, t in pairs]
    elif type(ids) is not list:
        raise MalformedAnswer(f"{where}'s output_ids is not a list")
    ids = [_token_id(t, f"{where}'s output_ids[{i}]") for i, t in enumerate(ids)]
    if len(ids) != len(pairs):
        raise MalformedAnswer(f"{where} has {len(ids)} output ids but {len(pairs)} logprobs")
    if ids != [t for _, t in pairs]:
        raise MalformedAnswer(f"{where}'s output_token_logprobs name other tokens than its output_ids")
    text = item.get("text", "")
    if type(text) is not str:
        raise MalformedAnswer(f"{where}'s text is not a string")
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type", "") if isinstance(finish, dict) else finish
    if type(kind) is not str:
        raise MalformedAnswer(f"{where}'s finish_reason has no string type")
    version = meta.get("weight_version", "")
    if type(version) not in (str, int):
        raise MalformedAnswer(f"{where}'s weight_version is neither a string nor an integer")
    routes = None if route_shape is None else _routes(meta, len(ids), route_shape, where)
    versions = meta.get("output_token_weight_versions")  # the embedded engine's, across an in-place pause
    if versions is not None and (type(versions) is not list or len(versions) != len(ids)
                                 or any(type(v) not in (str, int) for v in versions)):
        raise MalformedAnswer(f"{where}'s output_token_weight_versions is not one version per output token")
    return GenerateOutput(output_ids=ids, logprobs=[lp for lp, _ in pairs], finish_reason=kind, text=text,
                          weight_version=str(version), server=server, routed_experts=routes,
                          token_versions=None if versions is None else [str(v) for v in versions]), meta


def _routes(meta: dict, outputs: int, shape: RouteShape, where: str) -> np.ndarray:
    prompt = meta.get("prompt_tokens")
    if type(prompt) is not int or prompt < 1:
        raise MalformedAnswer(f"{where}'s prompt_tokens is not a positive integer: {_brief(prompt)}")
    fed = prompt + outputs - 1
    text = meta.get("routed_experts")
    if text is None:
        if outputs:
            raise MalformedAnswer(f"{where} has no meta_info.routed_experts, which was asked for: start SGLang "
                                  "with --enable-return-routed-experts (engine.return_routed_experts)")
        # aborted before its prefill: nothing was routed, and no response token reaches a loss
        filler = np.arange(shape.k, dtype=route_dtype(shape.num_experts))
        return np.ascontiguousarray(np.broadcast_to(filler, (fed, shape.layers, shape.k)))
    try:
        return decode_routes(text, rows=fed, layers=shape.layers, k=shape.k, num_experts=shape.num_experts)
    except ValueError as err:
        raise MalformedAnswer(f"{where}: {err}") from None


def generate_outputs(payload, n: int, server: str, route_shape: RouteShape | None = None
                     ) -> list[tuple[GenerateOutput, dict]]:
    """A /generate answer for `n` prompts -> each prompt's (GenerateOutput, meta_info)."""
    if isinstance(payload, dict):  # one prompt: SGLang may answer with the object alone
        payload = [payload]
    if not isinstance(payload, list) or len(payload) != n:
        shown = f"a list of {len(payload)}" if isinstance(payload, list) else type(payload).__name__
        raise MalformedAnswer(f"{shown} where {n} answer(s) were due")
    return [generate_output(item, server, k, route_shape) for k, item in enumerate(payload)]
