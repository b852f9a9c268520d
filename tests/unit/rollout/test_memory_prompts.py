"""History modules and per-step prompt building (budget cutting, chat template)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rollout.memory import NoMemory, StepRecord, SummaryMemory, WindowMemory, memory_factory
from rollout.prompts import PromptConfig, PromptTooLong, build_messages, build_prompt, encode_messages


def record(t: int, valid: bool = True, action: str | None = None) -> StepRecord:
    return StepRecord(t, f"obs {t}", action or f"<action>up</action> {t}", -0.1, valid)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))


def test_window_memory_keeps_the_last_k_and_drops_oldest_first():
    m = WindowMemory(3)
    assert m.render() == []
    for t in range(5):
        m.store(record(t))
    entries = m.render()
    assert [e.splitlines()[0] for e in entries] == ["[Step 2]", "[Step 3]", "[Step 4]"]
    assert m.render(2) == entries[1:]
    assert m.render(0) == []
    assert m.render(10) == entries


def test_window_of_zero_and_no_memory_keep_nothing():
    for m in (WindowMemory(0), NoMemory(), memory_factory("none", 3)()):
        m.store(record(0))
        assert m.render() == []


def test_summary_memory_digest_covers_what_fell_out_of_the_window():
    m = SummaryMemory(2)
    for t in range(2):
        m.store(record(t))
    assert all(not e.startswith("[Summary]") for e in m.render())  # the window shows all
    m.store(record(2, valid=False, action="garbage"))
    m.store(record(3))
    m.store(record(4, action="<think>x</think><action>left</action>"))
    entries = m.render()
    assert len(entries) == 3 and entries[0].startswith("[Summary]")
    assert "5 steps so far, 1 invalid, total reward -0.50" in entries[0]
    assert entries[0].endswith("Actions: up x2, (invalid), up, left")
    assert m.render(2) == entries[1:]  # the digest is the oldest entry, dropped first


def test_summary_memory_run_length_encodes_repeated_actions():
    m = SummaryMemory(1)
    for t in range(4):
        m.store(StepRecord(t, "o", "<action>down</action>", 0.0, True))
    assert "Actions: down x4" in m.render()[0]


def test_unknown_memory_kind_is_rejected():
    with pytest.raises(ValueError, match="memory"):
        memory_factory("vector-db", 2)


def test_prompt_layout_and_chat_template(tokenizer):
    config = PromptConfig(history_length=2)
    m = WindowMemory(2)
    for t in range(3):
        m.store(record(t))
    p = build_prompt(tokenizer, "You are an agent.", "the current room", m, 3, config)
    assert not p.truncated_history and p.history_entries == 2
    assert p.text.startswith("<|im_start|>system\nYou are an agent.<|im_end|>\n<|im_start|>user\n")
    assert p.text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    user = p.text.split("<|im_start|>user\n")[1]
    assert user.index("[Step 1]") < user.index("[Step 2]") < user.index("Current observation (step 3):")
    assert "[Step 0]" not in user and "the current room" in user
    assert p.ids == tokenizer(p.text, add_special_tokens=False)["input_ids"]


def test_over_budget_prompts_drop_oldest_history_and_are_flagged(tokenizer):
    m = WindowMemory(4)
    for t in range(4):
        m.store(record(t, action="<action>left</action> " + "position " * 20))
    full = build_prompt(tokenizer, "sys", "now", m, 4, PromptConfig(max_prompt_tokens=10_000))
    assert full.history_entries == 4
    for keep in range(4):
        text, ids = encode_messages(tokenizer, build_messages("sys", "now", m.render(keep), 4, PromptConfig()))
        p = build_prompt(tokenizer, "sys", "now", m, 4, PromptConfig(max_prompt_tokens=len(ids)))
        # the longest prompt that fits, made of whole entries, tokenized as a whole
        assert p.history_entries == keep and p.truncated_history
        assert p.ids == ids and p.text == text
        assert f"[Step {4 - keep}]" in p.text if keep else "[Step" not in p.text
        assert f"[Step {3 - keep}]" not in p.text


def test_prompt_too_long_without_history_raises(tokenizer):
    with pytest.raises(PromptTooLong, match="max_prompt_tokens=5"):
        build_prompt(tokenizer, "a long system prompt " * 5, "obs", WindowMemory(2), 0, PromptConfig(max_prompt_tokens=5))


def test_bare_prompt_without_instructions_or_headers():
    config = PromptConfig(memory="none", include_instructions=False, observation_header="", action_footer="")
    assert build_messages("rules", "Target: 3\nCurrent: 1", [], 0, config) == [
        {"role": "user", "content": "Target: 3\nCurrent: 1"}
    ]


def test_encoded_prompts_are_cached_but_equal_to_a_fresh_encoding(tokenizer):
    for observation in ("Target: 1\nCurrent: 2", "Target: 2\nCurrent: 2", "Target: 1\nCurrent: 2"):
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": observation}]
        text, ids = encode_messages(tokenizer, messages)
        fresh_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == fresh_text
        assert ids == tokenizer(fresh_text, add_special_tokens=False)["input_ids"]
        ids.append(-1)  # a caller's list: changing it must not reach the cache
    assert encode_messages(tokenizer, messages)[1][-1] != -1
