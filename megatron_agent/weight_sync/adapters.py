"""A LoRA actor's adapters into the engines, one weight version at a time (the sending
side of `weight_sync.lora=adapters`; the engines' side: rollout/engine_lora.py).

Rank 0 holds an `AdapterLoader`: each `load` pauses generation, loads the version's PEFT
adapter into every engine (`/load_lora_adapter` from a directory the engines read, or
`/load_lora_adapter_from_tensors` with tensor handles when they are colocated), sets the
version, resumes, and unloads the adapter ADAPTERS_KEPT versions back (SGLang waits for the
requests that name it).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch

from megatron_agent.models.lora import write_peft_dir

ADAPTERS_KEPT = 2  # adapter versions an engine holds: requests may still name the one before


class AdapterLoader:
    def __init__(self, adapter_dir: str | None, *, pause_mode: str, timeout_s: float):
        self.directory = Path(adapter_dir or "adapters")  # each version's PEFT adapter, for the engines to read
        self.pause_mode, self.timeout_s = pause_mode, timeout_s
        self.loaded: list[str] = []  # the engines' adapters of this run, oldest first
        self.engine_ranks: dict[str, int] | None = None  # tensor handles: one payload per engine rank

    def forget(self) -> None:
        """New engines (restarted): they hold none of this run's adapters."""
        self.loaded, self.engine_ranks = [], None

    def load(self, client, version: str, config: dict, tensors: dict[str, torch.Tensor], *, by_handles: bool) -> None:
        from rollout.engine_client import EngineError
        from rollout.engine_lora import adapter_name

        name = adapter_name(version)
        client.pause_generation(self.pause_mode)
        try:
            # a name held from an earlier trainer (a resume against running engines) is stale
            with contextlib.suppress(EngineError):
                client.post_all("/unload_lora_adapter", {"lora_name": name}, timeout_s=self.timeout_s)
            if by_handles:
                self._post_handles(client, name, config, tensors)
            else:
                write_peft_dir(self.directory / name, config, tensors)
                client.post_all("/load_lora_adapter", {"lora_name": name,
                                                       "lora_path": str((self.directory / name).resolve())},
                                timeout_s=self.timeout_s)
            client.update_weight_version(version)
        finally:
            client.continue_generation()
        self.loaded = [n for n in self.loaded if n != name] + [name]
        while len(self.loaded) > ADAPTERS_KEPT:
            old = self.loaded.pop(0)
            client.post_all("/unload_lora_adapter", {"lora_name": old}, timeout_s=self.timeout_s)
            shutil.rmtree(self.directory / old, ignore_errors=True)  # if it was written

    def _post_handles(self, client, name: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
        from rollout.weight_tensors import FLATTENED, serialize, tensor_payload

        if self.engine_ranks is None:
            self.engine_ranks = client.server_ranks(timeout_s=min(30.0, self.timeout_s))
        buffer, payload = tensor_payload(list(tensors.items()), flattened=True)
        bodies = {url: {"lora_name": name, "config_dict": config, "load_format": FLATTENED,
                        "serialized_named_tensors": [serialize(payload) for _ in range(n)]}
                  for url, n in self.engine_ranks.items()}
        client.post_all_async("/load_lora_adapter_from_tensors", bodies=bodies,
                              timeout_s=self.timeout_s).result(timeout=self.timeout_s)
        del buffer  # the engines copied out of it before answering
