"""Tiny models made on the spot load in transformers, and the tokenizer is deterministic."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_agent.models.tiny import JOB_WORDS, TAG_TOKENS, VOCAB_WORDS, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_transformers_loads_every_family(tiny_model_dir, family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dir(family)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == family and config["vocab_size"] % 64 == 0
    assert config["vocab_size"] >= len(tok)
    ids = tok.apply_chat_template([{"role": "user", "content": "position 3 target 7 move"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config["vocab_size"]) and torch.isfinite(logits).all()
    assert model.config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")


def test_same_seed_same_weights(tmp_path):
    from safetensors.torch import load_file

    from megatron_agent.models.tiny import write_tiny_model

    a = load_file(write_tiny_model("qwen3", tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(write_tiny_model("qwen3", tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(write_tiny_model("qwen3", tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if k.endswith("proj.weight"))


def test_tokenizer_is_deterministic(tokenizer):
    assert build_tokenizer().get_vocab() == tokenizer.get_vocab()


def test_prompt_words_and_tags_are_single_tokens(tokenizer):
    for word in VOCAB_WORDS:
        assert len(tokenizer(word).input_ids) == 1, word
        assert len(tokenizer(" " + word).input_ids) == 1, word
    for tag in TAG_TOKENS:
        assert len(tokenizer(tag).input_ids) == 1, tag


def test_chat_template(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True, tokenize=False,
    )
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_text_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer(text).input_ids) == text


def test_no_embedding_row_is_zero(tiny_model_dir):
    # A zero row (transformers zeroes the pad token's) gives RMSNorm a ~1/sqrt(eps)
    # gradient in Megatron whenever that token appears in a response.
    from safetensors.torch import load_file

    embedding = load_file(tiny_model_dir("qwen3") / "model.safetensors")["model.embed_tokens.weight"]
    assert (embedding.abs().sum(-1) > 0).all()


def test_words_tokenizer_for_the_cpu_job():
    tok = build_tokenizer("words")
    assert len(tok) < 64  # a random policy must say "+" or "-" often enough
    text = tok.apply_chat_template([{"role": "user", "content": "Target: 3\nCurrent: 10"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.convert_ids_to_tokens(ids) == ["<|im_start|>", "user", "Target", ":", "3", "Current", ":", "10",
                                              "<|im_end|>", "<|im_start|>", "assistant"]
    assert tok.decode(tok("+ - 4").input_ids) == "+ - 4"
    assert tok.convert_ids_to_tokens(tok("banana").input_ids) == ["[UNK]"]
    with pytest.raises(ValueError, match="tokenizer kind='chars'"):
        build_tokenizer("chars")


def test_words_tokenizer_for_a_vlm_names_each_visual_quiz_choice_in_one_token(tiny_model_dir):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from envs.visual_quiz import VisualQuizConfig, VisualQuizEnv, choice_labels

    path = tiny_model_dir("qwen2_5_vl", tokenizer="words")
    tok, processor = AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)
    assert json.loads((path / "megatron_agent.json").read_text())["tokenizer"] == "words"
    assert len(tok) <= 64 and set(JOB_WORDS) <= set(tok.get_vocab())  # the text job's words too
    for kind in ("colour", "shape"):
        for labels in ("names", "digits"):
            for label in choice_labels(VisualQuizConfig(kind=kind, num_choices=6, labels=labels)):
                assert tok.convert_ids_to_tokens(tok(label).input_ids) == [label]
    env = VisualQuizEnv(VisualQuizConfig(image_size=56))
    observation = env.reset(0)
    grid = processor(images=[Image.fromarray(observation.image)], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]]  # 56 = 2 x 28: no resize, 4 merged image tokens
    content = [{"type": "image"}, {"type": "text", "text": observation.text}]
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    ids = [t for i in ids for t in ([image_id] * 4 if i == image_id else [i])]
    words = tok.convert_ids_to_tokens(ids)
    assert words[:4] == ["<|im_start|>", "user", "<|vision_start|>", "<|image_pad|>"]
    assert "colour" in words and "red" in words and "yellow" in words
    model = AutoModelForImageTextToText.from_pretrained(path)
    batch = processor(images=[Image.fromarray(observation.image)], return_tensors="pt")
    logits = model(input_ids=torch.tensor([ids]), pixel_values=batch["pixel_values"],
                   image_grid_thw=batch["image_grid_thw"]).logits
    assert logits.shape == (1, len(ids), 64) and torch.isfinite(logits).all()
