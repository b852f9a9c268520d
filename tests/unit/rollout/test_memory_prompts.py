"""History modules and per-step prompt building (budget cutting, chat template)."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from envs import EnvManager, make_env
from rollout.agent_loop import AgentLoopConfig, run_rollout
from rollout.engine_client import GenerateOutput
from rollout.memory import NoMemory, StepRecord, SummaryMemory, WindowMemory, memory_factory
from rollout.prompts import PromptConfig, PromptTooLong, build_messages, build_prompt, encode_messages
from rollout.sampling import SamplingConfig


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


# -- images (VLM tasks) -------------------------------------------------------------


def image(t: int) -> np.ndarray:
    return np.full((4, 4, 3), t, dtype=np.uint8)


def image_record(t: int) -> StepRecord:
    return StepRecord(t, f"obs {t}", "<action>up</action>", 0.0, True, image(t))


def test_memories_keep_only_the_images_max_images_allows():
    one = WindowMemory(3)  # max_images=1: the current observation's image only
    three = WindowMemory(3, max_images=3)  # the current one and the 2 newest steps'
    summary = SummaryMemory(2, max_images=2)
    for t in range(5):
        for m in (one, three, summary):
            m.store(image_record(t))
    assert one.render_images() == [None, None, None] and all(s.image is None for s in one.steps)
    kept = three.render_images()
    assert kept[0] is None and [int(im[0, 0, 0]) for im in kept[1:]] == [3, 4]
    assert three.steps[0].image is None  # the pixels that left the window are not held
    assert [int(im[0, 0, 0]) for im in three.render_images(2)] == [3, 4]
    # one image per rendered entry, the digest's None first
    assert len(summary.render_images()) == len(summary.render()) == 3
    assert summary.render_images()[:2] == [None, None] and int(summary.render_images()[2][0, 0, 0]) == 4
    assert NoMemory().render_images() == [] and memory_factory("window", 2, 3)().past_images == 2
    with pytest.raises(ValueError, match="max_images"):
        memory_factory("window", 2, -1)


def test_prompt_carries_the_current_image_and_the_allowed_history_images(tokenizer):
    current = image(9)
    for max_images, expected, entries in ((1, [9], [2]), (2, [1, 9], [1, 2]), (3, [0, 1, 9], [0, 1, 2]),
                                          (0, [], [])):
        m = memory_factory("window", 2, max_images)()
        for t in range(2):
            m.store(image_record(t))
        p = build_prompt(tokenizer, "sys", "now", m, 2, PromptConfig(max_images=max_images), image=current)
        assert p.history_entries == 2
        assert [int(im[0, 0, 0]) for im in p.images] == expected and p.image_entries == entries
        assert not p.images or p.images[-1] is current  # shared, not copied
    text_only = build_prompt(tokenizer, "sys", "now", WindowMemory(2), 0, PromptConfig())
    assert text_only.images == [] and text_only.image_entries == []


def test_history_dropped_for_the_token_budget_drops_its_images(tokenizer):
    m = WindowMemory(3, max_images=4)
    for t in range(3):
        m.store(StepRecord(t, "position " * 20, "<action>up</action>", 0.0, True, image(t)))
    full = build_prompt(tokenizer, "sys", "now", m, 3, PromptConfig(max_images=4), image=image(9))
    assert [int(im[0, 0, 0]) for im in full.images] == [0, 1, 2, 9]
    _, ids = encode_messages(tokenizer, build_messages("sys", "now", m.render(1), 3, PromptConfig()))
    p = build_prompt(tokenizer, "sys", "now", m, 3, PromptConfig(max_images=4, max_prompt_tokens=len(ids)), image=image(9))
    assert p.history_entries == 1 and p.truncated_history
    assert [int(im[0, 0, 0]) for im in p.images] == [2, 9] and p.image_entries == [0, 1]


class PlusEngine:
    """Answers "+" to every request."""

    def __init__(self, tokenizer):
        self.ids = tokenizer.encode(" +", add_special_tokens=False)

    def generate(self, input_ids, sampling_params, *, rids=None, sticky_keys=None):
        return [GenerateOutput(list(self.ids), [-0.5] * len(self.ids), "stop", "+", "0", "scripted") for _ in input_ids]


@pytest.mark.parametrize("mode", ["lockstep", "async"])
def test_step_samples_carry_the_images_of_their_prompt(tokenizer, mode):
    config = AgentLoopConfig(max_steps=4, mode=mode, sampling=SamplingConfig(max_new_tokens=2),
                             prompt=PromptConfig(history_length=2, max_images=2))
    env_config = {"render_image": True, "image_size": 32, "action_format": "bare", "max_position": 5}
    with EnvManager("numberline", env_config, num_groups=2, group_size=1, backend="inline") as envs:
        result = run_rollout(envs, PlusEngine(tokenizer), tokenizer, config, seeds=[1, 4])
    replay = make_env("numberline", env_config)
    for traj, seed in zip(result.episodes, (1, 4)):
        assert traj
        frames = [replay.reset(seed).image] + [replay.step("+")[0].image for _ in traj[:-1]]
        for s in traj:
            shown = frames[max(0, s.step_index - 1):s.step_index + 1]  # the previous step's and the current
            assert len(s.images) == len(shown) and all(np.array_equal(a, b) for a, b in zip(s.images, shown))
            assert s.image_entries == ([s.history_entries - 1, s.history_entries] if s.step_index else [0])
            assert s.images[-1].dtype == np.uint8 and s.images[-1].shape == (32, 32, 3)
            assert s.observation.startswith("Target:")  # the text, kept for logs
