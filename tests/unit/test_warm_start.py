"""The warm start: the tiny model imitates the maze's expert before RL."""

import json

import torch

from envs.maze import MazeConfig, MazeEnv
from megatron_agent.run_config import load_run_config
from megatron_agent.run_dir import prepare_run_dir


def expert_path_states(env: MazeEnv) -> set:
    """Every state on the expert's path from every start."""
    states = set()
    for start in env.starts:
        env.state, env.steps, env.done, done = (*start, False), 0, False, False
        while not done:
            states.add(env.state)
            _, _, done, _ = env.step(env.expert_action())
    return states


def greedy_agreement(model_dir, config) -> float:
    """The share of the states on the expert's paths where the model's greedy first token is
    the expert's move, the prompts built as the agent loop builds them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.memory import NoMemory
    from rollout.prompts import build_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    env = MazeEnv(MazeConfig())
    states = sorted(expert_path_states(env))
    agree = 0
    for state in states:
        env.state = state
        prompt = build_prompt(tokenizer, "", env._observation().text, NoMemory(), 0, config.loop.prompt)
        with torch.no_grad():
            token = model(input_ids=torch.tensor([prompt.ids])).logits[0, -1].argmax().item()
        agree += tokenizer.decode([token]).strip() == env.expert_action()
    return agree / len(states)


def test_the_noise_free_expert_is_imitated_and_the_run_says_how_it_went(tmp_path):
    config = load_run_config(["+experiment=maze", f"run_dir={tmp_path}", "tiny_model.warm_start.episodes=40",
                              "tiny_model.warm_start.noise=0", "tiny_model.warm_start.epochs=12"])
    prepare_run_dir(config)
    done = json.loads((tmp_path / "warm_start.json").read_text())
    assert done["expert_success"] == 1.0 and done["last_loss"] < done["first_loss"] / 4
    assert greedy_agreement(tmp_path / "model", config) > 0.9
    assert not (tmp_path / "model.warm-start").exists()
    # Without the warm start, the same seed's model names the expert's move by chance at most.
    untrained = load_run_config(["+experiment=maze", f"run_dir={tmp_path / 'cold'}",
                                 "tiny_model.warm_start.episodes=0"])
    prepare_run_dir(untrained)
    assert greedy_agreement(tmp_path / "cold" / "model", untrained) < 0.5
