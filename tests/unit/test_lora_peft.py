"""The PEFT form of the actor's adapters where HF keeps a layer's experts in one parameter
(Qwen3-VL-MoE): PEFT's own loader puts it on the HF model with the logits of the model
whose weights are merged by hand, W + (alpha/r)·B·A per expert, in transformers' memory.
(Per-expert modules, dense models and the actor's side: tests/multirank/test_lora.py.)"""

from __future__ import annotations

import torch

from megatron_agent.models.lora import (
    LoraConfig,
    adapter_serving_problem,
    peft_config,
    peft_tensors,
    write_peft_dir,
)
from megatron_agent.models.transformer_config import read_hf_config

RANK, ALPHA = 2, 4.0


def test_fused_experts_go_as_peft_target_parameters(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    model_dir = tiny_model_dir("qwen3_vl_moe")
    hf = read_hf_config(model_dir)
    d, f, experts = hf["hidden_size"], hf["moe_intermediate_size"], hf["num_experts"]
    q = hf["num_attention_heads"] * hf["head_dim"]
    g = torch.Generator().manual_seed(0)

    def factors(n_in, n_out):
        return torch.randn(RANK, n_in, generator=g) * 0.2, torch.randn(n_out, RANK, generator=g) * 0.2

    layers = range(hf["num_hidden_layers"])
    adapters = {}  # Megatron's names (models/lora.py whole_adapters)
    for i in layers:
        for e in range(experts):
            adapters[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1"] = factors(d, 2 * f)
            adapters[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2"] = factors(f, d)
        adapters[f"decoder.layers.{i}.self_attention.linear_proj"] = factors(q, d)
    lora = LoraConfig(rank=RANK, alpha=ALPHA, targets=["linear_proj", "linear_fc1", "linear_fc2"])
    config = peft_config(hf, lora, str(model_dir))
    assert config["target_modules"] == ["o_proj"]
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    tensors = peft_tensors(hf, adapters)
    write_peft_dir(tmp_path / "adapter", config, tensors)

    merged = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    scale = ALPHA / RANK
    with torch.no_grad():  # in memory: gate_up_proj [E, 2f, d] (rows gate; up, as Megatron's fc1), down_proj [E, d, f]
        for i in layers:
            layer = merged.model.language_model.layers[i]
            for e in range(experts):
                a, b = adapters[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1"]
                layer.mlp.experts.gate_up_proj[e] += scale * b @ a
                a, b = adapters[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2"]
                layer.mlp.experts.down_proj[e] += scale * b @ a
            a, b = adapters[f"decoder.layers.{i}.self_attention.linear_proj"]
            layer.self_attn.o_proj.weight += scale * b @ a
    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.randint(0, 64, (2, 12), generator=g)
    with torch.no_grad():
        want, got = merged(input_ids=ids).logits, peft(input_ids=ids).logits
        unadapted = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-5
    assert (unadapted - want).abs().max() > 1e-3  # the adapters change the logits

    # the engines load adapters on modules: such a model's expert adapters are refused for serving
    assert "keeps its experts fused in HF" in adapter_serving_problem(hf, lora)
    assert adapter_serving_problem(hf, LoraConfig(rank=RANK, experts=False)) is None
