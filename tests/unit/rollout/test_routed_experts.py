"""Routed experts (rollout/routed_experts.py): the embedded engine's against transformers'
own routing of the same tokens, SGLang's encoding both ways, and malformed answers named."""

import base64

import numpy as np
import pytest
import torch

from rollout.routed_experts import decode_routes, encode_routes, route_dtype


@pytest.fixture(scope="module")
def moe_engine(tiny_model_dir):
    from rollout.embedded_engine import Engine

    return Engine(str(tiny_model_dir("qwen3_moe")), max_batch_size=8)


def _natural_routes(model_dir, tokens: list[int]) -> np.ndarray:
    """transformers' top-k of each layer's router logits over a teacher-forced pass (the
    router's own softmax is monotone in its logits): [len(tokens), layers, k]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return np.stack([logits.topk(k, dim=-1).indices.numpy() for logits in out.router_logits], axis=1)


def test_the_engine_returns_each_fed_tokens_experts(moe_engine, tiny_model_dir):
    from rollout.embedded_engine import SamplingParams

    prompts = [[5, 17, 3, 42, 8, 11, 2], [9, 4]]  # two lengths: the shorter one is left-padded
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    done = moe_engine.generate(prompts, [greedy, greedy], ["a", "b"], routed_experts=True)
    for prompt, c in zip(prompts, done):
        fed = prompt + c.output_ids[:-1]  # the last sampled token is never fed
        natural = _natural_routes(tiny_model_dir("qwen3_moe"), fed)
        assert c.routed_experts.shape == natural.shape == (len(fed), natural.shape[1], 2)
        assert np.array_equal(np.sort(c.routed_experts, -1), np.sort(natural, -1))
    assert moe_engine.generate(prompts[:1], [greedy], ["c"])[0].routed_experts is None  # not asked


def test_a_dense_model_refuses_the_request(tiny_model_dir):
    from rollout.embedded_engine import BadRequest, Engine, SamplingParams

    engine = Engine(str(tiny_model_dir("qwen3")), max_batch_size=2)
    with pytest.raises(BadRequest, match="not a mixture-of-experts model"):
        engine.submit([1, 2], SamplingParams(max_new_tokens=1), "x", routed_experts=True)


def test_sglangs_encoding_round_trips_and_narrows():
    routes = np.array([[[0, 3], [1, 2]], [[3, 1], [0, 0]]], dtype=np.int32)  # layer 1 of token 1: dense
    text = encode_routes(routes)
    assert base64.b64decode(text) == routes.tobytes()  # int32, C order, as SGLang's detokenizer
    back = decode_routes(text, rows=2, layers=2, k=2, num_experts=4)
    assert back.dtype == np.uint8 and np.array_equal(back, routes)
    assert route_dtype(257) == np.int16


@pytest.mark.parametrize("routes,rows,problem", [
    (np.zeros((3, 2, 2), np.int32) + [0, 1], 2, "48 bytes; 2 fed tokens"),
    (np.full((2, 2, 2), 4, np.int32), 2, "outside 0..3"),
    (np.array([[[1, 1], [0, 2]]] * 2, np.int32), 2, "one expert twice"),
])
def test_malformed_routes_are_named(routes, rows, problem):
    with pytest.raises(ValueError, match=problem):
        decode_routes(encode_routes(routes), rows=rows, layers=2, k=2, num_experts=4)
    with pytest.raises(ValueError, match="not base64"):
        decode_routes("#!", rows=1, layers=2, k=2, num_experts=4)


def test_the_request_flag_is_one_strict_bool():
    from rollout.embedded_engine import BadRequest
    from rollout.engine_requests import GenerationLimits, parse_generate

    limits = GenerationLimits(vocab_size=64, context_length=128, max_new_tokens_cap=None)
    assert parse_generate({"input_ids": [1, 2], "return_routed_experts": True}, limits).routed_experts
    assert not parse_generate({"input_ids": [1, 2]}, limits).routed_experts
    with pytest.raises(BadRequest, match="return_routed_experts"):
        parse_generate({"input_ids": [1, 2], "return_routed_experts": 1}, limits)
