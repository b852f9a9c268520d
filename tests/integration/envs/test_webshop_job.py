"""The CPU main job runs end to end on WebShop (the tiny model will not learn it; the
point is the pipeline): the byte-level BPE tiny tokenizer, since the word-level one
knows none of WebShop's words."""

from __future__ import annotations

import pytest

from tests.integration.envs.env_job import train_two_iterations


@pytest.mark.slow
def test_train_two_iterations_on_webshop(tmp_path):
    rows = train_two_iterations(tmp_path, "webshop", ["+env_config.max_steps=3", "loop.max_steps=3",
                                                      "loop.prompt.max_prompt_tokens=1900"])
    for row in rows:
        assert row["train/episode_length"] <= 3
        assert any(k.startswith("train/success_rate/") for k in row)  # per product category
    text = (tmp_path / "samples" / "iter_000001.txt").read_text()
    assert "=== episode" in text and "anchor: search" in text  # the page state (GiGPO's anchor) is logged
