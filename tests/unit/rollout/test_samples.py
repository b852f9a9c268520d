"""The agent loop's parts: sampling seeds, episode metrics, the timeline.

(Collating step samples for the trainer: tests/unit/test_samples.py.)"""

from __future__ import annotations

import numpy as np

from rollout.agent_loop import Timeline, rollout_metrics, sampling_seed
from rollout.samples import StepSample


def sample(group: int, traj: int, step: int, reward: float, ret: float, *, won=False, valid=True, anchor="s"):
    return StepSample(prompt_ids=[1, 2, 3][: step + 1], response_ids=[7, 8], rollout_logprobs=[-0.5, -0.25],
                      reward=reward, episode_return=ret, group_id=group, traj_id=traj, step_index=step,
                      anchor=anchor, is_action_valid=valid, done=won, won=won, env_name="sokoban",
                      task_type="sokoban")


def test_sampling_seeds_depend_on_what_not_when():
    a = sampling_seed(0, 0, 5, 1, 3)
    assert a == sampling_seed(0, 0, 5, 1, 3)
    others = {sampling_seed(0, 0, 5, 2, 3), sampling_seed(0, 0, 5, 1, 4), sampling_seed(0, 1, 5, 1, 3),
              sampling_seed(1, 0, 5, 1, 3), sampling_seed(0, 0, 6, 1, 3)}
    assert a not in others and len(others) == 5
    assert 0 <= a < 2**62


def test_metrics_success_length_invalid_rate_per_type():
    trajs = [[sample(0, 0, 0, 0, 1), sample(0, 0, 1, 1, 1, won=True)], [sample(0, 1, 0, 0, 0, valid=False)],
             [sample(1, 2, 0, 0, 0)]]
    m = rollout_metrics(trajs, [False, False, True])
    assert m["rollout/num_episodes"] == 2 and m["rollout/failed_episodes"] == 1
    assert m["rollout/success_rate"] == 0.5 and m["rollout/success_rate/sokoban"] == 0.5
    assert m["rollout/episode_length"] == 1.5
    assert np.isclose(m["rollout/invalid_action_rate"], 1 / 3)


def test_timeline_union_counts_overlaps_once():
    t = Timeline()
    t.record("generate", 0.0, 2.0)
    t.record("env", 1.0, 3.0)
    t.record("env", 5.0, 6.0)
    assert t.busy(["generate", "env"]) == 4.0
    assert t.total("env") == 3.0
