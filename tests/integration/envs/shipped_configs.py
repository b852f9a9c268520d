"""One iteration of each named environment config, as shipped on the CPU default, one after
another in this one process (imports paid once; each run still starts its own engine and
env workers). Writes {env: {"rows": [...], "config": {...}} or {"error": traceback}} as JSON.

    python -m tests.integration.envs.shipped_configs sokoban,search out.json RUN_ROOT
"""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback
from pathlib import Path

# The fewest iterations and groups that run an iteration of GiGPO; nothing else overridden.
SMALLEST_RUN = ["iterations=1", "num_groups=1", "group_size=2", "stop_success=null", "val_every=0", "save_every=0",
                "samples_every=0"]


def run_each(envs: list[str], run_root: Path) -> dict:
    from megatron_agent.driver import train
    from megatron_agent.platform.parallel import destroy_model_parallel
    from megatron_agent.run_config import load_run_config

    results = {}
    for env in envs:
        try:
            config = load_run_config([f"env={env}", *SMALLEST_RUN, f"run_dir={run_root / env}"])
            results[env] = {"rows": train(config), "config": dataclasses.asdict(config)}
        except Exception:  # the next env still runs; the test of this one shows why it failed
            results[env] = {"error": traceback.format_exc()}
        finally:
            destroy_model_parallel()  # the next run creates Megatron's groups again
    return results


if __name__ == "__main__":
    names, out, root = sys.argv[1].split(","), Path(sys.argv[2]), Path(sys.argv[3])
    out.write_text(json.dumps(run_each(names, root), default=str))
