"""Run by tests/integration/rollout/test_sglang_fp8_load.py in SGLang's own venv (on CPU,
`rollout.engine_launch.sglang_cpu_environment`): SGLang 0.5.23's model classes load our
checkpoints through their own code, no server.

For each `NAME=REFERENCE_DIR,FP8_DIR` argument it builds the model twice as SGLang's loader
does (model_loader/loader.py `_initialize_model`, in bfloat16 as FP8 serving needs):
unquantized for the reference checkpoint, and with the quantization config SGLang derives
from the FP8 checkpoint's config.json (`_get_quantization_config`: Fp8Config.from_config,
the class's packed modules and its hf_to_sglang_mapper) for the FP8 one. Each is fed its
checkpoint through the class's `load_weights`, the function an SGLang weight update
(update_weights_from_distributed / from_tensor) calls too. `process_weights_after_loading`
is not run: on CPU it wants AMX, and it repacks for kernels, not what was loaded.

Writes OUT_DIR/NAME.reference.safetensors and OUT_DIR/NAME.fp8.safetensors (every
parameter under SGLang's name) and OUT_DIR/NAME.methods.json (each module's quant method).

usage: python sglang_fp8_load.py OUT_DIR NAME=REFERENCE_DIR,FP8_DIR ...
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import torch


def _init_single_rank(model_dir: str) -> None:
    """World of one on gloo and SGLang's parallel groups, which its layers need at TP 1
    (server arguments naming a local model: SGLang reads its config while resolving them)."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    reset_context()
    publish(ServerArgs(model_path=model_dir, device="cpu", tp_size=1, ep_size=1, pp_size=1), role="test",
            ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")


def _loaded_model(model_dir: str):
    from safetensors.torch import load_file
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import _get_quantization_config
    from sglang.srt.model_loader.utils import get_model_architecture

    model_config = ModelConfig(model_dir, trust_remote_code=False, dtype="bfloat16")
    model_class, _ = get_model_architecture(model_config)
    quant_config = _get_quantization_config(model_config, LoadConfig())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        model = model_class(config=model_config.hf_config, quant_config=quant_config)
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(pair for f in sorted(Path(model_dir).glob("*.safetensors")) for pair in load_file(str(f)).items())
    return model


def _state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}


def main(out_dir: str, pairs: list[str]) -> None:
    from safetensors.torch import save_file

    _init_single_rank(pairs[0].split("=", 1)[1].split(",")[0])
    out = Path(out_dir)
    for pair in pairs:
        name, dirs = pair.split("=", 1)
        reference_dir, fp8_dir = dirs.split(",")
        save_file(_state(_loaded_model(reference_dir)), str(out / f"{name}.reference.safetensors"))
        fp8 = _loaded_model(fp8_dir)
        save_file(_state(fp8), str(out / f"{name}.fp8.safetensors"))
        methods = {n: type(m.quant_method).__name__ for n, m in fp8.named_modules()
                   if getattr(m, "quant_method", None) is not None}
        (out / f"{name}.methods.json").write_text(json.dumps(methods, indent=1))
        print(f"{name}: loaded", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
