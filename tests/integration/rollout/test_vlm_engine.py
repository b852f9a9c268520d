"""The embedded engine on tiny vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE),
against transformers' own model and processor: greedy logprobs of a batch mixing prompts
with 0, 1 and 2 images equal a teacher-forced forward of each prompt alone, prompt_tokens
counts the expanded ids, weight updates under the checkpoints' names, image_data errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout.embedded_engine import BadRequest, Engine
from rollout.engine_server import generate
from rollout.vision import encode_image_data
from rollout.weight_group import weight_checksum
from tests.vlm_batch import perturbed_checkpoint

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
IMAGE_SIZES = [(56, 56), (60, 120), (64, 40)]  # (height, width)
NEW_TOKENS = 5


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, tiny_model_dir):
    torch.set_num_threads(1)
    model_dir = tiny_model_dir(request.param)
    return model_dir, Engine(str(model_dir))


@pytest.fixture(scope="module")
def reference(vlm):
    """transformers' model, tokenizer and processor, loaded on their own."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model_dir, _ = vlm
    return (AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(model_dir), AutoImageProcessor.from_pretrained(model_dir))


def rows(tok, images_per_row=(1, 0, 2)):
    """(ids with one pad per image, the images as arrays) per row, rows of different lengths."""
    rng = np.random.default_rng(7)
    out, k = [], 0
    for row, n in enumerate(images_per_row):
        text = "what is in room " + " push" * (3 * row + 1)
        parts = [{"type": "image"}] * n + [{"type": "text", "text": text}]
        ids = tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=True, add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        images = [rng.integers(0, 256, (*IMAGE_SIZES[(k + i) % 3], 3), dtype=np.uint8) for i in range(n)]
        k += n
        out.append((list(ids), images))
    return out


def hf_inputs(tok, processor, ids, images):
    """The reference's expanded ids and image tensors (the processor's grid, pads repeated)."""
    from PIL import Image

    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    if not images:
        return ids, {}
    out = processor(images=[Image.fromarray(im) for im in images], return_tensors="pt")
    counts = iter((out["image_grid_thw"].prod(-1) // processor.merge_size**2).tolist())
    expanded = [t for i in ids for t in ([pad] * next(counts) if i == pad else [i])]
    return expanded, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def teacher_forced(reference, ids, images, output):
    model, tok, processor = reference
    expanded, extra = hf_inputs(tok, processor, ids, images)
    full = torch.tensor([expanded + output])
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=torch.ones_like(full), mm_token_type_ids=(full == pad).int(),
                       **extra).logits[0].float()
    lps = torch.log_softmax(logits[len(expanded) - 1:-1], -1)
    return len(expanded), lps.gather(1, torch.tensor(output)[:, None])[:, 0]


def run_batch(engine, batch):
    body = {"input_ids": [ids for ids, _ in batch], "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
            "image_data": [[encode_image_data(im) for im in images] for _, images in batch]}
    return generate(engine, body)


def assert_matches_reference(engine, reference, batch):
    outs = run_batch(engine, batch)
    for (ids, images), out in zip(batch, outs):
        lps = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert len(out["output_ids"]) == NEW_TOKENS
        expanded_len, expected = teacher_forced(reference, ids, images, out["output_ids"])
        assert out["meta_info"]["prompt_tokens"] == expanded_len
        torch.testing.assert_close(lps, expected, atol=1e-5, rtol=0)
    return outs


def test_batched_image_prompts_equal_hf_alone(vlm, reference):
    _, engine = vlm
    batch = rows(reference[1])
    outs = assert_matches_reference(engine, reference, batch)
    assert outs[2]["meta_info"]["prompt_tokens"] > len(batch[2][0]) + 2 * 3  # two images of >= 4 tokens each


def test_image_request_alone_equals_its_batched_self(vlm, reference):
    _, engine = vlm
    batch = rows(reference[1])
    together = run_batch(engine, batch)
    alone = run_batch(engine, batch[2:])
    assert alone[0]["output_ids"] == together[2]["output_ids"]
    torch.testing.assert_close(torch.tensor([lp for lp, _, _ in alone[0]["meta_info"]["output_token_logprobs"]]),
                               torch.tensor([lp for lp, _, _ in together[2]["meta_info"]["output_token_logprobs"]]),
                               atol=1e-5, rtol=0)


def test_weight_update_under_checkpoint_names(vlm, reference, tmp_path):
    from transformers import AutoModelForImageTextToText

    model_dir, engine = vlm
    changed = perturbed_checkpoint(model_dir, tmp_path / "perturbed")
    perturbed = AutoModelForImageTextToText.from_pretrained(tmp_path / "perturbed", dtype=torch.float32).eval()
    batch = rows(reference[1])
    before = run_batch(engine, batch)
    engine.begin_weight_update()
    try:
        engine.load_weights(list(changed.items()))
    finally:
        engine.end_weight_update()
    try:
        assert engine.weight_checksums(list(changed)) == {n: weight_checksum(t) for n, t in changed.items()}
        after = assert_matches_reference(engine, (perturbed, *reference[1:]), batch)
        assert [o["meta_info"]["output_token_logprobs"] for o in after] != \
            [o["meta_info"]["output_token_logprobs"] for o in before]
    finally:  # back to the original weights, from disk (the other load path)
        engine.begin_weight_update()
        engine.update_from_disk(str(model_dir))
        engine.end_weight_update()
    assert_matches_reference(engine, reference, batch)


def test_image_data_errors_name_the_problem(vlm, reference):
    _, engine = vlm
    (ids, images), (text_ids, _) = rows(reference[1], (1, 0))[:2]
    params = {"temperature": 0.0, "max_new_tokens": 2}
    data = encode_image_data(images[0])
    with pytest.raises(BadRequest, match="data:image"):
        generate(engine, {"input_ids": [ids], "sampling_params": params, "image_data": [["http://x/y.png"]]})
    with pytest.raises(BadRequest, match="not a readable base64 image"):
        generate(engine, {"input_ids": [ids], "sampling_params": params,
                          "image_data": [["data:image/png;base64,aGVsbG8="]]})
    with pytest.raises(BadRequest, match=r"1 image pad token\(s\).*2 image\(s\)"):
        generate(engine, {"input_ids": [ids], "sampling_params": params, "image_data": [[data, data]]})
    with pytest.raises(BadRequest, match="one entry per prompt"):
        generate(engine, {"input_ids": [ids, text_ids], "sampling_params": params, "image_data": [[data]]})
    with pytest.raises(BadRequest, match=r"beyond the 0 image\(s\) given"):  # a pad sent without its image
        generate(engine, {"input_ids": [ids], "sampling_params": params})


def test_image_data_to_a_text_model_is_refused(tiny_model_dir):
    engine = Engine(str(tiny_model_dir("qwen3")))
    with pytest.raises(BadRequest, match="text model"):
        generate(engine, {"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 1},
                          "image_data": [[encode_image_data(np.zeros((28, 28, 3), dtype=np.uint8))]]})


def in_process(engine):
    """EngineClient's transport, served by `engine` in this process (/generate only)."""
    def transport(method, url, body, timeout_s=None, token=None):
        assert url.endswith("/generate"), url
        try:
            return 200, generate(engine, body)
        except BadRequest as err:
            return 400, str(err)
    return transport


@pytest.mark.parametrize("mode", ["async", "lockstep"])
def test_rollout_samples_carry_images_and_match_hf(mode, tiny_model_dir):
    """Sokoban rendered as images, two images a prompt (the newest history entry's and the
    current one), four requests a call: each sample's expanded prompt ids and images give
    the engine's logprobs under transformers' model."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from envs import EnvManager
    from rollout.agent_loop import AgentLoopConfig, run_rollout
    from rollout.engine_client import EngineClient
    from rollout.prompts import PromptConfig
    from rollout.sampling import SamplingConfig
    from rollout.vision import load_image_processor

    torch.set_num_threads(1)
    model_dir = tiny_model_dir("qwen3_vl")
    tok = AutoTokenizer.from_pretrained(model_dir)
    client = EngineClient(["http://in-process"], transport=in_process(Engine(str(model_dir))), requests_per_call=4)
    config = AgentLoopConfig(max_steps=3, mode=mode,
                             sampling=SamplingConfig(temperature=1.0, max_new_tokens=4, seed=5),
                             prompt=PromptConfig(history_length=2, max_images=2, max_prompt_tokens=4096))
    with EnvManager("sokoban", {"render_image": True}, num_groups=2, group_size=2, backend="inline") as envs:
        result = run_rollout(envs, client, tok, config, [11, 12], image_processor=load_image_processor(model_dir))
    client.close()
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert {len(s.images) for s in result.samples} == {1, 2}
    for s in result.samples:
        assert s.image_grid_thw.shape == (len(s.images), 3)
        assert s.pixel_values.shape[0] == int(s.image_grid_thw.prod(-1).sum())
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        assert int((ids == pad).sum()) == int(s.image_grid_thw.prod(-1).sum()) // 4
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=(ids == pad).int(), pixel_values=s.pixel_values,
                           image_grid_thw=s.image_grid_thw).logits[0, len(s.prompt_ids) - 1:-1]
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), expected, atol=1e-5, rtol=0)
