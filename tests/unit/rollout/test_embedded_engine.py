"""The embedded engine's generation (in process, no HTTP): logprobs against a
teacher-forced forward pass, seeding, stops, batching, a request failing alone in its
batch, weight loading."""

from __future__ import annotations

import time

import pytest
import torch

from rollout.embedded_engine import BadRequest, Engine, GenerationFailed, SamplingParams
from rollout.engine_server import generate
from rollout.weight_group import flatten_bucket, unflatten_bucket


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    torch.set_num_threads(1)
    return Engine(str(tiny_model_dir("qwen3")))


def prompts(engine):
    tok = engine.tokenizer
    return [tok(t, add_special_tokens=False)["input_ids"] for t in
            ("you are an agent in environment", "move left", "position 5 target 3 move up down step reward")]


def teacher_forced(model, prompt, output, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logits = logits[len(prompt) - 1:-1]
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_equal_a_teacher_forced_forward(engine, temperature):
    ps = prompts(engine)
    params = [{"temperature": temperature, "max_new_tokens": 12, "sampling_seed": i, "top_p": 0.9} for i in range(3)]
    outs = generate(engine, {"input_ids": ps, "sampling_params": params, "return_logprob": True})
    for p, o in zip(ps, outs):
        lps = torch.tensor([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
        assert [t for _, t, _ in o["meta_info"]["output_token_logprobs"]] == o["output_ids"]
        assert len(o["output_ids"]) == o["meta_info"]["completion_tokens"] > 0
        torch.testing.assert_close(lps, teacher_forced(engine.model, p, o["output_ids"], temperature),
                                   atol=1e-4, rtol=0)


def test_greedy_equals_hf_generate(engine):
    p = prompts(engine)[2]
    out = generate(engine, {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 10,
                                                                "ignore_eos": True}})
    hf = engine.model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long), eos_token_id=None)
    assert out["output_ids"] == hf[0, len(p):].tolist()


def test_seeded_sampling_does_not_depend_on_the_batch(engine):
    ps = prompts(engine)
    params = {"temperature": 1.0, "max_new_tokens": 16, "sampling_seed": 42}
    alone = generate(engine, {"input_ids": ps[1], "sampling_params": params})
    batched = generate(engine, {"input_ids": ps, "sampling_params": [dict(params, sampling_seed=s) for s in (1, 42, 3)]})
    assert batched[1]["output_ids"] == alone["output_ids"]
    other = generate(engine, {"input_ids": ps[1], "sampling_params": dict(params, sampling_seed=43)})
    assert other["output_ids"] != alone["output_ids"]


def test_stop_strings_stop_ids_and_length(engine):
    p = prompts(engine)[0]
    free = generate(engine, {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 8,
                                                                  "ignore_eos": True}})
    assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    third = free["output_ids"][2]
    by_id = generate(engine, {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 8,
                                                                   "stop_token_ids": [third]}})
    first_hit = free["output_ids"].index(third) + 1
    assert by_id["output_ids"] == free["output_ids"][:first_hit]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": third}
    stop = engine.tokenizer.decode(free["output_ids"][1:3])
    by_text = generate(engine, {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 8,
                                                                     "stop": [stop]}})
    assert by_text["meta_info"]["finish_reason"]["type"] == "stop"
    assert stop in engine.tokenizer.decode(by_text["output_ids"])
    assert len(by_text["output_ids"]) <= 3


def test_bad_requests_are_refused(engine):
    with pytest.raises(BadRequest):
        generate(engine, {"text": "hello"})
    with pytest.raises(BadRequest):
        generate(engine, {"input_ids": [10**9]})


def test_load_weights_by_hf_name_including_tied(engine):
    state = engine.model.state_dict()
    name = "model.embed_tokens.weight"
    before = state[name].clone()
    try:
        engine.load_weights([(name, before + 1.0)])
        torch.testing.assert_close(engine.model.state_dict()[name], before + 1.0)
        if engine.model.config.tie_word_embeddings:
            torch.testing.assert_close(engine.model.get_output_embeddings().weight, before + 1.0)
        with pytest.raises(BadRequest, match="unknown"):
            engine.load_weights([("no.such.weight", before)])
        with pytest.raises(BadRequest, match="shape"):
            engine.load_weights([(name, before[:2])])
    finally:
        engine.load_weights([(name, before)])


def test_flattened_bucket_round_trip():
    tensors = [torch.randn(3, 4), torch.arange(5, dtype=torch.int64), torch.randn(2, dtype=torch.bfloat16)]
    bucket = flatten_bucket(tensors)
    assert bucket.dtype == torch.uint8 and bucket.numel() == 48 + 40 + 4
    back = unflatten_bucket(bucket, [t.dtype for t in tensors], [list(t.shape) for t in tensors])
    for a, b in zip(tensors, back):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="bytes"):
        unflatten_bucket(bucket, [torch.float32], [[3, 4]])


def test_one_rank_engine_reports_tp_size_1_and_its_checksums(engine):
    from rollout.engine_server import ROUTES

    info = ROUTES[("GET", "/get_server_info")](engine, {})
    assert info["tp_size"] == 1 and info["pp_size"] == 1 and info["model_path"] == engine.model_path
    answer = ROUTES[("POST", "/weights_checksum")](engine, {"names": ["lm_head.weight"], "per_rank": True})
    assert answer["rank_checksums"] == [engine.weight_checksums(["lm_head.weight"])]


def test_a_request_that_fails_inside_a_batch_fails_alone(engine, monkeypatch):
    """A request that fails in the batching worker (a stop that is no string: the HTTP
    schema refuses it, so it is built here past the schema) fails by itself, without its
    traceback; the request batched with it gets the tokens it gets alone."""
    p = prompts(engine)[1]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    alone = engine.generate([p], [greedy], ["alone"])[0]
    sizes = []
    real = engine._run_batch
    monkeypatch.setattr(engine, "_run_batch", lambda batch: sizes.append(len(batch)) or real(batch))
    engine.pause("in_place")
    try:
        engine.submit(p, greedy, "blocker")  # the worker takes it alone and waits for the resume
        for _ in range(1000):  # taken from the queue after the last batch ended, and running
            if engine.queue.empty() and engine.batch_running:
                break
            time.sleep(0.01)
        assert engine.batch_running and engine.queue.empty()
        good = engine.submit(p, greedy, "good")
        bad = engine.submit(p, SamplingParams(temperature=0.0, max_new_tokens=4, stop=(1,)), "bad")
    finally:
        engine.resume()
    assert good.done.wait(60) and bad.done.wait(60)
    assert sizes[:2] == [1, 2]  # good and bad were one batch, which failed; then each ran alone
    assert good.error is None and good.result.output_ids == alone.output_ids
    assert bad.result is None and "request bad failed inside the engine (TypeError)" in bad.error
    assert "Traceback" not in bad.error
    with pytest.raises(GenerationFailed, match="failed inside the engine"):
        engine.generate([p], [SamplingParams(max_new_tokens=2, stop=(1,))], ["bad-again"])


def test_any_64_bit_seed_samples(engine):
    """SGLang takes sampling_seed in [-2**63, 2**63 - 1]; the engine's per-token hash takes
    it modulo 2**64 (a negative seed failed the whole batch before)."""
    p = prompts(engine)[0]

    def tokens(seed):
        return engine.generate([p], [SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True,
                                                    sampling_seed=seed)], [f"s{seed}"])[0].output_ids

    assert tokens(-1) == tokens(2**64 - 1) != tokens(1)
    assert len(tokens(-(2**63))) == len(tokens(2**63 - 1)) == 8
