"""The embedded engine's LoRA serving (rollout/engine_lora.py), against `peft` on the same
adapter directory (dense) and against the weights merged by hand (MoE, per-expert adapters
onto transformers' fused experts); then SGLang's rules: names, unloads, bad adapters."""

from __future__ import annotations

import threading

import pytest
import torch

from rollout.embedded_engine import BadRequest, Engine
from rollout.engine_server import ROUTES, generate
from tests.unit.rollout.test_embedded_engine import prompts, teacher_forced

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model(model_dir, out_dir):
    """`peft`'s own adapter on the tiny model, B drawn at random (PEFT starts it at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    model.save_pretrained(out_dir)
    return model.eval()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    torch.set_num_threads(1)
    return Engine(str(tiny_model_dir("qwen3")))


def _ask(engine, prompt, lora_path=None, tokens=8):
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True},
            "return_logprob": True, **({"lora_path": lora_path} if lora_path else {})}
    out = generate(engine, body)
    return out["output_ids"], torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])


def test_an_adapter_serves_peft_s_logprobs_and_the_base_stays(engine, tiny_model_dir, tmp_path):
    reference = _peft_model(tiny_model_dir("qwen3"), tmp_path / "adapter")
    base_before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    ROUTES[("POST", "/load_lora_adapter")](engine, {"lora_name": "a", "lora_path": str(tmp_path / "adapter")})
    prompt = prompts(engine)[2]
    # base and adapter requests in one call: the engine runs them as two batches
    body = {"input_ids": [prompt, prompt], "lora_path": [None, "a"], "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    base_out, adapted_out = generate(engine, body)
    adapted_ids = adapted_out["output_ids"]
    served = torch.tensor([lp for lp, _, _ in adapted_out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(served, teacher_forced(reference, prompt, adapted_ids, 0.0), atol=1e-5, rtol=0)
    with reference.disable_adapter():
        base = teacher_forced(reference, prompt, base_out["output_ids"], 0.0)
    torch.testing.assert_close(torch.tensor([lp for lp, _, _ in base_out["meta_info"]["output_token_logprobs"]]),
                               base, atol=1e-5, rtol=0)
    assert adapted_ids != base_out["output_ids"] or not torch.allclose(served, base)
    ROUTES[("POST", "/unload_lora_adapter")](engine, {"lora_name": "a"})
    assert all(torch.equal(v, base_before[k]) for k, v in engine.model.state_dict().items())


def test_moe_per_expert_adapters_equal_the_weights_merged_by_hand(tiny_model_dir):
    from rollout.engine_lora import merge_lora

    torch.set_num_threads(1)
    model_dir = str(tiny_model_dir("qwen3_moe"))
    served, merged = Engine(model_dir), Engine(model_dir)
    g = torch.Generator().manual_seed(1)
    tensors, by_hand = {}, []
    for module in ("model.layers.0.mlp.experts.1.gate_proj", "model.layers.0.mlp.experts.1.down_proj",
                   "model.layers.1.mlp.experts.0.up_proj", "model.layers.1.self_attn.q_proj"):
        weight = served.weight_view(f"{module}.weight")
        a = torch.randn(4, weight.shape[1], generator=g) * 0.3
        b = torch.randn(weight.shape[0], 4, generator=g) * 0.3
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        by_hand.append((f"{module}.weight", merge_lora(weight, a, b, 8 / 4)))
    served.adapters.load("moe", {"r": 4, "lora_alpha": 8}, tensors)
    merged.load_weights(by_hand)
    prompt = prompts(served)[1]
    ids, logprobs = _ask(served, prompt, "moe")
    assert (ids, logprobs.tolist()) == tuple(x.tolist() if torch.is_tensor(x) else x for x in _ask(merged, prompt))
    assert _ask(served, prompt)[1].tolist() != logprobs.tolist()  # the base without it


def test_sglang_s_rules_for_names_and_unloads(engine, tiny_model_dir, tmp_path):
    _peft_model(tiny_model_dir("qwen3"), tmp_path / "adapter")
    load = ROUTES[("POST", "/load_lora_adapter")]
    answer = load(engine, {"lora_name": "v1", "lora_path": str(tmp_path / "adapter")})
    assert answer["success"] and "v1" in answer["loaded_adapters"]
    with pytest.raises(BadRequest, match="loaded already: unload it first"):
        load(engine, {"lora_name": "v1", "lora_path": str(tmp_path / "adapter")})
    with pytest.raises(BadRequest, match="names no loaded LoRA adapter") as err:
        _ask(engine, prompts(engine)[0], "v2")
    assert err.value.field == "lora_path"
    with pytest.raises(BadRequest, match="no PEFT adapter directory"):
        load(engine, {"lora_name": "v2", "lora_path": str(tmp_path)})
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    (garbled / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(BadRequest, match="no PEFT adapter directory"):
        load(engine, {"lora_name": "v2", "lora_path": str(garbled)})

    # an unload refuses new requests at once and waits for the one queued
    engine.pause("in_place")
    pending = engine.submit(prompts(engine)[0], engine_params(), "held", adapter="v1")
    unloaded = threading.Thread(target=ROUTES[("POST", "/unload_lora_adapter")], args=(engine, {"lora_name": "v1"}))
    unloaded.start()
    unloaded.join(0.3)
    assert unloaded.is_alive()
    with pytest.raises(BadRequest, match="names no loaded LoRA adapter"):
        _ask(engine, prompts(engine)[0], "v1")
    engine.resume()
    unloaded.join(30)
    assert pending.done.is_set() and pending.result.finish_reason["type"] == "length" and not unloaded.is_alive()
    assert engine.model_info()["lora_adapters"] == []


@pytest.mark.parametrize("broken, message", [
    ({"r": 4}, "integer r and number lora_alpha"),
    ("shape", "for a weight of"),
    ("module", "has no module"),
    ("half", "come in pairs"),
])
def test_a_broken_adapter_is_refused_naming_why(engine, broken, message):
    weight = engine.weight_view("model.layers.0.self_attn.o_proj.weight")
    module = "base_model.model.model.layers.0.self_attn.o_proj"
    tensors = {f"{module}.lora_A.weight": torch.zeros(4, weight.shape[1]),
               f"{module}.lora_B.weight": torch.zeros(weight.shape[0], 4)}
    config = {"r": 4, "lora_alpha": 8}
    if broken == "shape":
        tensors[f"{module}.lora_B.weight"] = torch.zeros(weight.shape[0] + 1, 4)
    elif broken == "module":
        tensors = {k.replace("o_proj", "x_proj"): v for k, v in tensors.items()}
    elif broken == "half":
        del tensors[f"{module}.lora_B.weight"]
    else:
        config = broken
    with pytest.raises(BadRequest, match=message):
        shared = Handles()
        engine.load_lora_adapter_from_tensors("broken", config, [shared(tensors)])
    assert "broken" not in engine.adapters.loaded


def engine_params():
    from rollout.embedded_engine import SamplingParams

    return SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


class Handles:
    """`serialized_named_tensors` entries for `tensors`, as a trainer sends them: handles to
    shared memory that must outlive the engine's read (this object holds it)."""

    def __init__(self):
        self.buffers = []

    def __call__(self, tensors: dict) -> str:
        from rollout.weight_tensors import serialize, tensor_payload

        buffer, payload = tensor_payload(list(tensors.items()), flattened=False)
        self.buffers.append(buffer)
        return serialize(payload)
