"""The bridge's layouts for the export (megatron_agent/models/bridge.py), by hand: q/k/v
split out of Megatron's fused tensor (interleaved per query group) equal the hand-built
HF tensors, also when written into memory the caller gives (one copy, there); and which
parameters the export yields as views of themselves."""

from __future__ import annotations

import torch

from megatron_agent.models.bridge import Dims, ParamMapping, exported_as_views, qkv_rows, unfuse
from megatron_agent.models.families.common import COLS, GATE_UP, IDENTITY, QKV, REPLICATED, ROWS, Rule

DIMS = Dims(num_heads=4, num_kv_heads=2, head_dim=3, vocab_size=10, padded_vocab=10, hidden=5)


def fused_by_hand():
    """Megatron's rows: per group, its 2 query heads, then its key head, then its value head."""
    q = torch.arange(4 * 3 * 5.0).view(12, 5)
    k = 1000 + torch.arange(2 * 3 * 5.0).view(6, 5)
    v = 2000 + torch.arange(2 * 3 * 5.0).view(6, 5)
    fused = torch.cat([torch.cat([q[g * 6:(g + 1) * 6], k[g * 3:(g + 1) * 3], v[g * 3:(g + 1) * 3]]) for g in (0, 1)])
    return fused, (q, k, v)


def test_qkv_unfused_equals_the_hand_built_tensors_also_written_where_the_caller_says():
    fused, expected = fused_by_hand()
    assert qkv_rows(DIMS) == [12, 6, 6]
    for got, want in zip(unfuse(QKV, fused, DIMS), expected):
        assert torch.equal(got, want) and got.is_contiguous()
    memory = torch.full((24 * 5,), float("nan"))
    out = [memory[:60].view(12, 5), memory[60:90].view(6, 5), memory[90:].view(6, 5)]
    got = unfuse(QKV, fused, DIMS, out=out)
    assert all(g is o for g, o in zip(got, out))
    assert torch.equal(memory, torch.cat([t.reshape(-1) for t in expected]))


def test_the_export_yields_views_only_of_parameters_it_neither_gathers_nor_rebuilds():
    def mapping(fuse, split, expert=False):
        return ParamMapping(Rule("m", ("h",), split=split, fuse=fuse), 0, 0 if expert else None, is_expert=expert)

    assert exported_as_views(mapping(IDENTITY, REPLICATED), 4, 4, 4)  # a norm: the same on every rank
    assert exported_as_views(mapping(GATE_UP, ROWS), 1, 1, 1)  # gate and up: halves of linear_fc1
    assert not exported_as_views(mapping(IDENTITY, COLS), 2, 1, 1)  # gathered over TP
    assert not exported_as_views(mapping(QKV, ROWS), 1, 1, 1)  # rebuilt out of its groups
    assert exported_as_views(mapping(IDENTITY, ROWS, expert=True), 2, 1, 1)  # expert TP 1, EP 1
    assert not exported_as_views(mapping(IDENTITY, ROWS, expert=True), 1, 1, 2)  # gathered over EP
