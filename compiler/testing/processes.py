"""Processes a test or a test device starts (RPC trackers and servers, an emulated device): each runs under
supervise.py in a process group of its own, so kill_group ends it and everything it forked, and all of them end
when the process that started them does, however it ends (a failed test, Ctrl-C, SIGKILL of the test run)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

SUPERVISOR = Path(__file__).with_name("supervise.py")


def spawn(command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `command` (argv) under the supervisor, its output in `log`, leading its own process group (a Ctrl-C
    meant for the caller reaches none of it)."""
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, str(SUPERVISOR), *command], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def kill_group(process: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process group (the supervisor leads it), then SIGKILL what is left of it; safe to call twice."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    # Forked children (RPC sessions, qemu) may outlive the leader; the group is theirs until they exit.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
