"""Partial rollouts: a response cut short by a weight update is finished under the new weights.

A weight sync pauses the engines with mode "abort" (SGLang's `/pause_generation`; the
embedded engine alike): each request in flight ends at once with `finish_reason` "abort"
and the tokens it had. In asynchronous training (`training.mode=async`) the rollout does
not stop for the sync, so such answers reach the agent loop. `in_flight_update` says what
becomes of them:

- "continue": the request is sent again with its prompt + the tokens so far as the prompt
  and the rest of its token budget, and the answers are joined. Each token keeps the
  weight version and the engine logprob it was sampled with (`GenerateOutput.token_versions`),
  so the loss corrects each token by its own behaviour policy (the rollout-correction
  settings: docs/algorithms.md). The engine recomputes the prefix's KV cache under the new
  weights. A stop string that straddles the cut is not seen.
- "restart": the tokens so far are thrown away and the request is sent again whole, so
  every token of the answer comes from the new weights.

A request continued `MAX_CONTINUATIONS` times is returned as aborted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from rollout.episodes import Request

IN_FLIGHT_UPDATES = ("continue", "restart")
MAX_CONTINUATIONS = 16


def token_versions(output) -> list[str]:
    """The weight version of each output token (one answer: all its engine's version)."""
    versions = getattr(output, "token_versions", None)
    return list(versions) if versions else [output.weight_version] * len(output.output_ids)


def joined(first, rest):
    """One answer from an aborted answer `first` and the answer `rest` to its continuation
    (whose prompt was first's prompt + first's tokens)."""
    return dataclasses.replace(
        rest, output_ids=list(first.output_ids) + list(rest.output_ids),
        logprobs=list(first.logprobs) + list(rest.logprobs), text=first.text + rest.text,
        token_versions=token_versions(first) + token_versions(rest),
        # rest's routes cover its whole prompt (first's prompt and tokens) and its own tokens
        routed_experts=rest.routed_experts if rest.routed_experts is not None else first.routed_experts)


def continuation(request: Request, so_far, count: int) -> Request:
    """The request that finishes `request` after the aborted tokens `so_far`."""
    params = dict(request.params)
    params["max_new_tokens"] = int(params.get("max_new_tokens", 0)) - len(so_far.output_ids)
    if params.get("sampling_seed") is not None:  # new draws for the new positions
        params["sampling_seed"] = int(np.random.SeedSequence([params["sampling_seed"], count]).generate_state(1,
                                      np.uint64)[0] >> np.uint64(2))
    return dataclasses.replace(
        request, ids=list(request.ids) + list(so_far.output_ids), params=params, rid=f"{request.rid}-c{count}",
        prompt_tokens=None if request.prompt_tokens is None else request.prompt_tokens + len(so_far.output_ids))


def next_step(request: Request, answer, so_far, count: int, in_flight_update: str):
    """After `answer` to the `count`-th sending of `request` (the first: 0; `so_far`: what
    the earlier sendings gave, or None): (the finished answer, None), or (None, (the
    request to send next, the answer so far, its count)) when a weight update cut it."""
    if so_far is not None:
        answer = joined(so_far, answer)
    if answer.finish_reason != "abort" or count >= MAX_CONTINUATIONS:
        return answer, None
    if int(request.params.get("max_new_tokens", 1)) <= len(answer.output_ids):
        return dataclasses.replace(answer, finish_reason="length"), None
    if in_flight_update == "restart" or not answer.output_ids:
        return None, (request, None, count + 1)
    return None, (continuation(request, answer, count + 1), answer, count + 1)


def finished_answer(submit: Callable[[Request], Future], request: Request, in_flight_update: str):
    """`request`'s answer, sent again as `in_flight_update` says while a weight update cuts
    it (`submit`: one request -> Future of its answer); blocks. (The asynchronous loop
    does the same from its callbacks: rollout/async_loop.py.)"""
    if in_flight_update not in IN_FLIGHT_UPDATES:
        raise ValueError(f"in_flight_update={in_flight_update!r}; use one of {IN_FLIGHT_UPDATES}")
    sending, so_far, count = request, None, 0
    while True:
        answer, again = next_step(request, submit(sending).result(), so_far, count, in_flight_update)
        if again is None:
            return answer
        sending, so_far, count = again
