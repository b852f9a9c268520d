"""Step samples: one per (trajectory, step), the unit the trainer learns from (the trainer
collates them: megatron_agent/samples.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepSample:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # one per response token, under the sampling distribution
    reward: float  # this step's env reward
    episode_return: float  # sum of the trajectory's step rewards
    group_id: int  # the task group (copies reset with the same seed)
    traj_id: int  # unique per trajectory in the rollout
    step_index: int  # 0-based
    anchor: Any  # the raw env state before the action (GiGPO's anchor)
    is_action_valid: bool
    done: bool  # the episode ended at this step
    won: bool  # the episode was won at this step
    env_seed: int = 0
    env_name: str = ""
    task_type: str = ""  # per-env-type success (e.g. ALFWorld task type); env_name when none
    truncated_history: bool = False  # history entries were dropped to fit the prompt budget
    history_entries: int = 0
    finish_reason: str = ""  # "stop" | "length" | "abort"
    response_text: str = ""
    weight_version: str = ""  # the engine's weights when the answer ended
    # One weight version per response token when the answer spans a weight update (a
    # partial rollout: rollout/partial_rollout.py); empty: every token's is weight_version.
    token_versions: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    # The prompt's images in text order (HxWx3 uint8 arrays; rollout.prompts.Prompt.images)
    # and the history entry each belongs to (`history_entries`: the current observation).
    images: list[Any] = field(default_factory=list)
    image_entries: list[int] = field(default_factory=list)
    observation: str = ""  # the env's text observation the action answered (for logs)
    # A vision-language model's processed images of the prompt (rollout.prompts.Prompt):
    # float32 [patches, dim] and long [images, 3] torch tensors; None for a text prompt.
    # `prompt_ids` are then the expanded ids (each image pad repeated its token count).
    pixel_values: Any = None
    image_grid_thw: Any = None
    # MoE routing replay: the engine's expert ids of every token it fed, the prompt's and
    # the response's but its last: [prompt + response - 1, layers, k] uint8 or int16 numpy.
    routed_experts: Any = None
