"""The episode page's data and HTML (megatron_agent/episode_page.py), by hand: a text group
whose two copies share an anchor state, a think/action response and an invalid action; a
visual step whose current image (not the history's) becomes a data: URI; and the rollout
workers' side: the episodes shown are a whole group and carry the advantages the trainer
gets (the single-process estimator's over the whole batch)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from megatron_agent.algorithms import compute_advantages
from megatron_agent.cli import main
from megatron_agent.episode_page import episode_records, shared_steps, write_episode_page
from megatron_agent.models.tiny import build_tokenizer
from megatron_agent.rollout_worker import shown_copy
from megatron_agent.run_dir import write_sample_episodes
from megatron_agent.samples import step_columns
from rollout.prompts import PromptConfig
from rollout.samples import StepSample
from tests.unit.test_rollout_workers import _config, _workers

START, MOVED = "Target: 2\nCurrent: 1", "Target: 2\nCurrent: 2"
THINK_ACTION = "<think>1 < 2 & so up</think><action>+</action>"


def step(traj: int, index: int, anchor, response: str, *, reward=0.0, valid=True, action=None, won=False,
         history=0, group=0, env="numberline", prompt_ids=()) -> StepSample:
    return StepSample(prompt_ids=list(prompt_ids), response_ids=[1], rollout_logprobs=[-0.1], reward=reward,
                      episode_return=0.0, group_id=group, traj_id=traj, step_index=index, anchor=anchor,
                      is_action_valid=valid, done=won, won=won, env_seed=7, env_name=env, history_entries=history,
                      response_text=response, observation=anchor if isinstance(anchor, str) else "Which colour?",
                      info={"action": action} if action is not None else {})


def text_group(tokenizer=None) -> list[list[StepSample]]:
    """Two copies of one group. Copy 0 moves up and wins; copy 1 answers nothing valid twice
    and stays at the start: its steps 0 and 1 and copy 0's step 0 share the anchor START."""
    prompt = tokenizer("<|im_start|>user\nTarget: 2 & <b>\n<|im_end|>", add_special_tokens=False)["input_ids"] \
        if tokenizer is not None else ()
    first = [step(0, 0, START, THINK_ACTION, action="+", prompt_ids=prompt),
             step(0, 1, MOVED, "<think>there</think><action>+</action>", reward=1.0, action="+", won=True, history=1)]
    second = [step(1, 0, START, "<script>alert(1)</script>", valid=False, reward=-0.1),
              step(1, 1, START, "no idea", valid=False, reward=-0.1, history=1)]
    for traj in (first, second):
        for s in traj:
            s.episode_return = sum(t.reward for t in traj)
    return [first, second]


def test_records_mark_thought_action_invalid_steps_and_the_anchor_groups():
    tokenizer = build_tokenizer("bpe", vision=True)
    episodes = text_group(tokenizer)
    records = episode_records(episodes, [[0.5, 0.25], [-0.5, None]], tokenizer, PromptConfig(history_length=2))
    one, two = records
    assert (one["env"], one["group"], one["traj"], one["seed"], one["return"], one["won"]) == (
        "numberline", 0, 0, 7, 1.0, True)
    s0, s1 = one["steps"]
    assert s0["prompt"] == "<|im_start|>user\nTarget: 2 & <b>\n<|im_end|>"  # the ids decoded, as the model read them
    assert s0["thought"] == "1 < 2 & so up" and s0["action"] == "+" and s0["valid"]
    # the blocks' spans in the response: <think>...</think> is 0..28 (7 + 13 + 8 characters), <action>+</action> 28..46
    assert s0["marks"] == [[0, 28, "think"], [28, 46, "action"]]
    assert THINK_ACTION[28:46] == "<action>+</action>"
    assert s0["memory"] == [] and s1["memory"] == [f"[Step 0]\nObservation:\n{START}\nAction: {THINK_ACTION}"]
    assert (s0["advantage"], s1["advantage"], two["steps"][1]["advantage"]) == (0.5, 0.25, None)
    # GiGPO's step groups: START was seen by traj 0 step 0 and traj 1 steps 0 and 1; MOVED by one step only
    assert s0["anchor_group"] == [[1, 0], [1, 1]] and s1["anchor_group"] == []
    assert two["steps"][1]["anchor_group"] == [[0, 0], [1, 0]]
    assert not two["steps"][0]["valid"] and two["steps"][0]["action"] is None and two["steps"][0]["marks"] == []
    json.dumps(records)  # JSON-ready


def test_the_memory_window_is_the_history_the_prompts_held_truncated_ones_included():
    """Prompts built as the loop builds them (rollout.prompts.build_prompt over a window
    memory), the third one over max_prompt_tokens with both entries: its window is the one
    entry it kept, and every entry shown is in the decoded prompt."""
    from rollout.memory import StepRecord, memory_factory
    from rollout.prompts import build_prompt

    tokenizer = build_tokenizer("bpe")
    observations, responses = ["Current: 1", "Current: 2", "Current: 3"], ["<action>+</action>", "up", "+"]

    def play(config: PromptConfig) -> list[StepSample]:
        memory, steps = memory_factory(config.memory, config.history_length)(), []
        for k, (obs, text) in enumerate(zip(observations, responses)):
            prompt = build_prompt(tokenizer, "Move to 4.", obs, memory, k, config)
            steps.append(step(0, k, obs, text, history=prompt.history_entries, prompt_ids=prompt.ids))
            steps[-1].truncated_history = prompt.truncated_history
            memory.store(StepRecord(k, obs, text, 0.0, True))
        return steps

    whole = play(PromptConfig(history_length=2))
    budget = len(whole[2].prompt_ids) - 1  # the third prompt must drop its oldest entry
    steps = play(PromptConfig(history_length=2, max_prompt_tokens=budget))
    assert [s.history_entries for s in steps] == [0, 1, 1] and steps[2].truncated_history
    records = episode_records([steps], None, tokenizer, PromptConfig(history_length=2, max_prompt_tokens=budget))
    windows = [s["memory"] for s in records[0]["steps"]]
    assert windows == [[], ["[Step 0]\nObservation:\nCurrent: 1\nAction: <action>+</action>"],
                       ["[Step 1]\nObservation:\nCurrent: 2\nAction: up"]]
    for shown in records[0]["steps"]:
        assert all(entry in shown["prompt"] for entry in shown["memory"])
    assert "[Step 0]" not in records[0]["steps"][2]["prompt"]


def test_the_page_escapes_text_flags_invalid_actions_and_lists_the_shared_states(tmp_path):
    episodes = text_group()
    write_sample_episodes(tmp_path, 3, episodes, episode_records(episodes, [[0.5, 0.25], [-0.5, -0.75]], None,
                                                                 PromptConfig()))
    assert (tmp_path / "samples" / "iter_000003.txt").is_file()  # the text file stays
    page = write_episode_page(tmp_path).read_text()
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert '<span class="think">&lt;think&gt;1 &lt; 2 &amp; so up&lt;/think&gt;</span>' in page
    assert '<span class="action">&lt;action&gt;+&lt;/action&gt;</span>' in page
    assert page.count('class="step invalid"') == 2 and page.count('<span class="flag">invalid action</span>') == 2
    assert "anchor state shared with traj 1 steps 0-1<" in page
    assert "anchor state shared with traj 0 step 0; traj 1 step 0<" in page
    assert shared_steps([[3, 5], [1, 0], [3, 0], [3, 1], [3, 2]]) == "traj 1 step 0; traj 3 steps 0-2, 5"
    assert "advantage +0.5<" in page and "advantage -0.75<" in page and "reward -0.1<" in page
    assert "http://" not in page and "https://" not in page  # nothing to fetch: it opens offline


def test_a_visual_steps_current_image_becomes_a_data_uri_and_iterations_come_newest_first(tmp_path):
    from PIL import Image

    past, current = np.zeros((8, 8, 3), np.uint8), np.full((8, 8, 3), 200, np.uint8)
    current[2:5, 3:6] = (220, 40, 40)
    s = step(4, 1, current, "red", action="red", won=True, reward=1.0, env="visual_quiz", history=1)
    s.images, s.image_entries = [past, current], [0, 1]  # the history's image, then the current observation's
    shipped = shown_copy(s)  # what the worker sends to rank 0: the current image only
    assert shipped.images[1] is current and not hasattr(shipped.images[0], "dtype")
    assert shipped.images[0].shape == (8, 8, 3)
    for iteration in (0, 2, 1):
        write_sample_episodes(tmp_path, iteration, [[shipped]],
                              episode_records([[shipped]], None, None, PromptConfig()))
    data = json.loads((tmp_path / "samples" / "iter_000002.json").read_text())
    uri = data["episodes"][0]["steps"][0]["image"]
    assert uri.startswith("data:image/png;base64,")
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB"))
    assert np.array_equal(decoded, current)
    page = (tmp_path / "shown.html")
    assert write_episode_page(tmp_path, page, last=2) == page
    text = page.read_text()
    assert text.count(f'<img src="{uri}"') == 2  # the newest two iterations
    assert text.index('<option value="2">') < text.index('<option value="1">')
    assert '<option value="0">' not in text


def test_show_writes_the_page_and_a_run_without_samples_is_a_clear_error(tmp_path, capsys):
    assert main(["show", str(tmp_path)]) == 2
    assert "no sample episodes in" in capsys.readouterr().err
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "iter_000000.txt").write_text("an older run's text samples")
    assert main(["show", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"no sample episodes in {tmp_path / 'samples'}" in err and "samples_every=N" in err
    assert main(["show", str(tmp_path / "missing")]) == 2
    assert "no run directory" in capsys.readouterr().err
    episodes = text_group()
    write_sample_episodes(tmp_path, 0, episodes, episode_records(episodes, None, None, PromptConfig()))
    assert main(["show", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'episodes.html'}\n"


@pytest.mark.parametrize("estimator,workers,overrides", [
    ("gigpo", 2, ["seed=1", "algorithm.dynamic_sampling=false"]),  # seed 1: the first group has a signal
    ("reinforce_pp", 2, ["seed=1", "algorithm.dynamic_sampling=false"]),  # whitened with the batch's moments
    ("grpo", 1, ["seed=0"]),  # dynamic sampling drops the first group (an even seed): a kept one is shown
])
def test_the_workers_show_a_whole_group_with_the_advantages_the_trainer_gets(estimator, workers, overrides):
    config = _config(f"algorithm.advantage_estimator={estimator}", "num_groups=4", "group_size=3", *overrides)
    pool = _workers(config, workers)
    try:
        collected = pool.collect(0, ["unused"], keep_episodes=2)
        held = [h.samples(0) for h in pool.handles]
        batch = [held[k][r] for k, r in collected.sources]
        shown = pool.step_advantages(collected)
    finally:
        pool.close()
    groups = {s.group_id for e in collected.episodes for s in e}
    trajs = {s.traj_id for e in collected.episodes for s in e}
    assert len(groups) == 1 and len(collected.episodes) == config.group_size  # 2 asked, the whole group of 3
    assert trajs == {s.traj_id for s in batch if s.group_id in groups}
    expected = compute_advantages(step_columns(batch), config.algorithm).advantages  # one process, whole batch
    by_step = {(s.traj_id, s.step_index): a for s, a in zip(batch, expected)}
    assert [len(e) for e in shown] == [len(e) for e in collected.episodes]
    flat = [a for e in shown for a in e]
    assert flat == pytest.approx([by_step[(s.traj_id, s.step_index)] for e in collected.episodes for s in e])
    assert any(a != 0 for a in flat)  # a group with a learning signal


def test_an_async_iterations_shown_group_is_split_into_its_trajectories():
    from megatron_agent.run_config import load_run_config
    from tests.unit.test_rollout_stream import ASYNC, _worker

    config = load_run_config(ASYNC)
    worker = _worker(config)
    try:
        episodes = worker.take_groups(0, 0).episodes
    finally:
        worker.close()
    assert len(episodes) == config.group_size and len({e[0].group_id for e in episodes}) == 1
    assert all(len({s.traj_id for s in e}) == 1 and [s.step_index for s in e] == list(range(len(e)))
               for e in episodes)
