"""The CPU main job against a minimal loop on the same task, measured in the same run.

    .venv/bin/python bench/minimal_loop.py [--seed 0] [--iterations 60]    # ~1.5 min on 2 idle cores
    .venv/bin/python bench/minimal_loop.py --quick    # 2 iterations of 2 groups x 2: the script end to end

The minimal loop is what a person would write in one file: one process, the main job's
tiny HF model and tokenizer, the same prompt (the chat template over the observation),
NumberLine 0..5 with the dense reward, 16 groups x 8 episodes, 3 sampled tokens with a
KV cache, a GRPO update (group-normalised episode return, entropy bonus 0.05, Adam 1e-3,
clipping 1.0), no engine, no HTTP, no Megatron. The product is `megatron_agent.driver.train`
with the main job's settings and `algorithm=grpo` (the same estimator), validation,
checkpoints and sample files off so both do the same work per iteration.

Both run a fixed number of iterations (no early stop). Per-iteration time depends on the
episode lengths, which shrink as the policy learns, so the ratio is given per iteration
and per sample (one env step of one episode). Ends with the line
`minimal_loop: product P s/it, minimal M s/it: R x per iteration, S x per sample`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def minimal_loop(model_dir: Path, iterations: int, seed: int, groups: int = 16, group_size: int = 8) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from envs import EnvManager

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    env_config = {"action_format": "bare", "render_image": False, "max_position": 5, "max_steps": 10}
    envs = EnvManager("numberline", env_config, num_groups=groups, group_size=group_size, backend="inline")
    encoded: dict[str, list[int]] = {}

    def encode(text: str) -> list[int]:
        if text not in encoded:
            encoded[text] = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                          add_generation_prompt=True, tokenize=True)
            if not isinstance(encoded[text], list):  # transformers 5 returns a BatchEncoding
                encoded[text] = list(encoded[text]["input_ids"])
        return encoded[text]

    rows = []
    for iteration in range(iterations):
        t0 = time.perf_counter()
        observations = envs.reset([seed * 100_000 + iteration * groups + g for g in range(groups)])
        active = [not d for d in envs.dones]
        episodes: list[list[tuple[list[int], list[int], float]]] = [[] for _ in active]
        won = [False] * len(active)
        gen_s = 0.0
        for _ in range(10):
            live = [i for i, a in enumerate(active) if a]
            if not live:
                break
            t = time.perf_counter()
            prompts = [encode(observations[i].text) for i in live]
            responses = sample(model, prompts, max_new_tokens=3, pad_id=tokenizer.pad_token_id)
            gen_s += time.perf_counter() - t
            texts = [None] * len(active)
            for i, r in zip(live, responses):
                texts[i] = tokenizer.decode(r, skip_special_tokens=True)
            observations, rewards, dones, infos = envs.step(texts)
            for i, p, r in zip(live, prompts, responses):
                episodes[i].append((p, r, float(rewards[i])))
                if dones[i]:
                    active[i] = False
                    won[i] = bool(infos[i].get("won"))
        t = time.perf_counter()
        returns = torch.tensor([sum(x[2] for x in e) for e in episodes]).view(groups, group_size)
        advantages = ((returns - returns.mean(1, keepdim=True)) / (returns.std(1, keepdim=True) + 1e-6)).flatten()
        grpo_update(model, optimizer, episodes, advantages, tokenizer.pad_token_id)
        update_s = time.perf_counter() - t
        rows.append({"iteration": iteration, "seconds": time.perf_counter() - t0, "generate_s": gen_s,
                     "update_s": update_s, "samples": sum(len(e) for e in episodes),
                     "success": sum(won) / len(won)})
    envs.close()
    return rows


@torch.no_grad()
def sample(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> list[list[int]]:
    """Temperature-1 sampling with a KV cache, prompts left-padded into one batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    out, past = [], None
    position = (mask.cumsum(1) - 1).clamp(min=0)
    step_ids = ids
    for _ in range(max_new_tokens):
        logits = model(input_ids=step_ids, attention_mask=mask, position_ids=position, past_key_values=past,
                       use_cache=True)
        past = logits.past_key_values
        token = torch.multinomial(torch.softmax(logits.logits[:, -1].float(), -1), 1)
        out.append(token)
        step_ids = token
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        position = position[:, -1:] + 1
    return torch.cat(out, 1).tolist()


def grpo_update(model, optimizer, episodes, advantages, pad_id: int) -> None:
    """One full-batch policy-gradient step over every (episode, step) sample."""
    seqs, starts, advs = [], [], []
    for e, a in zip(episodes, advantages.tolist()):
        for prompt, response, _ in e:
            seqs.append(prompt + response)
            starts.append(len(prompt))
            advs.append(a)
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    positions = torch.arange(width)[None, :]
    lengths = torch.tensor([len(s) for s in seqs])[:, None]
    starts_t = torch.tensor(starts)[:, None]
    logits = model(input_ids=ids, attention_mask=(positions < lengths).long()).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1)
    token_logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    target_pos = positions[:, 1:]
    response_mask = ((target_pos >= starts_t) & (target_pos < lengths)).float()
    n = response_mask.sum()
    adv = torch.tensor(advs)[:, None]
    loss = -((adv * token_logp + 0.05 * entropy) * response_mask).sum() / n
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def product_loop(run_dir: Path, iterations: int, seed: int, groups: int = 16, group_size: int = 8) -> list[dict]:
    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    config = load_run_config([f"run_dir={run_dir}", f"seed={seed}", f"iterations={iterations}",
                              f"num_groups={groups}", f"group_size={group_size}",
                              "stop_success=null", "algorithm=grpo", "val_every=0", "save_every=0",
                              "samples_every=0"])
    return train(config)


def summary(name: str, seconds: list[float], samples: list[float], skip: int) -> tuple[float, float]:
    per_it = statistics.mean(seconds[skip:])
    per_sample = sum(seconds[skip:]) / sum(samples[skip:])
    print(f"{name:>8}: {per_it:.3f} s/iteration, {per_sample * 1e3:.2f} ms/sample over iterations {skip}.."
          f"{len(seconds) - 1}")
    return per_it, per_sample


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--skip", type=int, default=3, help="warm-up iterations left out of the means")
    parser.add_argument("--quick", action="store_true",
                        help="2 iterations of 2 groups x 2, none skipped: the script end to end, measures nothing")
    args = parser.parse_args()
    groups, group_size = (2, 2) if args.quick else (16, 8)
    if args.quick:
        args.iterations, args.skip = 2, 0
    print(f"minimal_loop: the minimal loop, then the product, {args.iterations} iterations of {groups} groups x "
          f"{group_size} each; at the defaults (60 iterations of 16 x 8) about 1.5 minutes on 2 idle cores "
          f"(docs/cpu_job.md)", flush=True)

    from megatron_agent.models.tiny import write_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-minimal-loop-"))
    model_dir = write_tiny_model("qwen3", tmp / "model", preset="tiny", num_hidden_layers=2, tokenizer="words",
                                 seed=args.seed)
    minimal = minimal_loop(model_dir, args.iterations, args.seed, groups, group_size)
    print(f"minimal loop done: {sum(r['seconds'] for r in minimal):.1f} s; now the product", flush=True)
    product = product_loop(tmp / "run", args.iterations, args.seed, groups, group_size)

    m_it, m_sample = summary("minimal", [r["seconds"] for r in minimal], [r["samples"] for r in minimal], args.skip)
    p_it, p_sample = summary("product", [r["time/iteration"] for r in product],
                             [r["train/num_samples"] for r in product], args.skip)
    skip = args.skip
    phases = sorted(k for k in product[0] if k.startswith("time/") and k not in ("time/iteration", "time/elapsed"))
    print("product phases, s/iteration: " + ", ".join(
        f"{k[5:]} {statistics.mean(r.get(k, 0.0) for r in product[skip:]):.3f}" for k in phases))
    print(f"minimal phases, s/iteration: generate {statistics.mean(r['generate_s'] for r in minimal[skip:]):.3f}, "
          f"update {statistics.mean(r['update_s'] for r in minimal[skip:]):.3f}")
    print(f"success over the last 10 iterations: minimal {statistics.mean(r['success'] for r in minimal[-10:]):.2f}, "
          f"product {statistics.mean(r['train/success_rate'] for r in product[-10:]):.2f}")
    print(f"minimal_loop: product {p_it:.3f} s/it, minimal {m_it:.3f} s/it: {p_it / m_it:.2f} x per iteration, "
          f"{p_sample / m_sample:.2f} x per sample")


if __name__ == "__main__":
    main()
