"""LoRA adapters an engine holds by name, as SGLang serves them (`--enable-lora`).

    /load_lora_adapter               {lora_name, lora_path: a PEFT adapter directory}
    /load_lora_adapter_from_tensors  {lora_name, config_dict: its adapter_config.json,
                                      serialized_named_tensors: one entry per engine rank}
    /unload_lora_adapter             {lora_name}
    /generate                        {..., lora_path: an adapter's name, or one per prompt}

Tensors go by PEFT's names (`base_model.model.<module>.lora_A.weight` [r, in],
`...lora_B.weight` [out, r]); an adapter adds (lora_alpha / r)·B·A to `<module>.weight`
(`lora_alpha / sqrt(r)` with use_rslora). A name already loaded is refused until it is
unloaded, as SGLang refuses it; an unload refuses new requests naming the adapter at once
and waits for those queued or running (SGLang's registry does the same).

SGLang computes each request's adapter beside the base in its own kernels. The embedded
engine merges instead: a batch runs with one adapter merged into the weights it touches
(`EngineAdapters.serve`), which the engine's batching keeps to requests naming the same
adapter; switching puts the base back first (kept for the weights an adapter touched), so
its logprobs are those of the merged model, as a merged weight sync gives them.
"""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."
_FACTORS = (".lora_A.weight", ".lora_B.weight")
BASE_VERSION = "default"  # an engine's weight version before any update: the base model, no adapter


def adapter_name(weight_version: str) -> str | None:
    """The trainer's adapter of a weight version, as an adapter-only weight sync loads it
    and the rollout's requests name it (None: the base model, before any sync)."""
    return None if str(weight_version) == BASE_VERSION else f"policy-v{weight_version}"


class AdapterProblem(ValueError):
    """An adapter that cannot be loaded or served; the message names why."""


def adapter_scale(config: dict) -> float:
    """What PEFT scales B·A by: lora_alpha / r (lora_alpha / sqrt(r) with use_rslora)."""
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        raise AdapterProblem("config_dict needs PEFT's integer r and number lora_alpha") from None
    if rank <= 0:
        raise AdapterProblem(f"config_dict r={rank} must be positive")
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def merge_lora(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale·B·A, computed in fp32, in W's dtype: models/lora.py's `merge`, so an engine
    serving the adapter holds the weights a merged sync sends, bit for bit."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


def read_peft_dir(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT adapter directory: its adapter_config.json and its tensors."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        config = json.loads((path / "adapter_config.json").read_text())
        tensors = load_file(path / "adapter_model.safetensors")
    except Exception as err:  # missing, unreadable, not JSON, not safetensors: the request's directory
        raise AdapterProblem(f"lora_path {path} is no PEFT adapter directory (adapter_config.json, "
                             f"adapter_model.safetensors): {type(err).__name__}: {err}") from None
    return config, tensors


class EngineAdapters:
    """The adapters loaded into one engine, and which one is merged into its weights now."""

    def __init__(self, weight_views: Callable[[list[str]], dict[str, torch.Tensor | None]]):
        self.weight_views = weight_views  # checkpoint-format HF weight names -> the model's tensors
        self.loaded: dict[str, tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.merged: str | None = None
        self.base: dict[str, torch.Tensor] = {}  # the weights the merged adapter touched, as they were
        self.in_use: Counter[str] = Counter()  # requests queued or running, per adapter
        self.unloading: set[str] = set()
        self.requests = threading.Condition()

    def load(self, name: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Check an adapter against the model and keep a copy of it under `name`."""
        if name in self.loaded:
            raise AdapterProblem(f"a LoRA adapter named {name!r} is loaded already: unload it first")
        scale = adapter_scale(config)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            factor = next((f for f in _FACTORS if key.endswith(f)), None)
            if factor is None or not key.startswith(PEFT_PREFIX):
                raise AdapterProblem(f"{key!r} is no PEFT LoRA tensor ({PEFT_PREFIX}<module>.lora_A/B.weight)")
            module = key[len(PEFT_PREFIX):-len(factor)]
            pairs.setdefault(module, {})[factor] = tensor
        if not pairs:
            raise AdapterProblem(f"adapter {name!r} holds no tensors")
        factors = {}
        weights = self.weight_views([f"{module}.weight" for module in pairs])
        for module, pair in sorted(pairs.items()):
            if len(pair) != 2:
                raise AdapterProblem(f"{module}: lora_A and lora_B come in pairs; {name!r} has one of them")
            a, b = pair[_FACTORS[0]], pair[_FACTORS[1]]
            weight = weights[f"{module}.weight"]
            if weight is None:
                raise AdapterProblem(f"adapter {name!r}: the model has no module {module!r}")
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != tuple(weight.shape):
                raise AdapterProblem(f"adapter {name!r}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}"
                                     f" for a weight of {list(weight.shape)}")
            factors[f"{module}.weight"] = (a.detach().clone(), b.detach().clone())
        self.loaded[name] = (scale, factors)

    def unload(self, name: str, weights_lock) -> None:
        """Refuse new requests naming `name`, wait for those that do, then drop it (taking
        `weights_lock`, the engine's, to put the base back if it is merged)."""
        with self.requests:
            if name not in self.loaded or name in self.unloading:
                raise AdapterProblem(f"no LoRA adapter named {name!r} is loaded (loaded: {self.names()})")
            self.unloading.add(name)
            self.requests.wait_for(lambda: not self.in_use[name])
        with weights_lock:
            if self.merged == name:
                self.restore_base()
            del self.loaded[name]
        with self.requests:
            self.unloading.discard(name)

    def names(self) -> list[str]:
        return sorted(set(self.loaded) - self.unloading)

    def acquire(self, name: str | None) -> None:
        """A request naming adapter `name` (None: the base model) is queued: it must be loaded."""
        if name is None:
            return
        with self.requests:
            if name not in self.loaded or name in self.unloading:
                raise AdapterProblem(f"lora_path {name!r} names no loaded LoRA adapter (loaded: {self.names()})")
            self.in_use[name] += 1

    def release(self, name: str | None) -> None:
        """A request `acquire` counted is done."""
        if name is None:
            return
        with self.requests:
            self.in_use[name] -= 1
            self.requests.notify_all()

    @torch.no_grad()
    def serve(self, name: str | None) -> None:
        """Merge adapter `name` into the weights (None: the base), the one merged before
        taken out first. Call with the engine's weights locked."""
        if name == self.merged:
            return
        if name is not None and name not in self.loaded:
            raise AdapterProblem(f"adapter {name!r} is not loaded")
        self.restore_base()
        if name is None:
            return
        scale, factors = self.loaded[name]
        weights = self.weight_views(list(factors))
        for weight_name, (a, b) in factors.items():
            weight = weights[weight_name]
            self.base[weight_name] = weight.clone()
            weight.copy_(merge_lora(weight, a, b, scale))
        self.merged = name

    @torch.no_grad()
    def restore_base(self) -> None:
        """The weights as loaded, without any adapter (before a weight update writes them)."""
        for weight_name, weight in self.weight_views(list(self.base)).items():
            weight.copy_(self.base[weight_name])
        self.base, self.merged = {}, None
