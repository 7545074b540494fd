"""The processes of a private Ray cluster on this machine, as the harness
starts and stops them (harness/serving.py): the ``ray`` and ``serve`` CLIs
next to this interpreter, the cluster's processes found by its session
directory (never by a broad name, so other clusters are left alone), and
whether a process is still alive.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def cli_path(name: str) -> str:
    """The CLI next to this interpreter (the venv's), else from PATH."""

    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def pids_mentioning(path: str) -> list[int]:
    """Processes whose command line names ``path`` or that hold a file under it
    open (Ray renames its workers' command lines, but their logs stay open)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if path in cmdline or any(os.readlink(fd).startswith(path) for fd in (entry / "fd").iterdir()):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def is_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().split()[2] != "Z"
    except OSError:
        return False
