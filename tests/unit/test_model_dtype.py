"""A bf16 model holds bf16 parameters everywhere, norms included.

Megatron's local layer spec builds its norms as torch modules in fp32 whatever
`params_dtype` is (Megatron-LM casts the model afterwards, Float16Module, which this
project does not use). A bf16 actor on a GPU without Transformer Engine then trained fp32
norm weights, exported them as fp32, and a bf16 engine's rounding of them failed the
weight sync's checksum check on every norm after the first update.
"""

from __future__ import annotations

import pytest
import torch

from megatron_agent.platform.launch import run_on_ranks


def _dtypes(model_dirs: list[str]) -> dict:
    from megatron_agent.models import build_model, read_hf_config
    from megatron_agent.models.bridge import export_hf_weights, load_hf_weights
    from megatron_agent.platform import ParallelConfig, init_distributed

    ctx = init_distributed(ParallelConfig())
    out = {}
    for model_dir in model_dirs:
        chunks = build_model(model_dir, ctx.parallel, params_dtype=torch.bfloat16, init_weights=False)
        load_hf_weights(chunks, model_dir)
        out[model_dir] = {
            "parameters": {name: p.dtype for name, p in chunks[0].named_parameters()},
            "exported": {name: t.dtype for name, t in export_hf_weights(chunks, read_hf_config(model_dir))},
        }
    return out


@pytest.fixture(scope="module")
def bf16_models(tiny_model_dir):
    dirs = [str(tiny_model_dir(family)) for family in ("qwen3", "qwen3_moe")]
    return run_on_ranks(_dtypes, 1, dirs, timeout_s=300)[0]


@pytest.mark.parametrize("kind", ["parameters", "exported"])
def test_every_tensor_of_a_bf16_model_is_bf16(bf16_models, kind):
    for model_dir, dtypes in bf16_models.items():
        other = {name: dtype for name, dtype in dtypes[kind].items() if dtype != torch.bfloat16}
        assert not other, f"{model_dir}: {other}"
        assert any("norm" in name for name in dtypes[kind]), "the check saw no norm"
