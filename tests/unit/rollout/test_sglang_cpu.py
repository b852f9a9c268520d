"""SGLang on CPU without SGLang: the launcher's command line and environment, and the
placeholder modules of tools/sglang_cpu/sitecustomize.py (in a subprocess, so this
process's imports are untouched)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rollout.engine_guard import InsecureBind
from rollout.engine_launch import (
    SGLANG_CPU_SHIM_ENV,
    SGLANG_CPU_TOOLS,
    SGLANG_PYTHON_ENV,
    cpu_binding,
    sglang_cpu_command,
    sglang_cpu_environment,
    sglang_cpu_python,
    sglang_model_environment,
    sglang_server_command,
)


def test_command_line_has_the_cpu_flags(monkeypatch):
    monkeypatch.delenv("MEGATRON_AGENT_ENGINE_TOKEN", raising=False)
    cmd = sglang_cpu_command("/models/m", 4321, python="/venv/bin/python", tp_size=2)
    assert cmd[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    flags = " ".join(cmd)
    for flag in ("--model-path /models/m", "--port 4321", "--tp-size 2", "--device cpu",
                 "--attention-backend torch_native", "--disable-cuda-graph", "--dtype float32",
                 "--mem-fraction-static 0.05", "--host 127.0.0.1"):
        assert flag in flags, flag
    assert "--api-key" not in cmd
    keyed = sglang_cpu_command("/m", 1, python="p", host="0.0.0.0", auth_token="k")
    assert keyed[keyed.index("--api-key") + 1] == "k"
    with pytest.raises(InsecureBind):
        sglang_cpu_command("/m", 1, python="p", host="0.0.0.0")


def test_a_vision_model_gets_pil_images_sdpa_tower_and_no_embedding_cache(tmp_path, monkeypatch):
    import json

    monkeypatch.delenv("MEGATRON_AGENT_ENGINE_TOKEN", raising=False)
    text, vlm = tmp_path / "text", tmp_path / "vlm"
    for path, config in ((text, {"model_type": "qwen3"}), (vlm, {"model_type": "qwen3_vl", "vision_config": {}})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
    flags = " ".join(sglang_cpu_command(vlm, 1, python="p"))
    assert "--image-processor-backend pil" in flags and "--mm-attention-backend sdpa" in flags
    assert "--image-processor-backend" not in sglang_cpu_command(text, 1, python="p")
    # SGLang 0.5.23 would serve images seen before a weight sync from its stale embedding cache
    assert sglang_model_environment(vlm, base={})["SGLANG_VLM_CACHE_SIZE_MB"] == "0"
    assert sglang_model_environment(text, base={}) == {}


def test_environment_turns_on_the_cpu_engine_the_shim_and_core_binding():
    env = sglang_cpu_environment(1, base={"PYTHONPATH": "/elsewhere"})
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env[SGLANG_CPU_SHIM_ENV] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SGLANG_CPU_TOOLS), "/elsewhere"]
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in env
    assert (SGLANG_CPU_TOOLS / "sitecustomize.py").exists()
    two = sglang_cpu_environment(2, base={})
    assert len(two["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == 2
    assert sglang_cpu_environment(2, base={"SGLANG_CPU_OMP_THREADS_BIND": "3|5"})["SGLANG_CPU_OMP_THREADS_BIND"] == "3|5"


@pytest.mark.parametrize("ranks, cpus, expected", [
    (2, [0, 1], "0|1"), (2, [0, 1, 2, 3], "0-1|2-3"), (1, [0, 1], "0-1"), (3, [0, 1], "0|0|1"),
    (2, [0, 2, 3, 5], "0,2|3,5"), (4, list(range(8)), "0-1|2-3|4-5|6-7"),
])
def test_core_binding_gives_each_rank_a_share(ranks, cpus, expected):
    assert cpu_binding(ranks, cpus) == expected


def test_python_comes_from_the_env_var(monkeypatch):
    monkeypatch.setenv(SGLANG_PYTHON_ENV, "/opt/sglang/bin/python")
    assert sglang_cpu_python() == "/opt/sglang/bin/python"


def test_gpu_command_is_unchanged(monkeypatch):
    from rollout.engine_launch import EngineConfig

    monkeypatch.delenv("MEGATRON_AGENT_ENGINE_TOKEN", raising=False)
    cmd = sglang_server_command(EngineConfig(gpus_per_engine=2), "/m", 30000)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "--device" not in cmd
    assert cmd[cmd.index("--tp-size") + 1] == "2"


PROBE = """
import importlib.util, sys
try:
    import sgl_kernel
    from sgl_kernel import some_op
    from sgl_kernel.sub.module import Thing
    class Derived(Thing):  # placeholders serve as base classes
        pass
    Derived()
    print("placeholder", sgl_kernel.__version__, some_op.__name__, Thing.nested.__qualname__)
except ImportError:
    print("absent")
"""


@pytest.mark.parametrize("flag, expected", [("1", "placeholder 0.0.0 some_op Thing.nested"), (None, "absent")])
def test_placeholder_modules_only_with_their_flag(flag, expected):
    assert _probe(PROBE, flag) == expected


def _probe(script: str, flag: str | None) -> str:
    """What `script` prints, run with the shim's folder on PYTHONPATH and its flag `flag`."""
    env = {k: v for k, v in os.environ.items() if k != SGLANG_CPU_SHIM_ENV}
    env["PYTHONPATH"] = str(SGLANG_CPU_TOOLS)
    if flag is not None:
        env[SGLANG_CPU_SHIM_ENV] = flag
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


OPS_PROBE = """
import torch, sgl_kernel
op = torch.ops.sgl_kernel.fused_sigmoid_mul_cpu  # bound when sglang's qwen3_5.py is imported
try:
    op(torch.zeros(1), torch.zeros(1))
except RuntimeError as e:
    print("refuses to run:", "placeholder" in str(e))
"""


def test_sgl_kernel_placeholder_binds_the_import_time_cpu_ops():
    env = dict(os.environ, PYTHONPATH=str(SGLANG_CPU_TOOLS), **{SGLANG_CPU_SHIM_ENV: "1"})
    out = subprocess.run([sys.executable, "-c", OPS_PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "refuses to run: True", out.stderr


PIN_PROBE = """
import torch
try:
    a = torch.tensor([1.0, 2.0], pin_memory=True)
    b = torch.empty(3, pin_memory=True)
    c = torch.zeros(2).pin_memory()
    print("unpinned", a.tolist(), b.shape[0], c.is_pinned())
except RuntimeError as e:
    print("refused:", "pin_memory" in str(e) or "pinned" in str(e))
"""


@pytest.mark.parametrize("flag, expected", [("1", "unpinned [1.0, 2.0] 3 False"), (None, "refused: True")])
def test_pinned_memory_is_dropped_with_the_shim_on_a_cpu_only_machine(flag, expected):
    """SGLang's LoRA layers allocate pinned host tensors, which torch without an accelerator
    refuses; under the shim (and only there) pinning is dropped, so SGLang serves LoRA on CPU."""
    assert _probe(PIN_PROBE, flag) == expected
