"""bench/docs_figures.py: every measured figure in docs/ names its command and commit, and the
check finds exactly the problems a hand-written page holds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("docs_figures", ROOT / "bench" / "docs_figures.py")
docs_figures = sys.modules[SPEC.name] = importlib.util.module_from_spec(SPEC)  # dataclasses look it up
SPEC.loader.exec_module(docs_figures)

PAGE = """# Page

Curves: figures/curves.png.

## Timings

Measured: bench/leader_cpu.py at commit 807c1f5.

| run | s |
|---|---|
| a | 1.0 |
| b | 2.0 |

Measured: `.venv/bin/python bench/leader_cpu.py`; `megatron-agent plot runs/a` at 807c1f5 (2 cores).

Measured: `for n in 1 2; do .venv/bin/python bench/no_such_bench.py $n; done` at 807c1f5.

Measured: `megatron-agent fly` at 807c1f5.

Measured: `CI=true .ci/run` at da8ce79.
"""


def test_the_docs_have_measured_lines_and_no_problems():
    docs = docs_figures.read_docs(ROOT)
    figure_files = {p.name for p in (ROOT / "docs" / "figures").glob("*.png")}
    assert [f for doc in docs for f in doc.figures]
    assert docs_figures.check(docs, ROOT, figure_files) == []


def test_a_hand_written_page_gives_exactly_its_problems():
    doc = docs_figures.parse_doc("docs/page.md", PAGE)
    assert [(f.line, f.heading, f.commands, f.commit, f.note) for f in doc.figures] == [
        (14, "## Timings", (".venv/bin/python bench/leader_cpu.py", "megatron-agent plot runs/a"), "807c1f5", "2 cores"),
        (16, "## Timings", ("for n in 1 2; do .venv/bin/python bench/no_such_bench.py $n; done",), "807c1f5", ""),
        (18, "## Timings", ("megatron-agent fly",), "807c1f5", ""),
        (20, "## Timings", ("CI=true .ci/run",), "da8ce79", ""),
    ]
    assert docs_figures.check([doc], ROOT, {"curves.png", "orphan.png"}) == [
        "docs/page.md:7: a Measured line that does not parse",
        "docs/page.md:16: `for n in 1 2; do .venv/bin/python bench/no_such_bench.py $n; done`: no bench/no_such_bench.py",
        "docs/page.md:18: `megatron-agent fly`: no megatron-agent subcommand fly",
        # 11 lines from the first good line; the malformed one 4 lines away does not count
        "figures/curves.png: no Measured line within 10 lines (docs/page.md:3)",
        "figures/orphan.png: no Measured line within 10 lines (named in no doc)",
    ]
