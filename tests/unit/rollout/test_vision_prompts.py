"""Vision-language prompts: image placeholders in the chat template, pad expansion, the
token budget over expanded ids, multimodal RoPE positions, image data URLs, and the
engine client's image payload and prompt-token check."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from transformers import AutoImageProcessor, AutoTokenizer

from rollout.engine_client import EngineClient, EngineError
from rollout.memory import StepRecord, WindowMemory
from rollout.prompts import PromptConfig, PromptTooLong, build_prompt
from rollout.vision import (
    ImageTokenMismatch,
    encode_image_data,
    expand_image_pads,
    is_vision_model,
    load_image_processor,
    mrope_positions,
)

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen2_5_vl")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def processor(model_dir):
    return load_image_processor(model_dir)


def image(seed: int, shape=(56, 56)) -> np.ndarray:
    out = np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)
    out.flags.writeable = False  # as the envs emit them
    return out


def memory_with(images: list, max_images: int = 2) -> WindowMemory:
    m = WindowMemory(3, max_images=max_images)
    for t, im in enumerate(images):
        m.store(StepRecord(t, f"room {t}", f"go {t}", 0.0, True, im))
    return m


def reference_expansion(tokenizer, images, engine_ids):
    """The expanded ids and image tensors as transformers' processor makes them."""
    from PIL import Image

    hf = AutoImageProcessor.from_pretrained(tokenizer.name_or_path)
    out = hf(images=[Image.fromarray(np.array(im)) for im in images], return_tensors="pt")
    counts = iter((out["image_grid_thw"].prod(-1) // hf.merge_size**2).tolist())
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return [t for i in engine_ids for t in ([pad] * next(counts) if i == pad else [i])], out


def test_the_image_processor_is_loaded_for_a_vlm_only(model_dir, tiny_model_dir, processor):
    assert is_vision_model(model_dir) and processor is not None
    assert not is_vision_model(tiny_model_dir("qwen3")) and load_image_processor(tiny_model_dir("qwen3")) is None


def test_images_go_before_their_observation_text_and_pads_expand(tokenizer, processor):
    past, older, now = image(1), image(2, (60, 120)), image(3, (64, 40))
    memory = memory_with([older, past])  # max_images=2: only the newest past image is kept
    prompt = build_prompt(tokenizer, "Push boxes.", "a hall", memory, 2, PromptConfig(max_images=2), image=now,
                          image_processor=processor)
    user = ("Your previous turns (oldest first):\n[Step 0]\nObservation:\nroom 0\nAction: go 0\n"
            f"[Step 1]\nObservation:\n{IMAGE}room 1\nAction: go 1\n"
            f"Current observation (step 2):\n{IMAGE}a hall\nWhat is your next action?")
    assert prompt.text == (f"<|im_start|>system\nPush boxes.<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert prompt.image_entries == [1, 2] and [im is past for im in prompt.images] == [True, False]
    assert prompt.engine_ids == tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    expanded, hf = reference_expansion(tokenizer, [past, now], prompt.engine_ids)
    assert prompt.ids == expanded and len(prompt.ids) > len(prompt.engine_ids)
    torch.testing.assert_close(prompt.pixel_values, hf["pixel_values"].float(), atol=0, rtol=0)
    assert prompt.image_grid_thw.tolist() == hf["image_grid_thw"].tolist()
    from PIL import Image

    decoded = [np.array(Image.open(io.BytesIO(base64.b64decode(d.split(",", 1)[1])))) for d in prompt.image_data]
    assert all(d.startswith("data:image/png;base64,") for d in prompt.image_data)
    assert [np.array_equal(d, im) for d, im in zip(decoded, [past, now])] == [True, True]


def test_text_prompts_are_unchanged(tokenizer, processor):
    memory = memory_with([None, None])
    config = PromptConfig(max_images=2)
    plain = build_prompt(tokenizer, "Push boxes.", "a hall", memory, 2, config)
    with_processor = build_prompt(tokenizer, "Push boxes.", "a hall", memory, 2, config, image_processor=processor)
    assert plain.text == with_processor.text and plain.ids == with_processor.ids == with_processor.engine_ids
    assert with_processor.pixel_values is None and with_processor.image_data == []
    # a text model's prompt for a visual env: images carried along, no placeholders
    no_vlm = build_prompt(tokenizer, "Push boxes.", "a hall", memory, 2, config, image=image(4))
    assert no_vlm.text == plain.text and len(no_vlm.images) == 1 and no_vlm.pixel_values is None


def test_the_budget_counts_expanded_ids(tokenizer, processor):
    memory = memory_with([image(1), image(2)])
    config = PromptConfig(max_images=2, max_prompt_tokens=4096)
    full = build_prompt(tokenizer, "", "a hall", memory, 2, config, image=image(3), image_processor=processor)
    assert full.history_entries == 2 and not full.truncated_history and len(full.images) == 2
    # a budget the one-pad ids fit but the expanded ids do not: the oldest entry goes
    tight = PromptConfig(max_images=2, max_prompt_tokens=len(full.engine_ids) + 1)
    assert len(full.ids) > tight.max_prompt_tokens
    cut = build_prompt(tokenizer, "", "a hall", memory, 2, tight, image=image(3), image_processor=processor)
    assert cut.truncated_history and cut.history_entries < 2 and len(cut.ids) <= tight.max_prompt_tokens
    assert len(cut.images) == len(cut.image_grid_thw) == 1 + (cut.history_entries == 1)
    with pytest.raises(PromptTooLong, match=r"1 image\(s\) included"):
        build_prompt(tokenizer, "", "a hall", memory, 2, PromptConfig(max_images=2, max_prompt_tokens=30),
                     image=image(3), image_processor=processor)


def test_pad_and_image_counts_must_agree():
    assert expand_image_pads([5, 9, 6, 9], 9, [2, 3]) == [5, 9, 9, 6, 9, 9, 9]
    with pytest.raises(ImageTokenMismatch, match=r"2 image pad token\(s\) \(id 9\) but 1 image"):
        expand_image_pads([5, 9, 6, 9], 9, [2])
    with pytest.raises(ImageTokenMismatch, match="beyond the 0 image"):
        mrope_positions([5, 9, 9, 9, 9], 9, None, 2)
    with pytest.raises(ImageTokenMismatch, match="needs 4 consecutive image tokens"):
        mrope_positions([5, 9, 9, 6], 9, torch.tensor([[1, 4, 4]]), 2)


def test_mrope_positions_by_hand():
    # text, a 2x3 merged image (grid 1x4x6, merge 2), text: after the image the next
    # position is the largest so far + 1 (1 + max(1, 2, 3)), not its length
    ids = [7, 8] + [9] * 6 + [10, 11]
    pos = mrope_positions(ids, 9, torch.tensor([[1, 4, 6]]), 2)
    assert pos.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
    ]


def test_image_data_is_a_deterministic_png_url():
    a, b = encode_image_data(image(1)), encode_image_data(np.array(image(1)))
    assert a == b and a.startswith("data:image/png;base64,")
    with pytest.raises(ValueError, match="HxWx3 uint8"):
        encode_image_data(np.zeros((4, 4), dtype=np.uint8))


class FakeServer:
    """Answers /generate with one token per prompt, reporting `prompt_tokens` as told."""

    def __init__(self, extra_tokens: int = 0):
        self.bodies, self.extra_tokens = [], extra_tokens

    def __call__(self, method, url, body, timeout_s=None, token=None):
        self.bodies.append(body)
        return 200, [{"text": "", "output_ids": [1], "meta_info": {
            "prompt_tokens": len(ids) + (self.extra_tokens if images else 0), "output_token_logprobs": [[-0.5, 1, None]],
            "finish_reason": {"type": "length"}}}
            for ids, images in zip(body["input_ids"], body.get("image_data") or [[]] * len(body["input_ids"]))]


def test_the_client_sends_image_data_per_request_and_checks_prompt_tokens():
    server = FakeServer()
    client = EngineClient(["http://e"], transport=server)
    client.generate([[1, 9, 2], [3, 4]], {"max_new_tokens": 1}, image_data=[["data:image/png;base64,AA"], None],
                    prompt_tokens=[3, None])
    assert server.bodies[0]["image_data"] == [["data:image/png;base64,AA"], []]
    client.generate([[3, 4]], {"max_new_tokens": 1})
    assert "image_data" not in server.bodies[1]
    wrong = EngineClient(["http://e"], transport=FakeServer(extra_tokens=2))
    with pytest.raises(EngineError, match="counted 5 prompt tokens.*are 3 tokens"):
        wrong.generate([[1, 9, 2]], {"max_new_tokens": 1}, image_data=[["data:image/png;base64,AA"]],
                       prompt_tokens=[3])
    with pytest.raises(EngineError, match="counted 5 prompt tokens"):
        wrong.submit([1, 9, 2], {"max_new_tokens": 1}, image_data=["data:image/png;base64,AA"],
                     prompt_tokens=3).result(timeout=30)
    for c in (client, wrong):
        c.close()
