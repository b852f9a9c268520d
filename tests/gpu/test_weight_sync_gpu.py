"""The weight sync on GPUs: the weight checksum of GPU tensors, and the actor (bf16, one NCCL
rank on GPU 0) sending its weights to a real SGLang server (bf16) whose logprobs then equal
the actor's within the bf16 check bound (before the sync they do not):

- over a weight-update group (NCCL broadcast): the server on GPU 1 (`--base-gpu-id 1`),
  since NCCL refuses a communicator with two ranks on one GPU; needs 2 GPUs;
- as CUDA IPC handles (`/update_weights_from_tensor`, the colocated path): the server on
  the trainer's GPU; needs 1.

Skipped without CUDA; the SGLang checks need the `gpu` extra (sglang)."""

from __future__ import annotations

import pytest
import torch

from rollout.weight_group import weight_checksum

pytestmark = pytest.mark.gpu


def test_weight_checksum_reads_gpu_tensors():
    t = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    assert weight_checksum(t.cuda()) == weight_checksum(t)
    assert weight_checksum(t.cuda().to(torch.bfloat16)) == weight_checksum(t.to(torch.bfloat16))


def _sync_to_sglang(model_dir: str, url: str, transport: str) -> dict:
    """The served-vs-actor gap at the start, after an update, and after a sync by `transport`."""
    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.training.batch import TrainBatch
    from megatron_agent.weight_sync import WeightSync, WeightSyncConfig
    from rollout.engine_client import EngineClient
    from tests.gpu.engines import served_gap

    ctx = init_distributed(ParallelConfig(), seed=7)
    actor = Actor(model_dir, ctx.parallel, ActorConfig(lr=1e-2, params_dtype="bf16", use_distributed_optimizer=False),
                  AlgorithmConfig(use_kl_loss=False, entropy_coef=0.0))
    client = EngineClient([url])
    out = {"start": served_gap(client, actor)}
    g = torch.Generator().manual_seed(1)
    vocab = actor.hf["vocab_size"]
    batch = TrainBatch.from_sequences([torch.randint(0, vocab, (6,), generator=g).tolist() for _ in range(4)],
                                      [torch.randint(0, vocab, (5,), generator=g).tolist() for _ in range(4)],
                                      advantages=[1.0, -1.0, 0.5, 2.0])
    actor.update(batch)  # large lr: far from the server's weights
    out["stale"] = served_gap(client, actor)
    sync = WeightSync(actor, [url], WeightSyncConfig(bucket_bytes=1 << 20, timeout_s=300, transport=transport))
    try:
        out["metrics"] = sync.sync(version=1)
    finally:
        sync.close()
    out["after"] = served_gap(client, actor)
    client.close()
    return out


def _sglang_sync(tiny_model_dir, tmp_path, transport: str, server_args: tuple[str, ...]) -> dict:
    pytest.importorskip("sglang", reason="sglang is not installed (the `gpu` extra)")
    from megatron_agent.platform.launch import run_on_ranks
    from rollout.engine_launch import EngineConfig, start_sglang_server

    model_dir = str(tiny_model_dir("qwen3", preset="small"))  # head_dim 32
    config = EngineConfig(server="sglang", gpus_per_engine=1, dtype="bfloat16",
                          server_args=("--disable-cuda-graph", *server_args))
    engine = start_sglang_server(config, model_dir, tmp_path / "logs", timeout_s=300)
    try:
        return run_on_ranks(_sync_to_sglang, 1, model_dir, engine.url, transport, timeout_s=300)[0]
    finally:
        engine.stop()


def _assert_synced(out: dict) -> None:
    from megatron_agent.training.checks import DEFAULT_MEAN_BOUND

    bound = DEFAULT_MEAN_BOUND["bf16"]
    print("measured: served vs actor logprobs (mean / max): "
          + "; ".join(f"{k} {out[k]['mean']:.3g} / {out[k]['max']:.3g}" for k in ("start", "stale", "after")))
    assert out["start"]["mean"] < bound and out["stale"]["mean"] > bound, out
    assert out["metrics"]["weight_sync/bytes"] > 0
    assert out["after"]["versions"] == ["1"] and out["after"]["mean"] < bound, out["after"]


@pytest.mark.slow
@pytest.mark.multirank
def test_nccl_weight_sync_to_a_real_sglang_server(tiny_model_dir, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: the trainer on GPU 0 and the server on GPU 1 (NCCL refuses a communicator "
                    "with two ranks on one GPU)")
    _assert_synced(_sglang_sync(tiny_model_dir, tmp_path, "broadcast",
                                ("--base-gpu-id", "1", "--mem-fraction-static", "0.5")))


@pytest.mark.slow
def test_cuda_ipc_weight_sync_to_a_real_sglang_server(tiny_model_dir, tmp_path):
    _assert_synced(_sglang_sync(tiny_model_dir, tmp_path, "tensor", ("--mem-fraction-static", "0.3")))
