"""The import rules of docs/architecture.md, read from the source (imports inside
functions included, `if TYPE_CHECKING:` blocks excluded)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("megatron_agent", "rollout", "envs", "tools")

# A part may import itself and the parts named here, nothing else of the project.
# Parts not listed (the driver floor: megatron_agent's top-level modules, and tools/)
# may import anything below them.
ALLOWED = {
    "envs": (),
    "rollout": ("envs",),
    "megatron_agent.platform": (),
    "megatron_agent.algorithms": (),
    "megatron_agent.models": ("megatron_agent.platform",),
    "megatron_agent.training": ("megatron_agent.platform", "megatron_agent.models", "megatron_agent.algorithms"),
    "megatron_agent.weight_sync": ("megatron_agent.platform", "megatron_agent.models", "rollout"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports; `from pkg import sub` counts as pkg.sub."""
    found, todo = set(), [ast.parse(path.read_text())]
    while todo:
        node = todo.pop()
        if is_type_checking_block(node):
            continue
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def import_graph() -> dict[str, set[str]]:
    files = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    known = {module_name(p) for p in files}
    return {module_name(p): imported_modules(p, known) - {module_name(p)} for p in files}


def part_of(module: str) -> str | None:
    matches = [part for part in ALLOWED if module == part or module.startswith(part + ".")]
    return max(matches, key=len) if matches else None


def within(module: str, part: str) -> bool:
    return module == part or module.startswith(part + ".")


def test_each_part_imports_only_the_parts_below_it():
    wrong = []
    for module, imports in sorted(import_graph().items()):
        part = part_of(module)
        if part is None:
            continue
        allowed = (part, *ALLOWED[part])
        wrong += [f"{module} imports {name}" for name in sorted(imports)
                  if not any(within(name, a) for a in allowed)]
    assert not wrong, "imports across the floors of docs/architecture.md:\n" + "\n".join(wrong)


def test_no_two_modules_import_each_other():
    graph = import_graph()
    pairs = sorted({tuple(sorted((a, b))) for a, imports in graph.items() for b in imports
                    if a in graph.get(b, ()) and not (within(a, b) or within(b, a))})
    assert not pairs, f"modules importing each other: {pairs}"


@pytest.mark.parametrize("rule", [
    ("envs", "megatron_agent"), ("envs", "rollout"), ("megatron_agent.algorithms", "megatron_agent.training"),
    ("megatron_agent.models", "megatron_agent.training"), ("megatron_agent.models", "megatron_agent.driver"),
    ("rollout", "megatron_agent"),
])
def test_the_rules_the_architecture_page_names(rule):
    """The table above spelled out for the rules docs/architecture.md states in words."""
    importer, forbidden = rule
    wrong = [f"{m} imports {n}" for m, imports in import_graph().items() if within(m, importer)
             for n in imports if within(n, forbidden)]
    assert not wrong, wrong


def test_the_scan_sees_imports_inside_functions(tmp_path, monkeypatch):
    source = tmp_path / "megatron_agent" / "models" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import megatron_agent.driver\n"
                      "def f():\n    from megatron_agent.training import actor\n")
    found = imported_modules(source, {"megatron_agent.training.actor"})
    assert found == {"megatron_agent.training.actor"}
