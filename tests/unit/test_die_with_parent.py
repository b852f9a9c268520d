"""`die_with_parent(parent_pid)`: a spawned child checks in seconds after it was started
(imports first); if its parent died meanwhile, PR_SET_PDEATHSIG would never fire, so it
dies at once instead of running on as an orphan (a trainer rank of a killed launcher)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

CHILD = """
import os, sys, time
from megatron_agent.platform.distributed import die_with_parent
die_with_parent(int(sys.argv[1]))
print("alive", flush=True)
time.sleep(600)
"""


def test_a_child_whose_parent_is_already_gone_dies():
    # The child's parent is this process: a pid that is not it stands for a parent that died
    # and left the child to init.
    gone = subprocess.run([sys.executable, "-c", CHILD, "1"], capture_output=True, text=True, timeout=120)
    assert gone.returncode == -signal.SIGKILL and "alive" not in gone.stdout, gone.stderr[-2000:]
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(os.getpid())], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "alive"  # its parent is there: it runs
    finally:
        child.kill()
        child.wait()
