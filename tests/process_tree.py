"""What is left of a tree of processes (the tests of what outlives a killed trainer)."""

from __future__ import annotations

import psutil


def alive_under(roots) -> dict[int, psutil.Process]:
    """{pid: process} of `roots` and everything under them that is alive now (not zombies)."""
    found = {}
    for root in roots:
        try:
            for proc in [root, *root.children(recursive=True)]:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found[proc.pid] = proc
        except psutil.Error:  # gone meanwhile
            pass
    return found
