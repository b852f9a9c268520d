"""models/memory.py's activation bytes against what autograd keeps, measured.

One 2-rank job (gloo, bf16 parameters, so every tensor has the dtype the GPU run gives it)
trains one micro-batch per rank through `Actor.update` for tiny dense, MoE and
vision-language models at TP=1 (DP=2) and TP=2 with sequence parallelism (MoE: EP=2), and
the dense model once more with Megatron's fused SwiGLU. Saved-tensor hooks
(tests/saved_tensors.py) record every tensor the forward and the loss save; when `_loss`
returns (before backward) the storages still held are counted once each, by the part of
the model that saved them: the decoder layers, the vision tower, the loss, the rest (the
head). `activation_bytes` with the CPU path (Megatron's local spec) and each rank's own
micro-batch (rows, padded width, image patches) must give each part within 10 %, summed
over the two ranks (with EP=2 the routed copies are even only over the two ranks together).

The same job checks training/logprobs.py at TP=2 against the functions it replaced
(values and gradients of each rank's vocabulary slice) and against the whole vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from megatron_agent.models import read_hf_config
from megatron_agent.models.memory import CPU_PATH, ActivationPath, MicroBatchShape, activation_bytes
from megatron_agent.platform import ParallelConfig
from megatron_agent.platform.launch import run_on_ranks
from tests.saved_tensors import total

pytestmark = pytest.mark.multirank

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_vl")
SP = dict(tp=2, sequence_parallel=True)
# (name, family, layout, fused SwiGLU)
RUNS = [
    ("qwen3 tp=1", "qwen3", {}, False),
    ("qwen3 tp=2 sp", "qwen3", SP, False),
    ("qwen3 tp=2 sp fused", "qwen3", SP, True),
    ("qwen3_moe tp=1", "qwen3_moe", {}, False),
    ("qwen3_moe tp=2 ep=2 sp", "qwen3_moe", dict(SP, ep=2, etp=1), False),
    ("qwen3_vl tp=1", "qwen3_vl", {}, False),
    ("qwen3_vl tp=2 sp", "qwen3_vl", SP, False),
]
PARTS = ("layers", "head", "loss", "vision")
TOLERANCE = 0.10


def _text_batch(vocab: int):
    from megatron_agent.training.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (40, 55, 30, 47)]
    responses = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 4, 12, 6)]
    return TrainBatch.from_sequences(prompts, responses, advantages=[1.0, -0.5, 1.5, 0.8], temperature=0.9)


def _image_batch(model_dir: str):
    from tests.multirank.test_vision_language import _actor_batch
    from tests.vlm_batch import vlm_batch

    return _actor_batch(vlm_batch(model_dir))


def _part_of(name: str) -> str:
    if name.startswith("decoder.layers."):
        return "layers"
    return "vision" if name.startswith("vision") else "head"


def _measure(model_dir: str, layout: dict, fused: bool, world_size: int) -> dict:
    """One update of one micro-batch per rank; the bytes held when the loss returns."""
    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.models import transformer_config
    from megatron_agent.platform import destroy_model_parallel, initialize_model_parallel, set_seed
    from megatron_agent.training.actor import Actor, ActorConfig
    from tests.saved_tensors import SavedTensors

    parallel = ParallelConfig(**layout)
    initialize_model_parallel(parallel, world_size)
    set_seed(5)
    default = transformer_config.swiglu_fusion_default
    transformer_config.swiglu_fusion_default = lambda: fused
    try:
        # the presets' loss: clipped surrogate, KL to the reference, entropy bonus
        actor = Actor(model_dir, parallel, ActorConfig(lr=1e-4, max_tokens_per_micro_batch=4096, params_dtype="bf16",
                                                       use_distributed_optimizer=False),
                      AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01, entropy_coef=0.001))
    finally:
        transformer_config.swiglu_fusion_default = default
    hf = read_hf_config(model_dir)
    batch = _image_batch(model_dir) if "vision_config" in hf else _text_batch(hf["vocab_size"])
    batch.old_logprobs = actor.compute_logprobs(batch)["logprobs"]
    model = actor.chunks[0]
    excluded = [t for chunk in actor.chunks for t in (*chunk.parameters(), *chunk.buffers())]
    seen = {}
    model.register_forward_pre_hook(lambda _m, args: seen.update(width=int(args[0].shape[1]),
                                                                  sequences=int(args[0].shape[0])))
    loss = actor._loss
    with SavedTensors(excluded, dict(model.named_modules()), _part_of) as saved:
        def measured_loss(batch, mb, logits, denominator):
            with saved.in_part("loss"):
                out = loss(batch, mb, logits, denominator)
            seen["saved"] = saved.bytes()
            seen["patches"] = int(mb["pixel_values"].shape[0]) if "pixel_values" in mb else 0
            seen["micro_batches"] = seen.get("micro_batches", 0) + 1
            return out

        actor._loss = measured_loss
        actor.update(batch)
    del actor
    destroy_model_parallel()
    return seen


def _logprobs_at_tp2(world_size: int) -> dict:
    """Each rank's vocabulary slice of one set of logits: the chunked functions' and the
    reference's values and gradients, and the whole vocabulary's values at TP=1."""
    from megatron_agent.platform import destroy_model_parallel, initialize_model_parallel
    from megatron_agent.training import logprobs
    from tests import logprobs_reference as reference

    initialize_model_parallel(ParallelConfig(tp=2), world_size)
    g = torch.Generator().manual_seed(7)
    full = torch.randn(3, 11, 2 * 96, generator=g) * 3
    full[..., -3:] = -1.0e4
    targets = torch.randint(0, 2 * 96 - 3, (3, 11), generator=g)
    weights = torch.randn(2, 3, 11, generator=g)
    rank = torch.distributed.get_rank()
    mine = full[..., rank * 96:(rank + 1) * 96]
    logprobs.CHUNK_ELEMENTS = 200  # two rows a chunk
    out = {}
    for name, (lp_fn, h_fn) in {"chunked": (logprobs.token_logprobs, logprobs.token_entropy),
                                "reference": (reference.token_logprobs, reference.token_entropy)}.items():
        x = mine.clone().requires_grad_()
        lp, h = lp_fn(x, targets, 0.8), h_fn(x, 0.8)
        ((lp * weights[0]).sum() + (h * weights[1]).sum()).backward()
        out[name] = (lp.detach(), h.detach(), x.grad)
    z = torch.log_softmax(full / 0.8, dim=-1)
    out["whole vocabulary"] = (z.gather(-1, targets[..., None])[..., 0], -(z.exp() * z).sum(-1))
    destroy_model_parallel()
    return out


def _worker(model_dirs: dict[str, str], runs=RUNS, logprobs_check: bool = True) -> dict:
    from megatron_agent.platform import destroy_model_parallel, init_distributed

    ctx = init_distributed(ParallelConfig(), seed=5)
    destroy_model_parallel()
    results = {name: _measure(model_dirs[family], layout, fused, ctx.world_size)
               for name, family, layout, fused in runs}
    if logprobs_check:
        results["logprobs tp=2"] = _logprobs_at_tp2(ctx.world_size)
    return results


@pytest.fixture(scope="module")
def measured(tiny_model_dir):
    dirs = {family: str(tiny_model_dir(family)) for family in FAMILIES}
    return dirs, run_on_ranks(_worker, 2, dirs, timeout_s=600)


def _assert_modelled(run, hf: dict, per_rank: list[dict], path: ActivationPath) -> None:
    """Each part's bytes, summed over the ranks, against `activation_bytes` for each rank's
    own micro-batch."""
    name, family, layout, _ = run
    measured_parts = {part: 0 for part in PARTS}
    modelled_parts = {part: 0 for part in PARTS}
    for rank in per_rank:
        seen = rank[name]
        assert seen["micro_batches"] == 1, name  # one micro-batch: nothing of an earlier one is held
        assert set(seen["saved"]) <= set(PARTS), seen["saved"].keys()  # nothing saved outside a part
        shape = MicroBatchShape(seen["sequences"], seen["width"], seen["patches"])
        for part, n in activation_bytes(hf, ParallelConfig(**layout), shape, path).items():
            modelled_parts[part] += n
            measured_parts[part] += total(seen["saved"], parts=[part])
    lines = [f"{part}: measured {measured_parts[part]}, modelled {modelled_parts[part]}" for part in PARTS]
    for part in PARTS:
        assert measured_parts[part] == pytest.approx(modelled_parts[part], rel=TOLERANCE, abs=256), (name, lines)
    assert (measured_parts["vision"] > 0) == (family == "qwen3_vl")


@pytest.mark.parametrize("run", RUNS, ids=[r[0] for r in RUNS])
def test_activation_bytes_match_what_autograd_keeps(measured, run):
    dirs, per_rank = measured
    _assert_modelled(run, read_hf_config(dirs[run[1]]), per_rank, ActivationPath("local", fused_swiglu=run[3]))


def test_fused_swiglu_keeps_three_mlp_widths_where_the_unfused_keeps_five(measured):
    """The fused path's saving, measured: (5 - 3) x the MLP width per token and layer."""
    dirs, per_rank = measured
    hf = read_hf_config(dirs["qwen3"])
    saved = sum(total(rank["qwen3 tp=2 sp"]["saved"], parts=["layers"])
                - total(rank["qwen3 tp=2 sp fused"]["saved"], parts=["layers"]) for rank in per_rank)
    tokens = sum(rank["qwen3 tp=2 sp"]["sequences"] * rank["qwen3 tp=2 sp"]["width"] for rank in per_rank)
    assert saved == 2 * 2 * tokens * hf["intermediate_size"] // 2 * hf["num_hidden_layers"]  # bf16, I / TP


def test_the_loss_keeps_the_bf16_logits_and_no_fp32_copy(measured):
    """What the loss keeps is the logits (bf16, [b, s, V/TP]) and a few bytes per token:
    no fp32 tensor of the vocabulary's size."""
    dirs, per_rank = measured
    for name, family, layout, _ in RUNS:
        vocab = read_hf_config(dirs[family])["vocab_size"] // layout.get("tp", 1)
        for rank in per_rank:
            seen = rank[name]
            tokens = seen["sequences"] * seen["width"]
            loss = seen["saved"]["loss"]
            assert loss[torch.bfloat16] == 2 * tokens * vocab, name
            assert loss.get(torch.float32, 0) < 4 * tokens * 32, name


def test_logprobs_at_tp2_equal_the_reference_and_the_whole_vocabulary(measured):
    _, per_rank = measured
    for rank in per_rank:
        got = rank["logprobs tp=2"]
        (lp, h, grad), (ref_lp, ref_h, ref_grad) = got["chunked"], got["reference"]
        assert torch.equal(lp, ref_lp) and torch.equal(h, ref_h)
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)
        assert ref_grad.abs().max() > 0.01
        whole_lp, whole_h = got["whole vocabulary"]
        torch.testing.assert_close(lp, whole_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(h, whole_h, rtol=0, atol=1e-5)
    assert not torch.equal(per_rank[0]["logprobs tp=2"]["chunked"][2], per_rank[1]["logprobs tp=2"]["chunked"][2])


def test_the_cpu_path_is_what_a_machine_without_cuda_builds(monkeypatch):
    """The measured path is the one `activation_bytes` calls the CPU's: where CUDA is absent
    the layer spec is local and SwiGLU unfused (CUDA hidden on a GPU machine too)."""
    from megatron_agent.models.builder import choose_layer_spec
    from megatron_agent.models.transformer_config import swiglu_fusion_default

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert (choose_layer_spec(), swiglu_fusion_default()) == (CPU_PATH.layer_spec, CPU_PATH.fused_swiglu)


@pytest.mark.gpu
def test_the_gpu_path_matches_what_autograd_keeps_on_a_gpu(tiny_model_dir):
    """The same measurement on GPUs (Transformer Engine's spec, fused SwiGLU, flash
    attention) against `activation_bytes`' GPU path: TP=1 on one GPU, TP=2 with sequence
    parallelism as well on two."""
    gpus = min(2, torch.cuda.device_count())
    runs = [(f"{family} tp=1 gpu", family, {}, True) for family in FAMILIES]
    if gpus == 2:
        runs += [(f"{family} tp=2 sp gpu", family, dict(SP, ep=2, etp=1) if "moe" in family else SP, True)
                 for family in FAMILIES]
    dirs = {family: str(tiny_model_dir(family)) for family in FAMILIES}
    per_rank = run_on_ranks(_worker, gpus, dirs, runs, logprobs_check=False, timeout_s=600)
    for run in runs:
        _assert_modelled(run, read_hf_config(dirs[run[1]]), per_rank, ActivationPath())
