"""The `/update_weights_from_tensor` wire format (rollout/weight_tensors.py): tensors
handed to another process by shared-memory handles, per tensor and flattened, and a
payload that would run code refused."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout.weight_tensors import (
    ALIGN_BYTES,
    deserialize_named_tensors,
    pack_bucket,
    serialize,
    tensor_payload,
)

CHECKOUT = Path(__file__).resolve().parents[3]
NAMED = [("a.weight", torch.randn(3, 5)), ("b.bias", torch.arange(7, dtype=torch.int64)),
         ("c.weight", torch.randn(3, dtype=torch.bfloat16)), ("d.weight", torch.randn(2, 2))]

READ_IN_ANOTHER_PROCESS = """
import sys, torch
from rollout.weight_tensors import deserialize_named_tensors
for name, t in deserialize_named_tensors(sys.stdin.read(), sys.argv[1] if sys.argv[1] != "None" else None):
    print(name, str(t.dtype), list(t.shape), repr(t.double().sum().item()))
"""


@pytest.mark.parametrize("flattened", [False, True], ids=["per_tensor", "flattened_bucket"])
def test_another_process_reads_the_tensors_by_their_handles(flattened):
    buffer, payload = tensor_payload(NAMED, flattened=flattened)
    out = subprocess.run([sys.executable, "-c", READ_IN_ANOTHER_PROCESS, "flattened_bucket" if flattened else "None"],
                         input=serialize(payload), capture_output=True, text=True, cwd=CHECKOUT, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(CHECKOUT)))
    assert out.returncode == 0, out.stderr
    expected = [f"{n} {t.dtype} {list(t.shape)} {t.double().sum().item()!r}" for n, t in NAMED]
    assert out.stdout.splitlines() == expected
    assert buffer.is_shared()


def test_each_tensor_starts_aligned_so_any_dtype_views_it():
    buffer, metadata = pack_bucket(NAMED)
    assert [m.start_idx % ALIGN_BYTES for m in metadata] == [0] * len(NAMED)
    assert [m.end_idx - m.start_idx for m in metadata] == [t.numel() * t.element_size() for _, t in NAMED]


def test_a_payload_that_would_run_code_is_refused():
    class Evil:
        def __reduce__(self):
            return os.system, ("echo pwned",)

    payload = base64.b64encode(pickle.dumps([("x", Evil())])).decode()
    with pytest.raises(pickle.UnpicklingError, match="posix.system is not allowed|os.system is not allowed"):
        deserialize_named_tensors(payload, None)


def test_an_unknown_load_format_is_refused():
    with pytest.raises(ValueError, match="load_format='direct'"):
        deserialize_named_tensors(serialize([]), "direct")
