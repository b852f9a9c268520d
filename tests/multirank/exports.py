"""What the multi-rank bridge tests share: layout names and the round-trip check of an
export gathered from every rank."""

from __future__ import annotations

import torch


def layout_name(layout: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in layout.items()) or "tp=1"


def assert_round_trip(model_dir: str, per_rank: list[dict], family: str, layouts: list[dict]) -> None:
    """At each layout, the tensors the ranks exported together are the checkpoint's, bit
    for bit, each from exactly one rank."""
    from safetensors.torch import load_file

    original = load_file(f"{model_dir}/model.safetensors")
    for layout in layouts:
        exported = {}
        for rank_results in per_rank:
            for name, tensor in rank_results[family][layout_name(layout)]["exported"].items():
                assert name not in exported, f"{name} exported by two ranks at {layout}"
                exported[name] = tensor
        assert exported.keys() == original.keys(), (layout, exported.keys() ^ original.keys())
        for name, tensor in original.items():
            assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), (layout, name)
