"""megatron-agent-convert end to end, per family, and its errors on bad input.

hf-to-mcore writes one layout-free checkpoint; `verify` loads it at another layout per
family (TP2, PP2 with VPP2, EP2) and compares the logits with transformers'."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

LAYOUT = {"llama": ["--tp", "2"], "qwen2": ["--pp", "2", "--vpp", "2"], "qwen3": ["--tp", "2"],
          "qwen3_moe": ["--ep", "2"]}


def convert(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "tools.checkpoint_convert", *args],
                          capture_output=True, text=True, timeout=timeout)


def hf_tensors(path):
    index = path / "model.safetensors.index.json"
    if index.exists():
        out = {}
        for file in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            out.update(load_file(path / file))
        return out
    return load_file(path / "model.safetensors")


@pytest.mark.multirank
@pytest.mark.parametrize("family", sorted(LAYOUT))
def test_round_trip_through_the_cli(tiny_model_dir, tmp_path, family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny_model_dir(family)
    mcore, back = tmp_path / "mcore", tmp_path / "hf"
    out = convert("hf-to-mcore", "--hf", str(src), "--out", str(mcore), *LAYOUT[family])
    assert out.returncode == 0, out.stderr
    out2 = convert("mcore-to-hf", "--mcore", str(mcore), "--out", str(back), "--max-shard-size", "200KB")
    assert out2.returncode == 0, out2.stderr
    assert "converting" not in out.stdout + out2.stdout  # fp32 stays fp32 with no flag
    original, converted = hf_tensors(src), hf_tensors(back)
    assert original.keys() == converted.keys()
    assert all(converted[k].dtype == torch.float32 and torch.equal(original[k], converted[k]) for k in original)
    assert (back / "model.safetensors.index.json").exists()  # several shards at 200KB
    model = AutoModelForCausalLM.from_pretrained(back)
    assert AutoTokenizer.from_pretrained(back).chat_template
    assert model.config.model_type == family
    out = convert("verify", "--hf", str(src), "--mcore", str(mcore), *LAYOUT[family])
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def test_verify_fails_on_different_weights(tiny_model_dir, tmp_path):
    src = tiny_model_dir("qwen3")
    other = tmp_path / "other"
    from megatron_agent.models.tiny import write_tiny_model

    write_tiny_model("qwen3", other, seed=99)
    mcore = tmp_path / "mcore"
    assert convert("hf-to-mcore", "--hf", str(other), "--out", str(mcore), "--dtype", "fp32").returncode == 0
    out = convert("verify", "--hf", str(src), "--mcore", str(mcore))
    assert out.returncode == 1 and "FAIL" in out.stdout


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_family(tiny_model_dir, tmp_path):
    bad = _copy(tiny_model_dir("qwen3"), tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(config, model_type="mistral")))
    out = convert("hf-to-mcore", "--hf", str(bad), "--out", str(tmp_path / "o"))
    assert out.returncode == 2 and "model_type='mistral' is not supported" in out.stderr
    assert not (tmp_path / "o").exists()


def test_missing_shard(tiny_model_dir, tmp_path):
    bad = _copy(tiny_model_dir("qwen3"), tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:10]}, bad / "model-00001-of-00002.safetensors")
    (bad / "model.safetensors").unlink()
    weight_map = {k: "model-00001-of-00002.safetensors" for k in names[:10]}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in names[10:]})
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    out = convert("hf-to-mcore", "--hf", str(bad), "--out", str(tmp_path / "o"))
    assert out.returncode == 2 and "model-00002-of-00002.safetensors, which is missing" in out.stderr
    assert not (tmp_path / "o").exists()


def test_shape_that_does_not_match_the_config(tiny_model_dir, tmp_path):
    bad = _copy(tiny_model_dir("qwen3"), tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:100]
    save_file(tensors, bad / "model.safetensors")
    out = convert("hf-to-mcore", "--hf", str(bad), "--out", str(tmp_path / "o"))
    assert out.returncode == 2
    assert "decoder.layers.1.mlp.linear_fc1.weight" in out.stderr and "model.layers.1.mlp.up_proj.weight" in out.stderr
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.partial-*"))


def test_layout_that_does_not_divide_the_model(tiny_model_dir, tmp_path):
    out = convert("hf-to-mcore", "--hf", str(tiny_model_dir("qwen3")), "--out", str(tmp_path / "o"), "--tp", "8")
    assert out.returncode == 2 and "num_attention_heads=4 is not divisible by tp=8" in out.stderr


CONVERT_TWICE = """
from tools.checkpoint_convert.convert import hf_to_mcore, mcore_to_hf
if __name__ == "__main__":
    hf_to_mcore({src!r}, {mcore!r}, dtype="bf16")
    print("--")
    mcore_to_hf({mcore!r}, {bf16!r})
    print("--")
    mcore_to_hf({mcore!r}, {fp32!r}, dtype="fp32")
"""


def test_a_dtype_change_is_said_and_the_default_follows_the_checkpoint(tiny_model_dir, tmp_path):
    src = tiny_model_dir("qwen3")
    paths = {k: str(tmp_path / k) for k in ("mcore", "bf16", "fp32")}
    out = subprocess.run([sys.executable, "-c", CONVERT_TWICE.format(src=str(src), **paths)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    to_mcore, to_bf16, to_fp32 = out.stdout.split("--\n")
    assert to_mcore.strip() == "converting fp32 -> bf16 (--dtype bf16)"
    assert json.loads((tmp_path / "mcore" / "megatron_agent.json").read_text())["dtype"] == "bf16"
    assert to_bf16.strip() == ""  # the mcore checkpoint's own dtype
    assert {t.dtype for t in hf_tensors(tmp_path / "bf16").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert to_fp32.strip() == "converting bf16 -> fp32 (--dtype fp32)"
    original, widened = hf_tensors(src), hf_tensors(tmp_path / "fp32")
    assert all(torch.equal(widened[k], original[k].bfloat16().float()) for k in original)


MEASURE_PEAK = """
import json
import megatron.core.models.gpt, megatron_agent.models.builder
from tools.checkpoint_convert.convert import hf_to_mcore, mcore_to_hf

def peak_mib():
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024

if __name__ == "__main__":
    before = peak_mib()
    hf_to_mcore({src!r}, {mcore!r})
    between = peak_mib()
    mcore_to_hf({mcore!r}, {back!r})
    print(json.dumps({{"before": before, "between": between, "after": peak_mib()}}))
"""


def test_conversions_hold_a_few_layers_not_the_model(tmp_path):
    """Peak resident memory of both conversions, in a fresh process, against a model
    of 200 MB (16 layers of 12.6 MB): it must stay well below one copy of the model."""
    from megatron_agent.models.tiny import write_tiny_model

    src = write_tiny_model("qwen3", tmp_path / "hf", num_hidden_layers=16, hidden_size=512, intermediate_size=1536,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    model_mib = (src / "model.safetensors").stat().st_size / 2**20
    code = MEASURE_PEAK.format(src=str(src), mcore=str(tmp_path / "mcore"), back=str(tmp_path / "back"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    grown = peaks["after"] - peaks["before"]
    assert model_mib > 190 and grown < model_mib / 2, (peaks, model_mib)
