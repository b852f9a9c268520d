"""The visual CPU job (`+experiment=visual-quiz`): a tiny Qwen2.5-VL made on the spot,
VisualQuiz images through the prompts, the embedded engine, the step samples and the
Megatron actor. After every weight sync the engine's logprobs of what it sampled equal
the actor's recomputed ones (fp32 on both sides) within 1e-4, images included.

The same run's sample episodes make the episode page (`megatron-agent show`), opened in
headless Chromium: no console error, the steps shown, the iteration and environment
selectors working and every observation image loaded."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_agent.platform.launch import run_on_ranks

pytestmark = pytest.mark.multirank  # a spawned trainer rank plus an engine process


def _visual_iterations(run_dir: str) -> list[dict]:
    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    config = load_run_config(["+experiment=visual-quiz", f"run_dir={run_dir}", "num_groups=4", "group_size=4",
                              "iterations=3", "stop_success=null", "val_every=2", "loop.validation.num_episodes=4",
                              "samples_every=1"])
    return train(config)


@pytest.fixture(scope="module")
def visual_run(tmp_path_factory):
    """(the run directory, the metrics) of one 3-iteration visual job, shared by the tests here."""
    run_dir = tmp_path_factory.mktemp("visual-job")
    return run_dir, run_on_ranks(_visual_iterations, 1, str(run_dir), timeout_s=300)[0]


def test_visual_job_serves_and_trains_the_same_images(visual_run):
    tmp_path, history = visual_run
    assert [row["iteration"] for row in history] == [0, 1, 2]
    resolved = json.loads((tmp_path / "config.json").read_text())
    assert resolved["env"] == "visual_quiz" and resolved["tiny_model"]["family"] == "qwen2_5_vl"
    assert resolved["env_config"]["render_image"] is True and resolved["loop"]["prompt"]["max_images"] == 1
    model = json.loads((tmp_path / "model" / "config.json").read_text())
    assert model["model_type"] == "qwen2_5_vl" and "vision_config" in model
    for row in history:  # iterations 1 and 2 run on synced weights
        assert row["check/rollout_logprob_max_abs_diff"] <= 1e-4, row
        assert row["train/num_samples"] == 16 and row["train/response_length"] == 1.0
    assert "val/success_rate" in history[1]
    episodes = "".join(path.read_text() for path in (tmp_path / "samples").glob("*.txt"))
    assert "images: 56x56x3" in episodes  # the observation's image reached the step samples


def test_the_runs_episode_page_in_a_browser(visual_run, tmp_path):
    """The visual run's samples, its newest iteration joined by a hand-made text group (a
    second environment, a think/action response, invalid actions), as one page."""
    from playwright.sync_api import sync_playwright

    from megatron_agent.cli import main
    from megatron_agent.episode_page import episode_records
    from rollout.prompts import PromptConfig
    from tests.unit.test_episode_page import text_group

    shutil.copytree(visual_run[0] / "samples", tmp_path / "samples")
    newest = tmp_path / "samples" / "iter_000002.json"
    data = json.loads(newest.read_text())
    visual = len(data["episodes"])
    assert visual == 4 and all(e["env"] == "visual_quiz" for e in data["episodes"])  # a whole group of 4
    data["episodes"] += episode_records(text_group(), None, None, PromptConfig())
    newest.write_text(json.dumps(data))
    assert main(["show", str(tmp_path)]) == 0
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("no Chromium on this machine: `make chromium` installs Debian's")
    problems = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda err: problems.append(str(err)))
        page.goto((tmp_path / "episodes.html").as_uri())
        page.wait_for_load_state("load")

        def shown() -> list[list]:  # [iteration, env, steps on view] of each episode on view
            return page.eval_on_selector_all("section.episode", "s => s.filter(e => e.checkVisibility()).map(e => "
                                             "[e.dataset.iteration, e.dataset.env, "
                                             "[...e.querySelectorAll('.step')].filter(p => p.checkVisibility()).length])")

        def flags() -> int:  # the invalid-action flags on view
            return page.eval_on_selector_all(".flag", "f => f.filter(e => e.checkVisibility() && "
                                             "e.textContent === 'invalid action').length")

        assert page.input_value("#iteration") == "2"  # the newest first
        assert sorted(shown()) == sorted([["2", "visual_quiz", 1]] * visual + [["2", "numberline", 2]] * 2)
        assert page.text_content("#count") == f"{visual + 2} episodes"
        images = page.eval_on_selector_all("img", "i => i.map(e => [e.complete, e.naturalWidth, e.naturalHeight])")
        assert len(images) == 3 * visual and all(i == [True, 56, 56] for i in images)  # each step's 56x56 image
        invalid = sum(not s["valid"] for e in data["episodes"] for s in e["steps"])  # 2 of them hand-made
        assert flags() == invalid
        assert page.locator(".think").first.is_visible() and page.locator(".action").first.is_visible()
        page.select_option("#env", "numberline")
        assert shown() == [["2", "numberline", 2]] * 2 and flags() == 2
        page.select_option("#iteration", "0")
        assert shown() == [] and page.is_visible("#none")
        page.select_option("#env", "")
        assert shown() == [["0", "visual_quiz", 1]] * visual and not page.is_visible("#none")
        browser.close()
    assert problems == []
