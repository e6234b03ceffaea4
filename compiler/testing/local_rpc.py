"""TVM RPC trackers and servers on loopback, for tests: each runs under the supervisor (processes.py), counts as
started once its log says it bound its port, and one that exits first is reported with its log."""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from pathlib import Path

from ..torch_hidden import worker_environ
from .processes import kill_group, spawn

# A busy 2-core machine (CI compiling in the other worker) takes tens of seconds to import TVM in a new process.
READY_TIMEOUT_S = 180
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class LocalProcess:
    """`python -m MODULE ARGS` in its own process group, its output in `log`."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.log = log
        self.proc = spawn([sys.executable, "-m", *args], log, env=worker_environ({**os.environ, **(env or {})}))

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def check_running(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.log} ended early (exit code {self.proc.returncode}):\n{self.text()}")

    def wait_for(self, pattern: str, timeout_s: float = READY_TIMEOUT_S) -> re.Match:
        """The first match of the regular expression `pattern` in the log, once it is there."""
        deadline = time.monotonic() + timeout_s
        while not (match := re.search(pattern, self.text())):
            self.check_running()
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {pattern!r} in {self.log} after {timeout_s:.0f} s:\n{self.text()}")
            time.sleep(0.2)
        return match

    def kill(self) -> None:
        kill_group(self.proc, grace_s=0)


def _start_bound(args: list[str], log: Path, env: dict[str, str] | None) -> tuple[LocalProcess, int]:
    """Start a tracker or server on a free port; another process can take that port between our probe and the
    bind, and then the start is tried again on another."""
    for attempt in range(3):
        port = free_port()
        process = LocalProcess([*args, "--host", HOST, "--port", str(port), "--port-end", str(port + 1)], log, env)
        try:
            process.wait_for(rf"bind to {re.escape(HOST)}:{port}\b")
            return process, port
        except RuntimeError:
            exited = process.proc.poll() is not None
            process.kill()
            if attempt == 2 or not exited:  # a hang, not a lost port: no retry
                raise
    raise AssertionError("unreachable")


def start_tracker(log: Path) -> tuple[LocalProcess, int]:
    """A tracker on loopback: (its process, its port). It needs only TVM's runtime library, which loads faster."""
    return _start_bound(["tvm.exec.rpc_tracker"], log, {"TVM_USE_RUNTIME_LIB": "1"})


def start_server(log: Path, tracker_port: int | None = None, key: str | None = None, extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> tuple[LocalProcess, str]:
    """An RPC server on loopback, registered under `key` with the tracker if one is given: (its process, its
    address host:port)."""
    args = ["tvm.exec.rpc_server", *extra_args]
    if tracker_port is not None:
        args += ["--tracker", f"{HOST}:{tracker_port}", "--key", key]
    process, port = _start_bound(args, log, env)
    return process, f"{HOST}:{port}"


def wait_until_free(tracker_port: int, want: dict[str, int], servers: list[LocalProcess],
                    timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until the tracker holds, for each key, at least that many free servers (servers retry a tracker every
    5 s until they reach it)."""
    from tvm import rpc  # pylint: disable=import-outside-toplevel

    deadline = time.monotonic() + timeout_s
    while True:
        tracker = rpc.connect_tracker(HOST, tracker_port)
        try:
            queues = tracker.summary()["queue_info"]
        finally:
            tracker.close()
        if all(queues.get(key, {}).get("free", 0) >= n for key, n in want.items()):
            return
        for server in servers:
            server.check_running()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the servers never registered {want} with the tracker within {timeout_s:.0f} s "
                               f"(it holds {queues}); {servers[0].log} says:\n{servers[0].text()}")
        time.sleep(0.5)
