"""Actor -> embedded engines of several weight-update ranks (`--ranks 2`) through the
project's WeightSync: the trainer counts each server's ranks (`/get_server_info`
`tp_size`) and gives each its rank offset, every rank receives every bucket, and the
engines' logprobs equal the actor's within 1e-4 afterwards (the checksums of every rank
checked too: /weights_checksum answers 500 when an engine's ranks disagree)."""

from __future__ import annotations

import pytest

from megatron_agent.platform.launch import run_on_ranks
from rollout.engine_launch import launch_engines, stop_engines
from tests.integration.weight_sync.test_weight_sync import _sync_and_compare

pytestmark = pytest.mark.multirank

# ranks of each engine: one 2-rank engine (both ranks serve the two prompts), and a
# 2-rank with a 1-rank engine (world 1 + 2 + 1, offsets 1 and 3: a trainer that counts
# one rank per server, or the same count for all, gets a 400).
CASES = [(2,), (2, 1)]


@pytest.mark.parametrize("ranks", CASES, ids=["one-2-rank-engine", "2-rank-and-1-rank-engines"])
def test_engines_of_several_ranks_match_the_actor_after_sync(tiny_model_dir, tmp_path, ranks):
    model_dir = str(tiny_model_dir("qwen3"))
    engines = []
    try:
        for i, n in enumerate(ranks):
            engines += launch_engines(model_dir, 1, ranks=n, log_dir=tmp_path / f"engine-{i}")
        out = run_on_ranks(_sync_and_compare, 1, model_dir, [e.url for e in engines], {}, timeout_s=300,
                           threads_per_rank=1)[0]
    finally:
        stop_engines(engines)
    assert out["versions"] == {"1"}
    assert out["metrics"]["weight_sync/buckets"] > 1 and out["metrics"]["weight_sync/bytes"] > 0
    assert out["max_diff"] < 1e-4, out
    assert out["stale_error"] and "differ from the rollout engine's" in out["stale_error"]
