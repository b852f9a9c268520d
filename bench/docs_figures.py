"""The measured figures in docs/: the command that makes each and the commit it was measured on.

A table, plot or paragraph of figures measured on a machine has, directly after (or before)
it, a line of its own:  Measured: `COMMAND`; `COMMAND` at COMMIT (an optional note).

    python bench/docs_figures.py              # per figure: doc:line, heading, commit, commands
    python bench/docs_figures.py --check      # exit 1 naming each problem
    python bench/docs_figures.py --commands   # the commands, de-duplicated, in doc order
    bash <(python bench/docs_figures.py --commands)    # rerun them all (repo root, venv active)

Problems: a `Measured:` line that does not parse; a command whose script (bench/x.py, .ci/run,
a test file, `python -m` module of this repo) or `megatron-agent` subcommand is not in the
repo; a docs/figures/*.png that no doc names within 10 lines of a Measured line. Stdlib only.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURED = re.compile(r"^Measured: (?P<commands>`[^`]+`(?:; `[^`]+`)*) at (?P<commit>[0-9a-f]{7,40})"
                      r"(?: \((?P<note>.+)\))?\.$")
PNG = re.compile(r"figures/([\w.-]+\.png)")
PNG_REACH = 10  # lines between a figure's name and its Measured line
SHELL_SEPARATORS = re.compile(r";|&&|\|\||\|")
SHELL_WORDS = ("do", "then", "else", "done", "fi", "time")


@dataclass(frozen=True)
class Figure:
    doc: str
    line: int
    heading: str
    commands: tuple[str, ...]
    commit: str
    note: str


@dataclass(frozen=True)
class Doc:
    name: str
    figures: list[Figure]
    malformed: list[int]  # line numbers of `Measured:` lines that do not parse
    png_mentions: list[tuple[str, int]]  # (png file name, line)


def parse_doc(name: str, text: str) -> Doc:
    figures, malformed, pngs = [], [], []
    heading, in_code = "", False
    for number, line in enumerate(text.splitlines(), start=1):
        pngs += [(png, number) for png in PNG.findall(line)]
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        if line.startswith("#"):
            heading = line.strip()
        elif line.startswith("Measured:"):
            match = MEASURED.match(line.rstrip())
            if match is None:
                malformed.append(number)
                continue
            commands = tuple(re.findall(r"`([^`]+)`", match["commands"]))
            figures.append(Figure(name, number, heading, commands, match["commit"], match["note"] or ""))
    return Doc(name, figures, malformed, pngs)


def megatron_agent_subcommands(root: Path) -> set[str]:
    return set(re.findall(r'add_parser\("([\w-]+)"', (root / "megatron_agent" / "cli.py").read_text()))


def _missing(root: Path, path: str) -> bool:
    return not any(c in path for c in "$*{") and not (root / path).exists()


def command_problems(command: str, root: Path, subcommands: set[str]) -> list[str]:
    """What of `command` names a script, module or subcommand this repository lacks."""
    problems = [f"no {token}" for token in command.replace(";", " ").split()
                if token.endswith((".py", ".sh")) and _missing(root, token)]
    for part in SHELL_SEPARATORS.split(command):
        words = part.split()
        while words and (words[0] in SHELL_WORDS or re.match(r"\w+=", words[0])):
            words = words[1:]  # a keyword or a VAR=value before the program
        if not words or words[0] in ("for", "make"):
            continue
        program, args = words[0], words[1:]
        if program.rsplit("/", 1)[-1].startswith("python") and args[:1] == ["-m"] and len(args) > 1:
            module = args[1].replace(".", "/")
            ours = (root / module.split("/")[0]).is_dir()  # else an installed tool: pytest, pip
            if ours and not ((root / f"{module}.py").exists() or (root / module).is_dir()):
                problems.append(f"no module {args[1]}")
        elif program.endswith("megatron-agent"):
            if not args or args[0] not in subcommands:
                problems.append(f"no megatron-agent subcommand {args[0] if args else '(none)'}")
        elif "/" in program and not program.startswith(".venv/") and _missing(root, program):
            problems.append(f"no {program}")
    return sorted(set(problems))


def check(docs: list[Doc], root: Path, figure_files: set[str]) -> list[str]:
    """Every problem, each naming its doc and line (or figure file)."""
    subcommands = megatron_agent_subcommands(root)
    problems = []
    for doc in docs:
        problems += [f"{doc.name}:{n}: a Measured line that does not parse" for n in doc.malformed]
        for figure in doc.figures:
            for command in figure.commands:
                problems += [f"{doc.name}:{figure.line}: `{command}`: {p}"
                             for p in command_problems(command, root, subcommands)]
    named = {png for doc in docs for png, _ in doc.png_mentions}
    for png in sorted(figure_files | named):
        mentions = [(doc, n) for doc in docs for name, n in doc.png_mentions if name == png]
        if not any(abs(n - m) <= PNG_REACH for doc, n in mentions for m in (f.line for f in doc.figures)):
            where = ", ".join(f"{doc.name}:{n}" for doc, n in mentions) or "named in no doc"
            problems.append(f"figures/{png}: no Measured line within {PNG_REACH} lines ({where})")
    return problems


def read_docs(root: Path) -> list[Doc]:
    return [parse_doc(f"docs/{p.name}", p.read_text()) for p in sorted((root / "docs").glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 naming each problem")
    parser.add_argument("--commands", action="store_true", help="only the commands, one a line")
    args = parser.parse_args(argv)
    docs = read_docs(ROOT)
    figures = [f for doc in docs for f in doc.figures]
    if args.check:
        problems = check(docs, ROOT, {p.name for p in (ROOT / "docs" / "figures").glob("*.png")})
        for problem in problems:
            print(problem)
        print(f"docs_figures: {len(figures)} measured figures, {len(problems)} problems")
        return 1 if problems else 0
    if args.commands:
        print("\n".join(dict.fromkeys(c for f in figures for c in f.commands)))
        return 0
    for f in figures:
        print(f"{f.doc}:{f.line}  {f.heading}\n  at {f.commit}" + (f" ({f.note})" if f.note else ""))
        print("".join(f"  $ {c}\n" for c in f.commands), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
