"""The GPU weight sync: the actor on the GPU sends its weights over NCCL to a real SGLang
server on the same GPU. Skipped without CUDA; needs the `gpu` extra (sglang)."""

from __future__ import annotations

import pytest
import torch

from rollout.weight_group import weight_checksum

pytestmark = pytest.mark.gpu


def test_weight_checksum_reads_gpu_tensors():
    t = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    assert weight_checksum(t.cuda()) == weight_checksum(t)
    assert weight_checksum(t.cuda().to(torch.bfloat16)) == weight_checksum(t.to(torch.bfloat16))


@pytest.mark.slow
@pytest.mark.multirank
def test_nccl_weight_sync_to_a_real_sglang_server(tiny_model_dir, tmp_path):
    import importlib.util

    from megatron_agent.platform.launch import run_on_ranks
    from rollout.engine_launch import EngineConfig, start_sglang_server
    from tests.integration.weight_sync.test_weight_sync import _sync_and_compare

    assert importlib.util.find_spec("sglang"), "the gpu extra installs sglang: pip install -e '.[gpu]'"
    model_dir = str(tiny_model_dir("qwen3"))
    config = EngineConfig(server="sglang", gpus_per_engine=1, dtype="float32",
                          server_args=("--mem-fraction-static", "0.2"))
    engine = start_sglang_server(config, model_dir, tmp_path / "logs")
    try:
        # fp32 on both sides; the GPU kernels (cuBLAS vs SGLang's) differ more than on a CPU
        out = run_on_ranks(_sync_and_compare, 1, model_dir, [engine.url], {}, False, 1e-3, timeout_s=900)[0]
    finally:
        engine.stop()
    assert out["versions"] == {"1"} and out["metrics"]["weight_sync/bytes"] > 0
    assert out["max_diff"] < 1e-3, out
    assert out["stale_error"] and "differ from the rollout engine's" in out["stale_error"]
