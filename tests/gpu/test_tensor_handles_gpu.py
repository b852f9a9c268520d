"""The colocated weight path on a GPU: tensors handed to another process as CUDA IPC
handles (rollout/weight_tensors.py), the device named by its UUID, read back equal, in
both load formats. Skipped without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

CHECKOUT = Path(__file__).resolve().parents[2]
READ_IN_ANOTHER_PROCESS = """
import sys, torch
from rollout.weight_tensors import deserialize_named_tensors
for name, t in deserialize_named_tensors(sys.stdin.read(), sys.argv[1] if sys.argv[1] != "None" else None):
    print(name, t.device.type, str(t.dtype), repr(t.double().sum().item()))
"""


@pytest.mark.parametrize("flattened", [False, True], ids=["per_tensor", "flattened_bucket"])
def test_another_process_opens_the_cuda_ipc_handles(flattened):
    from rollout.weight_tensors import serialize, tensor_payload

    named = [("a.weight", torch.randn(64, 32, device="cuda")),
             ("b.weight", torch.randn(17, device="cuda", dtype=torch.bfloat16))]
    buffer, payload = tensor_payload(named, flattened=flattened)
    assert buffer.is_cuda
    out = subprocess.run([sys.executable, "-c", READ_IN_ANOTHER_PROCESS, "flattened_bucket" if flattened else "None"],
                         input=serialize(payload), capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(CHECKOUT)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"{n} cuda {t.dtype} {t.double().sum().item()!r}" for n, t in named]
