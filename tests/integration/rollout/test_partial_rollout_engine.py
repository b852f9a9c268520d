"""A response that weights change in the middle of (rollout/partial_rollout.py), on the embedded
engine's core with a tiny model: the answer is cut as a weight sync's abort cuts it, the
engine takes new weights, and the continuation finishes it. Checked against HF transformers
under each set of weights, and through the trainer's batch into the rollout correction."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from megatron_agent.algorithms.losses import rollout_correction_weights
from megatron_agent.worker_batches import batch_from_shards, compact_shard
from rollout.embedded_engine import Engine, SamplingParams
from rollout.engine_responses import GenerateOutput
from rollout.episodes import Request
from rollout.partial_rollout import finished_answer, token_versions
from rollout.samples import StepSample

CUT_AFTER, TOKENS = 3, 10


def teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def engine_and_two_models(model_dir: str, seed: int):
    """An engine on the model, the model in transformers, and the model perturbed (new weights)."""
    old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return Engine(model_dir), old, new


def test_a_response_across_a_weight_update_keeps_each_tokens_version_and_engine_logprob(tiny_model_dir):
    engine, old, new = engine_and_two_models(str(tiny_model_dir("qwen3")), seed=0)

    def submit(request: Request) -> Future:
        """The engine's answer; the first is cut after CUT_AFTER tokens as a weight sync's
        abort cuts it, and the engine then takes the new weights (as version "1")."""
        first = engine.weight_version == "default"
        params = SamplingParams(temperature=1.0, ignore_eos=True, sampling_seed=request.params["sampling_seed"],
                                max_new_tokens=CUT_AFTER if first else request.params["max_new_tokens"])
        req = engine.submit(request.ids, params, request.rid)
        req.done.wait()
        c = req.result
        out = GenerateOutput(c.output_ids, c.logprobs, "abort" if first else c.finish_reason["type"], c.text,
                             c.weight_version, "embedded")
        if first:
            engine.load_weights(list(new.state_dict().items()))
            engine.set_weight_version("1")
        done = Future()
        done.set_result(out)
        return done

    prompt = [5, 17, 42, 9]
    request = Request(prompt, {"max_new_tokens": TOKENS, "sampling_seed": 3}, "r0-step0", "r0")
    out = finished_answer(submit, request, "continue")

    response = out.output_ids
    assert len(response) == TOKENS and out.finish_reason == "length"
    assert token_versions(out) == ["default"] * CUT_AFTER + ["1"] * (TOKENS - CUT_AFTER)
    served = torch.tensor(out.logprobs)
    under_old, under_new = teacher_forced(old, prompt, response), teacher_forced(new, prompt, response)
    # each token's engine logprob is that of the weights that sampled it
    torch.testing.assert_close(served[:CUT_AFTER], under_old[:CUT_AFTER], atol=1e-4, rtol=0)
    torch.testing.assert_close(served[CUT_AFTER:], under_new[CUT_AFTER:], atol=1e-4, rtol=0)
    assert (under_old[:CUT_AFTER] - under_new[:CUT_AFTER]).abs().max() > 1e-2  # the weights did change

    # the trainer's batch carries them on the tokens' positions, and the rollout correction
    # (the trainer's policy = the new weights) weights each token by its own behaviour policy:
    # 1 where the new weights sampled it, pi_new / pi_old where the old ones did
    sample = StepSample(prompt_ids=prompt, response_ids=response, rollout_logprobs=list(out.logprobs), reward=0.0,
                        episode_return=0.0, group_id=0, traj_id=0, step_index=0, anchor=None, is_action_valid=True,
                        done=True, won=False, weight_version=out.weight_version, token_versions=token_versions(out))
    batch = batch_from_shards([compact_shard([sample])], np.array([0]), np.array([0]), 1, pad_id=0, temperature=1.0)
    on = batch.response_mask.bool()
    torch.testing.assert_close(batch.rollout_logprobs[on], served)
    trained = torch.zeros_like(batch.rollout_logprobs)
    trained[on] = under_new
    weights, _ = rollout_correction_weights(trained, batch.rollout_logprobs, batch.response_mask, tis_cap=100.0)
    expected = torch.cat([torch.exp(under_new[:CUT_AFTER] - under_old[:CUT_AFTER]),
                          torch.ones(TOKENS - CUT_AFTER)])
    torch.testing.assert_close(weights[on], expected, atol=1e-3, rtol=1e-3)
    assert not torch.allclose(weights[on][:CUT_AFTER], torch.ones(CUT_AFTER), atol=1e-2)


def test_a_response_held_in_place_across_a_weight_update_decodes_on_over_its_cache(tiny_model_dir):
    """weight_sync.pause_mode=in_place: the engine holds the request between two decode
    steps, takes new weights, and decodes on over the KV cache the old weights computed;
    each token reports the version it was sampled under, through the server's answer."""
    import threading

    from rollout.engine_responses import generate_outputs
    from rollout.engine_server import completion_json

    engine, old, new = engine_and_two_models(str(tiny_model_dir("qwen3")), seed=1)
    forwards, paused = [0], threading.Event()

    def pause_after_forward(module, args, output):  # the forward that gives token CUT_AFTER's logits
        forwards[0] += 1
        if forwards[0] == CUT_AFTER:
            engine.pause("in_place")
            paused.set()

    hook = engine.model.register_forward_hook(pause_after_forward)
    prompt = [5, 17, 42, 9]
    req = engine.submit(prompt, SamplingParams(temperature=1.0, ignore_eos=True, sampling_seed=3,
                                               max_new_tokens=TOKENS), "r0")
    assert paused.wait(60)
    hook.remove()
    engine.load_weights(list(new.state_dict().items()))
    engine.set_weight_version("1")
    engine.resume()
    assert req.done.wait(60)
    c = req.result
    out = c.output_ids
    assert len(out) == TOKENS and c.token_versions == ["default"] * CUT_AFTER + ["1"] * (TOKENS - CUT_AFTER)
    (answer, _), = generate_outputs(completion_json(c, return_logprob=True), 1, "embedded")
    assert answer.token_versions == c.token_versions and answer.weight_version == "1"

    served = torch.tensor(c.logprobs)
    torch.testing.assert_close(served[:CUT_AFTER], teacher_forced(old, prompt, out)[:CUT_AFTER], atol=1e-4, rtol=0)
    with torch.no_grad():  # the old weights' cache of the prompt and the tokens fed before the pause
        cache = old(torch.tensor([prompt + out[:CUT_AFTER - 1]]), use_cache=True).past_key_values
        logits = new(torch.tensor([out[CUT_AFTER - 1:-1]]), past_key_values=cache, use_cache=True).logits[0]
    over_kept_cache = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out[CUT_AFTER:])[:, None])[:, 0]
    torch.testing.assert_close(served[CUT_AFTER:], over_kept_cache, atol=1e-4, rtol=0)
    recomputed = teacher_forced(new, prompt, out)[CUT_AFTER:]  # what a recomputed cache would give
    assert (recomputed - over_kept_cache).abs().max() > 1e-3
