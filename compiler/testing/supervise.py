"""Run a command so that it, and every process it starts, ends when the process that started this one ends, even
by SIGKILL (a test run stopped hard would otherwise leave RPC servers and trackers running):

    python compiler/testing/supervise.py COMMAND [ARGS...]

This process leads its own process group (its starter passes start_new_session=True; processes.spawn does), asks
Linux to send it SIGTERM when its parent dies (PR_SET_PDEATHSIG), starts COMMAND in the same group and, on SIGTERM,
SIGINT or SIGHUP, ends the whole group: SIGTERM, a grace period, then SIGKILL. When COMMAND exits by itself, what it
left in the group is ended too, and this exits with COMMAND's status.

Standalone on purpose (run by path, imports nothing of the project): it starts in milliseconds.
"""

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
GRACE_S = 5.0


def _signal_group(signum: int) -> None:
    try:
        os.killpg(0, signum)
    except ProcessLookupError:
        pass


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: supervise.py COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent ended before prctl took effect
        return 1
    child = subprocess.Popen(sys.argv[1:])
    ending: list[float] = []  # when the group was told to end

    def end(_signum, _frame):
        if not ending:
            ending.append(time.monotonic())
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM reaches this process too
            _signal_group(signal.SIGTERM)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, end)
    while True:
        try:
            code = child.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            if ending and time.monotonic() - ending[0] > GRACE_S:
                _signal_group(signal.SIGKILL)  # this process included
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _signal_group(signal.SIGTERM)  # what the command left behind (forked sessions)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
