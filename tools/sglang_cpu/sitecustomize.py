"""Placeholder modules for SGLang on a CPU-only machine.

SGLang 0.5.23 imports `sgl_kernel` (CUDA kernels) and `torchvision` at start-up, but
its CPU path (`SGLANG_USE_CPU_ENGINE=1`, torch_native attention) never calls them.
Neither has a CPU wheel that fits the pinned torch, so this file, put on PYTHONPATH
of the server only (`rollout.engine_launch.sglang_cpu_environment`), installs an
import hook that answers those two names, and their submodules, with placeholders:
any attribute is a placeholder class, usable as a base class, callable, and with
placeholder attributes of its own. Importing the `sgl_kernel` placeholder also puts
placeholders under `torch.ops.sgl_kernel` for the few CPU kernels that SGLang modules bind
at import time (PLACEHOLDER_OPS): the Qwen-VL multimodal processor imports Qwen3.5's
model module, which binds them; the Qwen2.5-VL and Qwen3-VL models never call them.

Pinned memory: SGLang's LoRA layers allocate host tensors with `pin_memory=True` (for
faster copies to a GPU), which torch without an accelerator refuses. With no CUDA,
torch's tensor factories here drop `pin_memory` and `Tensor.pin_memory()` returns the
tensor (`unpinned_factories`): pinning only speeds copies to a device there is none of.
With it, SGLang serves LoRA adapters on CPU (`--enable-lora --lora-backend torch_native`).

It does nothing unless MEGATRON_AGENT_SGLANG_CPU_SHIM=1, and a module that is really
installed is always found first (the hook is the last finder asked).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

ENV_FLAG = "MEGATRON_AGENT_SGLANG_CPU_SHIM"
PLACEHOLDER_TOP_LEVEL = ("sgl_kernel", "torchvision")
PLACEHOLDER_VERSION = "0.0.0"


class _PlaceholderType(type):
    """Classes whose missing attributes are more placeholder classes."""

    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}", cls.__module__)


def _placeholder(qualname: str, module: str) -> type:
    def _init(self, *args, **kwargs):
        pass

    def _call(self, *args, **kwargs):
        raise RuntimeError(f"{module}.{qualname} is a CPU placeholder (tools/sglang_cpu/sitecustomize.py) "
                           "and cannot run")

    cls = _PlaceholderType(qualname.rsplit(".", 1)[-1], (), {"__init__": _init, "__call__": _call,
                                                              "__module__": module})
    cls.__qualname__ = qualname
    return cls


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _placeholder(name, self.__name__)
        setattr(self, name, value)
        return value


class _PlaceholderLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []  # a package: submodules import too
        # version checks (transformers parses torchvision's) see a release older than any
        # they ask for, so they take their paths that need neither module
        module.__version__ = PLACEHOLDER_VERSION
        return module

    def exec_module(self, module) -> None:
        if module.__name__ == "sgl_kernel":
            _register_placeholder_ops()


# sgl_kernel's CPU kernels that sglang/srt/models/qwen3_5.py binds when it is imported
PLACEHOLDER_OPS = ("fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu",
                   "fused_qkvzba_split_reshape_cat_contiguous_cpu")


def _register_placeholder_ops() -> None:
    import torch

    namespace = torch.ops.sgl_kernel
    for name in PLACEHOLDER_OPS:
        if not hasattr(namespace, name):
            setattr(namespace, name, _placeholder(name, "torch.ops.sgl_kernel")())


class _PlaceholderFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in PLACEHOLDER_TOP_LEVEL:
            return None
        return importlib.machinery.ModuleSpec(fullname, _PlaceholderLoader(), is_package=True)


def install() -> None:
    if not any(isinstance(f, _PlaceholderFinder) for f in sys.meta_path):
        sys.meta_path.append(_PlaceholderFinder())
    unpinned_factories()


PINNING_FACTORIES = ("tensor", "as_tensor", "empty", "empty_strided", "zeros", "ones", "full", "arange")


def unpinned_factories() -> None:
    import functools

    import torch

    if torch.cuda.is_available() or getattr(torch, "_megatron_agent_unpinned", False):
        return

    def unpinned(factory):
        @functools.wraps(factory)
        def call(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)
        return call

    for name in PINNING_FACTORIES:
        setattr(torch, name, unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    torch._megatron_agent_unpinned = True


if os.environ.get(ENV_FLAG) == "1":
    install()
