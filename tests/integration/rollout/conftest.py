"""The two tiny models the weight-update tests switch an engine between."""

from __future__ import annotations

import pytest

from megatron_agent.models.tiny import write_tiny_model


@pytest.fixture(scope="module")
def old_dir(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory):
    return write_tiny_model("qwen3", tmp_path_factory.mktemp("new") / "qwen3-seed1", seed=1)
