"""What the agent loop asks the engines for: `SamplingConfig`, sent as SGLang
`sampling_params` (the embedded engine parses them in rollout/engine_server.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingConfig:
    """Sampling for one generation call; sent to the engine as SGLang `sampling_params`.

    temperature 0 is greedy. `seed` is the base of the per-request sampling seeds: the
    agent loop derives each request's seed from (seed, env seed, copy, step), so a run
    does not depend on the order in which requests reach the engines.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = 0  # None: send no per-request seed (servers that do not take one)

    def to_params(self, sampling_seed: int | None = None) -> dict:
        params = dict(
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=int(self.top_k),
            max_new_tokens=int(self.max_new_tokens),
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            skip_special_tokens=False,
        )
        if sampling_seed is not None:
            params["sampling_seed"] = int(sampling_seed)
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
