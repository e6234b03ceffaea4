"""Signals that ask a command to stop, remembered as well as raised. TVM's C++ checks for signals during long calls
and turns the handler's exception into an error of its own, which some of its code catches and drops (a Ctrl-C
in a compile under load once ended with exit 0 and an artifact); so the command checks again before it writes its
result (export.atomic_directory)."""

from __future__ import annotations

import signal

_received: list[int] = []


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: raised where the command was, so that its cleanups run."""


def note(signum: int) -> None:
    _received.append(signum)


def forget() -> None:
    """A new command starts: signals an earlier one in this process received (a notebook that caught its
    KeyboardInterrupt and runs another) do not stop it."""
    _received.clear()


def raise_if_received() -> None:
    """Raise what the first signal received raised (KeyboardInterrupt for SIGINT), if one came."""
    if not _received:
        return
    if _received[0] == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(_received[0])
