"""The HF <-> Megatron bridge against the HF checkpoint and transformers, per family.

One 2-rank job: for every family and layout, load the HF weights into the sharded
Megatron model, export them back (must be bit-identical to the safetensors file),
compare the logits to transformers', save a dist checkpoint at TP=2 and load it at
TP=1 and PP=2 (same logits); megatron-agent-convert mcore-to-hf exports that checkpoint
bit-identically.
"""

from __future__ import annotations

import pytest
import torch

from megatron_agent.platform.launch import run_on_ranks
from tests.multirank.exports import assert_round_trip, layout_name

pytestmark = pytest.mark.multirank

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe"]
LAYOUTS = {
    "dense": [dict(tp=2), dict(pp=2), dict(pp=2, vpp=2)],
    "moe": [dict(tp=2), dict(pp=2), dict(ep=2)],
}
RESHARD_LAYOUTS = [dict(), dict(pp=2)]  # loads of the TP=2 checkpoint



def _logits_at(layout: dict, world: int, model_dir: str, ids, vocab: int, load) -> tuple:
    from megatron_agent.models import build_model
    from megatron_agent.platform import ParallelConfig, initialize_model_parallel, set_seed
    from megatron_agent.training.schedule import forward_logits

    parallel = ParallelConfig(**layout)
    initialize_model_parallel(parallel, world)
    set_seed(3)
    chunks = build_model(model_dir, parallel, training=False)
    load(chunks)
    return chunks, forward_logits(chunks, ids, vocab)


def _worker(model_dirs: dict, ckpt_root: str) -> dict:
    import os
    from functools import partial

    from megatron.core import dist_checkpointing
    from transformers import AutoModelForCausalLM

    from megatron_agent.models import read_hf_config
    from megatron_agent.models.bridge import export_hf_weights, load_hf_weights
    from megatron_agent.models.checkpoint import load_mcore_checkpoint, model_state
    from megatron_agent.platform import ParallelConfig, destroy_model_parallel, init_distributed

    ctx = init_distributed(ParallelConfig(), seed=3)
    destroy_model_parallel()
    out = {}
    for family, model_dir in model_dirs.items():
        hf = read_hf_config(model_dir)
        ids = torch.randint(0, hf["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
        hf_logits = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(ids).logits.detach()
        ckpt = f"{ckpt_root}/{family}"
        results = out[family] = {}
        at = partial(_logits_at, world=ctx.world_size, model_dir=model_dir, ids=ids, vocab=hf["vocab_size"])

        for layout in LAYOUTS["moe" if "moe" in family else "dense"]:
            chunks, logits = at(layout, load=partial(load_hf_weights, hf_dir=model_dir))
            exported = {k: v.clone() for k, v in export_hf_weights(chunks, hf)}
            if layout == dict(tp=2):
                os.makedirs(ckpt, exist_ok=True)
                dist_checkpointing.save(model_state(chunks), ckpt)
            results[layout_name(layout)] = {
                "exported": exported,
                "logit_diff": None if logits is None else float((logits - hf_logits).abs().max()),
            }
            destroy_model_parallel()

        for layout in RESHARD_LAYOUTS:
            _, logits = at(layout, load=partial(load_mcore_checkpoint, mcore_dir=ckpt))
            results["reshard " + layout_name(layout)] = {
                "logit_diff": None if logits is None else float((logits - hf_logits).abs().max()),
            }
            destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def bridge_results(tiny_model_dir, ckpt_root):
    dirs = {f: str(tiny_model_dir(f)) for f in FAMILIES}
    return dirs, run_on_ranks(_worker, 2, dirs, str(ckpt_root), timeout_s=600)


def _layouts(family):
    return LAYOUTS["moe" if "moe" in family else "dense"]


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_identical(bridge_results, family):
    dirs, per_rank = bridge_results
    assert_round_trip(dirs[family], per_rank, family, _layouts(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(bridge_results, family):
    _, per_rank = bridge_results
    names = [layout_name(layout) for layout in _layouts(family)] + ["reshard " + layout_name(x) for x in RESHARD_LAYOUTS]
    for name in names:
        diffs = [r[family][name]["logit_diff"] for r in per_rank if r[family][name]["logit_diff"] is not None]
        assert diffs, f"no rank produced logits for {family} {name}"
        assert max(diffs) < 1e-4, (family, name, diffs)


EXPORT = """
from tools.checkpoint_convert.convert import mcore_to_hf
if __name__ == "__main__":
    for family, model_dir in {dirs!r}.items():
        mcore_to_hf({root!r} + "/" + family, {out!r} + "/" + family, hf_config_dir=model_dir)
"""


def test_mcore_to_hf_exports_a_checkpoint_saved_at_tp2(bridge_results, ckpt_root, tmp_path):
    """The converter reads a checkpoint whose chunks are TP shards (as the trainer writes
    them), not its own layer-sized ones."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    dirs, _ = bridge_results
    for family in FAMILIES:
        (ckpt_root / family / "megatron_agent.json").write_text(json.dumps({"family": family, "dtype": "fp32"}))
    code = EXPORT.format(dirs=dirs, root=str(ckpt_root), out=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for family in FAMILIES:
        original = load_file(f"{dirs[family]}/model.safetensors")
        exported = load_file(tmp_path / family / "model.safetensors")
        assert exported.keys() == original.keys(), family
        assert all(torch.equal(exported[k], original[k]) for k in original), family
