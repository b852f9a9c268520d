"""Prompt ids assembled from cached pieces (rollout/prompts.py) are exactly the ids of the
whole prompt text, step after step of real episodes with a sliding history."""

from __future__ import annotations

import logging

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from envs import make_env
from megatron_agent.models.tiny import CHAT_TEMPLATE, build_tokenizer
from rollout.memory import StepRecord, memory_factory
from rollout.prompts import PromptConfig, build_messages, build_prompt, piece_cache

# What a policy might answer: tagged, bare, several lines, blank lines, leading and
# trailing whitespace, non-Latin text, nothing at all.
ANSWERS = ["<think>the box is left</think><action>left</action>", "+", "-",
           "<think>plan:\n1. push up\n2. go right</think>\n<action>up</action>\n", "  <action>down</action>",
           "<action>right</action>   ", "", "déjà vu 日本 😀\n\nAction: +", "\n-", "<action>up</action> \n"]


# Qwen2's pre-tokenizer pattern (its tokenizer.json): unlike GPT-2's, a run of whitespace
# ending in newlines is one piece, so "\n\n" is one token with the merge below.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.fixture(scope="module")
def tokenizers():
    return {"words": build_tokenizer("words"), "bpe": build_tokenizer("bpe"),
            "qwen2-like": byte_level_tokenizer([("Ċ", "Ċ"), ("Ġ", "Ġ"), (".", "Ċ"), ("Ġ", "Ċ")], QWEN2_PATTERN)}


def fresh_cache(tokenizer, checks: int = 0):
    """The tokenizer's piece cache, emptied; `checks` = 0: ids come from the pieces alone."""
    cache = piece_cache(tokenizer)
    cache.ids.clear()
    cache.cached_tokens = cache.tokenized_tokens = 0
    cache.checks_left = checks
    return cache


def episode_prompts(tokenizer, env_name: str, memory: str, config: PromptConfig, steps: int = 9, seed: int = 3):
    """The prompts of one episode (answers from ANSWERS), each with its messages."""
    env = make_env(env_name, {})
    instructions = type(env).instructions_for(env.config) if hasattr(type(env), "instructions_for") else ""
    history = memory_factory(memory, config.history_length)()
    obs = env.reset(seed)
    out = []
    for step in range(steps):
        prompt = build_prompt(tokenizer, instructions, obs.text, history, step, config)
        out.append((prompt, build_messages(instructions, obs.text, history.render(prompt.history_entries), step,
                                           config)))
        answer = ANSWERS[step % len(ANSWERS)]
        new, reward, done, info = env.step(answer)
        history.store(StepRecord(step, obs.text, answer, reward, bool(info.get("is_action_valid", True))))
        obs = env.reset(seed + 1) if done else new
    return out


@pytest.mark.parametrize("kind", ["words", "bpe", "qwen2-like"])
@pytest.mark.parametrize("env_name,memory,k", [("numberline", "window", 2), ("sokoban", "window", 3),
                                               ("sokoban", "summary", 2), ("numberline", "none", 0)])
def test_piece_ids_equal_the_whole_text_ids_at_every_step(tokenizers, kind, env_name, memory, k):
    tokenizer = tokenizers[kind]
    cache = fresh_cache(tokenizer)
    assert cache.cuts == "loose", cache.reason  # both tiny tokenizers tokenize the sides of a newline apart
    prompts = episode_prompts(tokenizer, env_name, memory, PromptConfig(memory=memory, history_length=k))
    for prompt, messages in prompts:
        # the text is today's (the template applied to the messages), its ids those of the whole text
        assert prompt.text == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert prompt.ids == tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    assert cache.checks_left == 0 and cache.cuts == "loose"  # no prompt fell back to a whole-text tokenization
    if memory == "window":  # each history entry and observation tokenized once: far fewer than all prompt tokens
        assert cache.tokenized_tokens < sum(len(p.ids) for p, _ in prompts) / 2


def test_an_over_budget_prompt_rebuilt_from_pieces_equals_its_whole_text(tokenizers):
    tokenizer = tokenizers["bpe"]
    fresh_cache(tokenizer)
    full = episode_prompts(tokenizer, "sokoban", "window", PromptConfig(history_length=4), steps=6)[-1][0]
    fresh_cache(tokenizer)
    cut = episode_prompts(tokenizer, "sokoban", "window",
                          PromptConfig(history_length=4, max_prompt_tokens=len(full.ids) - 1), steps=6)[-1][0]
    assert cut.truncated_history and cut.history_entries < full.history_entries
    assert cut.ids == tokenizer(cut.text, add_special_tokens=False)["input_ids"]


def byte_level_tokenizer(merges: list[tuple[str, str]], pattern: str | None = "gpt2") -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with only `merges`, pre-tokenized by GPT-2's pattern,
    another `pattern`, or none (None: merges may then join the two sides of a newline)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pattern == "gpt2")
    tok.pre_tokenizer = byte_level if pattern in ("gpt2", None) else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def test_a_tokenizer_that_joins_space_and_newline_is_cut_only_after_text():
    """GPT-2's pre-tokenizer makes " \\n" at the end of a text one piece, but " " and "\\n"
    two before a word: with a merge for it, a line ending in a space must not be cut."""
    tokenizer = byte_level_tokenizer([("Ġ", "Ċ")])
    cache = fresh_cache(tokenizer)
    assert cache.cuts == "tight" and "\\n" in cache.reason
    prompts = episode_prompts(tokenizer, "numberline", "window", PromptConfig(history_length=3))
    for prompt, _ in prompts:
        assert prompt.ids == tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    cache.cuts = "loose"  # the rule the probe refused: the answer ending in " \n" is tokenized otherwise
    fresh_cache(tokenizer)
    loose = episode_prompts(tokenizer, "numberline", "window", PromptConfig(history_length=3))
    assert any(p.ids != tokenizer(p.text, add_special_tokens=False)["input_ids"] for p, _ in loose)
    cache.cuts = "tight"


def test_a_tokenizer_that_merges_across_newlines_tokenizes_prompts_whole(caplog):
    tokenizer = byte_level_tokenizer([("Ċ", "T")], pattern=None)  # "\nT" is one token
    with caplog.at_level(logging.WARNING, logger="rollout.prompts"):
        cache = fresh_cache(tokenizer)
    assert cache.cuts == "none" and "across the newline" in caplog.text
    for prompt, _ in episode_prompts(tokenizer, "numberline", "window", PromptConfig(history_length=2)):
        assert prompt.ids == tokenizer(prompt.text, add_special_tokens=False)["input_ids"]


def test_a_prompt_whose_pieces_differ_from_its_text_turns_pieces_off(caplog):
    """A merge across the newline that no probe line shows ("\\n" and the first byte of
    "Ω") is caught on the first prompts, which are also tokenized whole: those ids are
    used, and whole texts after."""
    tokenizer = byte_level_tokenizer([("Ċ", "Î")], pattern=None)
    cache = fresh_cache(tokenizer, checks=4)
    assert cache.cuts == "loose"
    config = PromptConfig(history_length=2, observation_header="Ωmega {step}:")
    with caplog.at_level(logging.WARNING, logger="rollout.prompts"):
        prompts = episode_prompts(tokenizer, "numberline", "window", config, steps=3)
    assert cache.cuts == "none" and "other ids than the whole text" in caplog.text
    for prompt, _ in prompts:
        assert prompt.ids == tokenizer(prompt.text, add_special_tokens=False)["input_ids"]


def test_a_new_piece_made_of_lines_already_seen(tokenizers):
    """The third observation is new, but each of its lines was tokenized before."""
    tokenizer = tokenizers["bpe"]
    cache = fresh_cache(tokenizer)
    for observation in ("Target: 4\nCurrent: 5", "Target: 3\nCurrent: 6", "Target: 4\nCurrent: 6"):
        before = cache.tokenized_tokens
        prompt = build_prompt(tokenizer, "Reach the target.", observation, memory_factory("none", 0)(), 1,
                              PromptConfig())
        assert prompt.ids == tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    assert cache.tokenized_tokens == before  # nothing left to tokenize


def test_an_added_token_that_takes_the_newline_before_it_turns_pieces_off():
    """An added token with lstrip (RoBERTa's <mask>) eats the newline before it in the whole
    text, not in a piece of its own; the probe tries it even after many other added tokens."""
    tokenizer = byte_level_tokenizer([])
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(20)])
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<mask>", lstrip=True)]})
    cache = fresh_cache(tokenizer)
    assert cache.cuts == "none" and "<mask>" in cache.reason
