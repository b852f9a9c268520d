"""Episodes to look at: a run's sample episodes as records, and as one static HTML page.

    records = episode_records(episodes, advantages, tokenizer, prompt_config)   # on rank 0
    write_sample_episodes(run_dir, iteration, episodes, records)  # run_dir.py: samples/iter_N.json
    write_episode_page(run_dir)                  # `megatron-agent show RUN_DIR`: run_dir/episodes.html

The episodes are those of samples/iter_N.txt: the first whole group(s) of the iteration's
rollout (rollout_worker.whole_groups), so each step's anchor-state group is complete. Per
step a record holds what the model saw and did: the observation (its image as a PNG data
URL for a visual env), the memory window (the history entries of the prompt, from the
loop's own memory played over the episode's earlier steps), the prompt (its token ids
decoded: what the model read, unknown tokens included), the response with its `<think>`
and `<action>` blocks (envs.projection's rules) and the action the env parsed from it (its
own projection, at the step), validity, reward, the advantage the trainer used (None: not
trained on, e.g. a failed episode), and the other steps of the group that shared its anchor
state (GiGPO's step groups: algorithms.gigpo.anchor_state_codes).

The page is plain HTML with inline CSS and a few lines of inline JS (no server, no network:
it opens offline): newest iteration first, a selector for the iteration and one for the
environment, each episode a block of its steps. Every text is escaped.
"""

from __future__ import annotations

import html
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

SAMPLES_JSON = re.compile(r"iter_(\d+)\.json$")


class NoSamples(FileNotFoundError):
    """A run directory without samples/iter_N.json."""


# --- records (rank 0, when samples are due) ----------------------------------------------


def episode_records(episodes: Sequence[Sequence], advantages: Sequence[Sequence[float | None]] | None,
                    tokenizer, prompt_config, similarity_threshold: float | None = None) -> list[dict]:
    """The episodes (lists of rollout.samples.StepSample, a group's trajectories whole) as
    JSON-ready records. `advantages`: one per step, as the trainer used it (None: none);
    `tokenizer`: the model's, to decode the prompts (None: no prompt text); `prompt_config`:
    the loop's (rollout.prompts.PromptConfig), whose memory rebuilds each step's window;
    `similarity_threshold`: GiGPO's (algorithm.similarity_threshold) for the anchor groups."""
    from envs.projection import single_block
    from rollout.memory import StepRecord, memory_factory

    shared = anchor_groups(episodes, similarity_threshold)
    records = []
    for e, steps in enumerate(episodes):
        if not steps:
            continue
        memory = memory_factory(prompt_config.memory, prompt_config.history_length, 0)()
        rows = []
        for k, s in enumerate(steps):
            window = memory.render(s.history_entries)  # what the prompt held: its newest entries
            memory.store(StepRecord(s.step_index, s.observation, s.response_text, float(s.reward),
                                    s.is_action_valid))
            blocks = {tag: single_block(s.response_text, tag) for tag in ("think", "action")}
            marks = [[b[0], b[1], tag] for tag, b in blocks.items() if b is not None]
            action = s.info.get("action")
            advantage = advantages[e][k] if advantages is not None else None
            rows.append({
                "step": s.step_index,
                "observation": s.observation or (s.anchor if isinstance(s.anchor, str) else ""),
                "image": current_image(s),
                "memory": window,
                "truncated_history": s.truncated_history,
                "prompt": decoded_prompt(tokenizer, s.prompt_ids) if tokenizer is not None else None,
                "response": s.response_text,
                "marks": sorted(marks),
                "thought": blocks["think"][2] if blocks["think"] is not None else None,
                "action": None if action is None else str(action),
                "valid": bool(s.is_action_valid),
                "finish_reason": s.finish_reason,
                "reward": float(s.reward),
                "advantage": None if advantage is None else float(advantage),
                "anchor_group": shared[(s.traj_id, s.step_index)],
            })
        first = steps[0]
        records.append({"env": first.env_name, "task_type": first.task_type, "group": first.group_id,
                        "traj": first.traj_id, "seed": first.env_seed, "return": float(first.episode_return),
                        "won": bool(steps[-1].won), "steps": rows})
    return records


def anchor_groups(episodes: Sequence[Sequence], similarity_threshold: float | None = None) -> dict:
    """(traj, step) -> the other [traj, step] of the episodes' group that shared its anchor
    state, as GiGPO groups them (within an episode group; text anchors by similarity when a
    threshold is set)."""
    import numpy as np

    from megatron_agent.algorithms.gigpo import anchor_state_codes
    from megatron_agent.algorithms.segments import factorize

    steps = [s for e in episodes for s in e]
    if not steps:
        return {}
    group_codes, _ = factorize(np.array([s.group_id for s in steps], dtype=np.int64))
    codes, _ = anchor_state_codes([s.anchor for s in steps], group_codes, similarity_threshold)
    members: dict[int, list] = {}
    for s, code in zip(steps, codes.tolist()):
        members.setdefault(code, []).append([s.traj_id, s.step_index])
    return {(s.traj_id, s.step_index): [m for m in members[code] if m != [s.traj_id, s.step_index]]
            for s, code in zip(steps, codes.tolist())}


def current_image(sample) -> str | None:
    """The current observation's image (the prompt's image whose entry is `history_entries`:
    rollout/samples.py) as a PNG data URL; None for a text step."""
    from rollout.vision import encode_image_data

    for image, entry in zip(sample.images, sample.image_entries):
        if entry == sample.history_entries and hasattr(image, "dtype"):
            return encode_image_data(image)
    return None


def decoded_prompt(tokenizer, ids: Sequence[int]) -> str:
    """The prompt as the model read it: its ids decoded, special tokens kept, each run of
    image pads (a vision model's image tokens) shown once with its length."""
    from rollout.vision import IMAGE_PAD

    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    pad = re.escape(IMAGE_PAD)
    return re.sub(f"{pad}(?:\\s*{pad})*", lambda m: f"{IMAGE_PAD}x{m.group().count(IMAGE_PAD)}", text)


def sample_files(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(iteration, path) of the run's samples/iter_N.json, newest first."""
    found = [(int(m.group(1)), p) for p in (Path(run_dir) / "samples").glob("iter_*.json")
             if (m := SAMPLES_JSON.search(p.name))]
    return sorted(found, reverse=True)


# --- the page --------------------------------------------------------------------------------

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f4f4f2;color:#222}
header{position:sticky;top:0;background:#fff;border-bottom:1px solid #ccc;padding:8px 16px;z-index:1}
header h1{font-size:16px;margin:0 0 6px}
header label{margin-right:16px}
main{padding:8px 16px}
section.episode{background:#fff;border:1px solid #ccc;border-radius:4px;margin:10px 0;padding:8px 12px}
section.episode h2{font-size:15px;margin:2px 0 8px}
.won{color:#17692b}.lost{color:#8a1c1c}
.step{border-top:1px solid #e2e2e2;padding:6px 0;display:flex;gap:12px}
.step.invalid{background:#fff3f3}
.step img{image-rendering:pixelated;width:112px;height:auto;align-self:flex-start;border:1px solid #bbb;flex:none}
.body{flex:1;min-width:0}
.meta span{margin-right:14px}
.flag{color:#fff;background:#c62828;border-radius:3px;padding:0 5px;font-weight:bold}
pre{white-space:pre-wrap;word-break:break-word;margin:4px 0;padding:4px 6px;background:#f7f7f7;border-radius:3px}
pre.memory{background:#eef3fa}
pre.response{background:#fffbe6}
.think{color:#5b5b5b;font-style:italic;background:#ececec}
.action{color:#0b4f9c;font-weight:bold;background:#dcebff}
.anchor{color:#555}
.empty{color:#777;font-style:italic}
"""

SCRIPT = """
function show() {
  var it = document.getElementById("iteration").value, env = document.getElementById("env").value, n = 0;
  document.querySelectorAll("section.episode").forEach(function (s) {
    var on = s.dataset.iteration === it && (env === "" || s.dataset.env === env);
    s.hidden = !on;
    if (on) n += 1;
  });
  document.getElementById("count").textContent = n + (n === 1 ? " episode" : " episodes");
  document.getElementById("none").hidden = n > 0;
}
document.getElementById("iteration").addEventListener("change", show);
document.getElementById("env").addEventListener("change", show);
show();
"""


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _number(x: float) -> str:
    return f"{x:g}"


def response_html(text: str, marks: Sequence) -> str:
    """The response with its marked spans ([start, end, "think" | "action"]) in their classes."""
    out, at = [], 0
    for start, end, tag in sorted(marks):
        if start < at:  # overlapping marks (never from single_block's blocks): the later one unmarked
            continue
        out.append(_e(text[at:start]))
        out.append(f'<span class="{_e(tag)}">{_e(text[start:end])}</span>')
        at = end
    out.append(_e(text[at:]))
    return "".join(out)


def shared_steps(pairs: Sequence) -> str:
    """[[traj, step], ...] -> "traj 1 step 0; traj 3 steps 0-2, 5" (each trajectory's steps as runs)."""
    by_traj: dict[int, list[int]] = {}
    for traj, step in pairs:
        by_traj.setdefault(traj, []).append(step)
    out = []
    for traj, steps in sorted(by_traj.items()):
        runs: list[list[int]] = []
        for k in sorted(steps):
            if runs and k == runs[-1][1] + 1:
                runs[-1][1] = k
            else:
                runs.append([k, k])
        listed = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
        out.append(f"traj {traj} step{'s' if len(steps) > 1 else ''} {listed}")
    return "; ".join(out)


def step_html(step: dict) -> str:
    parts = [f'<div class="step{"" if step["valid"] else " invalid"}" data-step="{_e(step["step"])}">']
    image = step.get("image")
    if image and image.startswith("data:image/"):
        parts.append(f'<img src="{_e(image)}" alt="observation of step {_e(step["step"])}">')
    parts.append('<div class="body"><div class="meta">')
    parts.append(f'<span><b>step {_e(step["step"])}</b></span>')
    parts.append(f'<span>reward {_e(_number(step["reward"]))}</span>')
    advantage = step.get("advantage")
    parts.append(f'<span>advantage {_e(f"{advantage:+.4g}")}</span>' if advantage is not None
                 else '<span class="empty">advantage: none (not trained on)</span>')
    if not step["valid"]:
        parts.append('<span class="flag">invalid action</span>')
    if step.get("finish_reason") == "length":
        parts.append('<span class="empty">response cut at max_new_tokens</span>')
    parts.append("</div>")
    parts.append(f'<div>observation</div><pre class="observation">{_e(step["observation"])}</pre>')
    memory = step.get("memory") or []
    cut = " (truncated to fit the prompt budget)" if step.get("truncated_history") else ""
    if memory:
        parts.append(f"<div>memory window: {len(memory)} entr{'y' if len(memory) == 1 else 'ies'}{_e(cut)}</div>")
        parts.append(f'<pre class="memory">{_e(chr(10).join(memory))}</pre>')
    else:
        parts.append(f'<div class="empty">memory window: empty{_e(cut)}</div>')
    if step.get("prompt") is not None:
        parts.append(f'<details><summary>prompt as the model read it ({len(step["prompt"])} characters)</summary>'
                     f'<pre class="prompt">{_e(step["prompt"])}</pre></details>')
    response = (response_html(step["response"], step["marks"]) if step["response"]
                else '<span class="empty">(empty)</span>')
    parts.append(f'<div>response</div><pre class="response">{response}</pre>')
    action = step.get("action")
    parts.append(f'<div>action: <span class="action">{_e(action)}</span></div>' if action is not None
                 else '<div>action: <span class="empty">none parsed</span></div>')
    shared = step.get("anchor_group") or []
    if shared:
        parts.append(f'<div class="anchor">anchor state shared with {_e(shared_steps(shared))}</div>')
    else:
        parts.append('<div class="anchor empty">anchor state: no other step of the group shared it</div>')
    parts.append("</div></div>")
    return "".join(parts)


def episode_html(iteration: int, episode: dict) -> str:
    outcome = '<span class="won">won</span>' if episode["won"] else '<span class="lost">not won</span>'
    steps = episode["steps"]
    head = (f'{_e(episode["env"])} &middot; group {_e(episode["group"])} &middot; traj {_e(episode["traj"])} '
            f'&middot; seed {_e(episode["seed"])}: return {_e(_number(episode["return"]))}, {outcome}, '
            f'{len(steps)} step{"" if len(steps) == 1 else "s"}')
    return (f'<section class="episode" data-iteration="{_e(iteration)}" data-env="{_e(episode["env"])}">'
            f"<h2>{head}</h2>{''.join(step_html(s) for s in steps)}</section>")


def page_html(title: str, iterations: Sequence[tuple[int, list[dict]]]) -> str:
    """The page of `iterations` ((iteration, episode records), newest first)."""
    envs = sorted({e["env"] for _, episodes in iterations for e in episodes})
    iteration_options = "".join(f'<option value="{_e(i)}">{_e(i)} ({len(episodes)} episodes)</option>'
                                for i, episodes in iterations)
    env_options = '<option value="">all</option>' + "".join(f'<option value="{_e(v)}">{_e(v)}</option>'
                                                           for v in envs)
    body = "".join(episode_html(i, e) for i, episodes in iterations for e in episodes)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{STYLE}</style></head><body><header><h1>{_e(title)}</h1>"
            f'<label>iteration <select id="iteration">{iteration_options}</select></label>'
            f'<label>environment <select id="env">{env_options}</select></label><span id="count"></span></header>'
            f'<main><p id="none" class="empty" hidden>no episode of this environment at this iteration</p>'
            f"{body}</main><script>{SCRIPT}</script></body></html>")


def write_episode_page(run_dir: str | Path, out: str | Path | None = None, last: int | None = None) -> Path:
    """run_dir/episodes.html (or `out`) from the run's samples/iter_N.json: its newest `last`
    iterations (None: all). NoSamples when the run has none."""
    run_dir = Path(run_dir)
    files = sample_files(run_dir)
    if not files:
        where = run_dir / "samples"
        raise NoSamples(f"no sample episodes in {where} (samples/iter_N.json): train with samples_every=N "
                        f"(N > 0) to write them every N iterations" if run_dir.is_dir()
                        else f"no run directory {run_dir}")
    iterations = [(i, json.loads(p.read_text())["episodes"]) for i, p in files[:last]]
    out = Path(out) if out is not None else run_dir / "episodes.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(page_html(f"Episodes of {run_dir.resolve().name}", iterations), encoding="utf-8")
    os.replace(tmp, out)
    return out
