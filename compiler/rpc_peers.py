"""Waits on RPC peers, each with a deadline: trackers queried by `tune` and by the runtime, and the sessions the
runtime opens. Compile-time code (tune) and the runtime both use it, so it imports neither."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from collections.abc import Iterator

from tvm import rpc

from .errors import MobilecError

# A TCP connection and a TVM RPC server's (or tracker's) answer to the handshake come at once; a server then starts
# a session process, slower on a small device or under emulation.
CONNECT_TIMEOUT_S = 10.0
SESSION_START_TIMEOUT_S = 120.0
# A session lasts at most --session-timeout (the server ends it); past that and this grace, the peer is gone.
SESSION_GRACE_S = 30.0
TRACKER_FIX = "pass the tracker's address to --tracker (an RPC server's goes to --rpc)"


class _DeadlinePassed(BaseException):
    """Raised by the SIGALRM handler; a BaseException so that no `except Exception` on the way swallows it."""


@contextlib.contextmanager
def deadline(seconds: float, message: str) -> Iterator[None]:
    """Raise MobilecError(message) when the block runs past `seconds`. SIGALRM interrupts a blocking socket call,
    TVM's C++ ones included (on EINTR they run Python's signal handlers, which raise here). Signals reach the main
    thread only: elsewhere the block runs under the socket timeouts alone. An enclosing deadline is restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = signal.getitimer(signal.ITIMER_REAL)[0]
    if outer and outer <= seconds:  # an enclosing deadline ends first: it stays in charge
        yield
        return
    token = object()

    def expire(_signum, _frame):
        raise _DeadlinePassed(token)

    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _DeadlinePassed as passed:
        if passed.args[0] is not token:
            raise  # an enclosing deadline's
        raise MobilecError(message) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 1e-3))


def last_line(err: Exception) -> str:
    """The line of a TVM error that says what went wrong (its message ends with it, after any context); a
    message cut short by a dropped connection can end in stray bytes, which are left out."""
    text = "".join(ch for ch in str(err) if ch.isprintable() or ch == "\n")
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), type(err).__name__)


def open_tracker(host: str, port: int) -> tuple[rpc.TrackerSession, list[str]]:
    """The tracker at host:port and the key of every RPC server registered with it (one entry per server). Each
    step has a deadline: TVM's tracker client retries a refused connection for 60 s and waits forever on a socket
    that accepts and never answers."""
    where = f"{host}:{port}"
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise MobilecError(f"cannot reach the RPC tracker at {where} ({err.strerror or err}); start it with "
                           f"`python -m tvm.exec.rpc_tracker --host 0.0.0.0 --port {port}` or fix --tracker") from None
    try:
        with deadline(CONNECT_TIMEOUT_S, f"{where} accepts connections but did not answer as an RPC tracker within "
                                         f"{CONNECT_TIMEOUT_S:g} s; {TRACKER_FIX}"):
            tracker = rpc.connect_tracker(host, port)
            keys = [info["key"].split(":", 1)[1] for info in tracker.summary()["server_info"]]
    except (RuntimeError, OSError, ValueError, KeyError, TypeError, IndexError) as err:
        raise MobilecError(f"{where} does not answer as an RPC tracker ({last_line(err)}); {TRACKER_FIX}") from None
    return tracker, keys


def check_key(host: str, port: int, key: str, keys: list[str]) -> None:
    """A request for a key no server has would wait forever: refused with the keys the tracker has."""
    if key not in keys:
        listed = ", ".join(sorted(set(keys))) or "none; no RPC server has registered"
        raise MobilecError(f"the tracker at {host}:{port} has no device with key {key!r}; its keys: {listed}")
