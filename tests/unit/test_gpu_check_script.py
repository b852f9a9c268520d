"""bench/gpu_check.sh names tests that exist, and says plainly when there is no GPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def checks() -> dict[str, str]:
    return dict(re.findall(r'^\s+"(\w+)=([^"]+)"$', SCRIPT.read_text(), flags=re.M))


def test_every_check_is_a_collected_test():
    nodes = list(checks().values())
    assert len(nodes) >= 7
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *nodes],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    collected = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    assert collected == set(nodes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without a GPU")
def test_without_a_gpu_it_fails_with_the_summary_line():
    out = subprocess.run(["bash", str(SCRIPT), sys.executable], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stdout.splitlines()[-1] == "gpu_check: 0 passed, 1 failed"
