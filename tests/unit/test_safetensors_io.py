"""Safetensors read by offset and written as a stream, checked against the safetensors library."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_agent.models.safetensors_io import TensorSpec, read_header, read_tensor, write_streamed_shards

TENSORS = {
    "a": torch.randn(3, 4),
    "b": torch.randn(5).bfloat16(),
    "c": torch.tensor(2.5, dtype=torch.float16),
    "d": torch.arange(6, dtype=torch.int64).reshape(2, 3),
}


def test_reads_what_safetensors_wrote(tmp_path):
    save_file(TENSORS, tmp_path / "x.safetensors")
    entries = read_header(tmp_path / "x.safetensors")
    assert entries.keys() == TENSORS.keys()
    for name, tensor in TENSORS.items():
        got = read_tensor(entries[name])
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


def test_streamed_shards_load_with_safetensors(tmp_path):
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in TENSORS.items()]
    written = write_streamed_shards(specs, TENSORS.items(), tmp_path, max_shard_bytes=40)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert written["shards"] == len(set(weight_map.values())) > 1
    assert written["total_size"] == sum(t.numel() * t.element_size() for t in TENSORS.values())
    for name, tensor in TENSORS.items():
        got = load_file(tmp_path / weight_map[name])[name]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


def test_one_shard_is_model_safetensors(tmp_path):
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in TENSORS.items()]
    assert write_streamed_shards(specs, TENSORS.items(), tmp_path, max_shard_bytes=2**20)["shards"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert load_file(tmp_path / "model.safetensors").keys() == TENSORS.keys()


def test_a_tensor_out_of_plan_is_refused(tmp_path):
    specs = [TensorSpec("a", (3, 4), torch.float32)]
    with pytest.raises(ValueError, match="expected"):
        write_streamed_shards(specs, [("a", torch.zeros(4, 3))], tmp_path, max_shard_bytes=2**20)
