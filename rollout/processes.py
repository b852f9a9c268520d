"""Process helpers for starting engine servers: a free port, and children that die with
their parent."""

from __future__ import annotations

import signal
import socket
import sys


def die_with_parent() -> None:
    """In a child process (a `preexec_fn`): be SIGKILLed when the thread that started it
    dies (Linux, PR_SET_PDEATHSIG), so a killed trainer leaves no engine behind. A no-op
    elsewhere. The *thread*, not the process: start such a child from a thread that lives
    as long as the process (the main thread); one started from a pool thread dies when
    that thread ends (env workers and AppWorld servers watch their parent instead:
    envs/workers.py, envs/appworld_server.py)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
