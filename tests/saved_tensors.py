"""What autograd keeps for backward, measured: `SavedTensors` records every tensor a forward
saves (torch.autograd.graph.saved_tensors_hooks) and counts the storages still held, each
once (a view and its base share one), by dtype and by the part of the model that saved it
first. Parameters' and buffers' storages are left out: they are not activations."""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch

OUTSIDE = "other"


class SavedTensors:
    """with SavedTensors(exclude=model.parameters()) as saved: loss = f(...); saved.bytes()

    `part_of(module_name)` names the part a module's saved tensors count for (attached to
    `modules` by their qualified names); `in_part(name)` marks code outside any module
    (a loss function) as a part of its own. A storage counts where it was first saved."""

    def __init__(self, exclude=(), modules: dict[str, torch.nn.Module] | None = None, part_of=None):
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.modules, self.part_of = modules or {}, part_of or (lambda name: OUTSIDE)
        self.stack = [OUTSIDE]
        self.records = []
        self._hooks = []

    def __enter__(self):
        names = {id(m): name for name, m in self.modules.items()}

        def enter(module, args):
            name = names.get(id(module))
            self.stack.append(self.part_of(name) if name is not None else self.stack[-1])

        def leave(module, args, out):
            self.stack.pop()

        if names:
            self._hooks = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
                           torch.nn.modules.module.register_module_forward_hook(leave)]
        self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saving.__enter__()
        return self

    def __exit__(self, *exc):
        self._saving.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()

    def _pack(self, tensor):
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            self.records.append((storage.data_ptr(), storage.nbytes(), tensor.dtype, self.stack[-1],
                                 weakref.ref(tensor)))
        return tensor

    def in_part(self, name: str):
        meter = self

        class _Part:
            def __enter__(self):
                meter.stack.append(name)

            def __exit__(self, *exc):
                meter.stack.pop()

        return _Part()

    def bytes(self) -> dict[str, dict[torch.dtype, int]]:
        """{part: {dtype: bytes}} of the storages still held now, each once, in the part
        that saved it first (a tensor whose graph was dropped no longer counts, so an
        address reused after it counts for its new tensor)."""
        held = {}
        for ptr, nbytes, dtype, part, ref in self.records:
            if ref() is not None and ptr not in self.excluded:
                held.setdefault(ptr, (nbytes, dtype, part))
        out: dict[str, dict[torch.dtype, int]] = defaultdict(lambda: defaultdict(int))
        for nbytes, dtype, part in held.values():
            out[part][dtype] += nbytes
        return {part: dict(by_dtype) for part, by_dtype in out.items()}


def total(by_part: dict[str, dict[torch.dtype, int]], parts=None, dtypes=None) -> int:
    return sum(n for part, by_dtype in by_part.items() if parts is None or part in parts
               for dtype, n in by_dtype.items() if dtypes is None or dtype in dtypes)
