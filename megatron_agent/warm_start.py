"""A short supervised warm start of the tiny model: imitate noisy expert trajectories.

The paper's runs start RL from instruction-tuned models, which already act sensibly some
of the time, so a group holds winning and losing trajectories that pass through the same
states. A tiny model made on the spot acts at random; `tiny_model.warm_start` makes it
partly competent first. The env's `expert_action()` (a shortest-path move, for the maze)
is taken with probability 1 - noise, a uniformly random action otherwise; every step of
`episodes` such episodes becomes a (prompt, action) pair, the prompt built exactly as the
agent loop builds it (rollout/prompts.py, the run's memory and prompt settings), and the
model is trained on the action's tokens and the end of turn. It imitates the noise too:
the result succeeds about as often as the noisy expert does (docs/cpu_job.md).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class WarmStartConfig:
    episodes: int = 0  # noisy expert episodes to imitate before RL (0: no warm start)
    noise: float = 0.5  # the chance of a uniformly random action instead of the expert's
    epochs: int = 3
    lr: float = 3.0e-3
    batch_size: int = 64

    def validate(self) -> None:
        if self.episodes < 0 or self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"episodes >= 0, epochs >= 1, batch_size >= 1 and lr > 0 are needed; got {self}")
        if not 0.0 <= self.noise <= 1.0:
            raise ValueError(f"noise={self.noise} must be in [0, 1]")


@dataclass
class WarmStartResult:
    steps: int  # (prompt, action) pairs imitated
    expert_success: float  # the noisy expert's success rate over the episodes
    first_loss: float  # mean action loss of the first epoch
    last_loss: float  # of the last
    seconds: float


def expert_pairs(run, tokenizer, episodes: int, noise: float, seed: int) -> tuple[list[tuple[list[int], list[int]]], float]:
    """(prompt ids, action ids + end of turn) for every step of `episodes` noisy expert
    episodes, and the share of them that were won."""
    from envs.registry import env_instructions, make_env
    from rollout.memory import StepRecord, memory_factory
    from rollout.prompts import build_prompt

    env = make_env(run.env, dict(run.env_config))
    instructions = env_instructions(run.env, env.config)
    prompt_config = run.loop.prompt
    make_memory = memory_factory(prompt_config.memory, prompt_config.history_length, 0)
    rng = np.random.default_rng([seed, 0x5741524D])  # apart from every other stream of the run
    action_ids = functools.cache(lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
                                 + [tokenizer.eos_token_id])  # a few distinct actions, thousands of steps
    pairs, wins = [], 0
    for _ in range(episodes):
        obs, memory, info = env.reset(int(rng.integers(1 << 30))), make_memory(), {}
        for step in range(run.loop.max_steps):
            prompt = build_prompt(tokenizer, instructions, obs.text, memory, step, prompt_config)
            action = env.actions[rng.integers(len(env.actions))] if rng.random() < noise else env.expert_action()
            pairs.append((prompt.ids, action_ids(action)))
            new_obs, reward, done, info = env.step(action)
            memory.store(StepRecord(step, obs.text, action, float(reward), bool(info.get("is_action_valid", True))))
            obs = new_obs
            if done:
                break
        wins += bool(info.get("won"))
    return pairs, wins / max(episodes, 1)


def action_loss(model, batch: list[tuple[list[int], list[int]]], pad_id: int) -> torch.Tensor:
    """Mean cross-entropy of the action tokens given their prompts (right-padded batch)."""
    length = max(len(p) + len(a) for p, a in batch)
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    for row, (prompt, action) in enumerate(batch):
        n = len(prompt) + len(action)
        ids[row, :n] = torch.tensor(prompt + action)
        labels[row, len(prompt):n] = torch.tensor(action)
        mask[row, :n] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)


def warm_start(run, model_dir: str | Path) -> WarmStartResult:
    """Train the HF model in `model_dir` on noisy expert pairs, in place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config, started = run.tiny_model.warm_start, time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs, expert_success = expert_pairs(run, tokenizer, config.episodes, config.noise, run.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    shuffle = np.random.default_rng([run.seed, 0x5348])
    losses = []
    with torch.random.fork_rng():
        torch.manual_seed(run.seed)
        for _ in range(config.epochs):
            order, epoch = shuffle.permutation(len(pairs)), []
            for start in range(0, len(pairs), config.batch_size):
                loss = action_loss(model, [pairs[i] for i in order[start:start + config.batch_size]],
                                   tokenizer.pad_token_id)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                epoch.append(loss.item())
            losses.append(float(np.mean(epoch)))
    model.save_pretrained(model_dir)
    return WarmStartResult(len(pairs), expert_success, losses[0], losses[-1], time.perf_counter() - started)
