"""The one place option values and target-file values are checked: types, ranges and known names, with the same
rule for the same kind of value in every command (a thread count, a token count, a context length, seconds, a
probability, an address, a text, an input file, an output file or directory). Each check raises MobilecError with
one line that names the option (or the target-file field) and the value, and returns the value checked.

Commands call these first, before anything expensive (loading a model, building, connecting to a device)."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .choices import COMPUTE_DTYPES
from .errors import MobilecError

# The longest context window (tokens) a command takes: TVM's shapes and the KV cache's page table are int32, and
# no supported model is trained past 1M positions.
MAX_CONTEXT = 1 << 20
# Device threads an RPC device may be asked for (this machine's own limit is its usable cores).
MAX_DEVICE_THREADS = 1024
MAX_SEED = 2**63 - 1
THREADS_ENV = "TVM_NUM_THREADS"
# The cores this process may use, read when it starts (host.usable_cores' rule): TVM's thread pool, once sized,
# pins the calling thread to as many cores as it was given, after which the thread sees only those.
USABLE_CPUS = frozenset(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else
                        range(os.cpu_count() or 1))
USABLE_CORES = len(USABLE_CPUS)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def count(value: Any, name: str, least: int = 1, most: int | None = None, unit: str = "") -> int:
    """A whole number from `least` to `most` (a repeat count, kernel trials, a group size)."""
    if not _is_int(value):
        raise MobilecError(f"{name} must be a whole number, got {value!r}")
    if value < least:
        raise MobilecError(f"{name} must be at least {least}, got {value}")
    if most is not None and value > most:
        raise MobilecError(f"{name} must be at most {most}{unit}, got {value}")
    return value


def tokens(value: Any, name: str, least: int = 1) -> int:
    """A number of tokens (a prompt, an output, a window): at least `least`, at most MAX_CONTEXT."""
    return count(value, name, least, MAX_CONTEXT, " tokens")


def context_length(value: Any, name: str = "--context-window") -> int | None:
    """A context window in tokens, None for the model's default."""
    return None if value is None else tokens(value, name)


def threads(value: Any, name: str = "--threads", local: bool = True) -> int | None:
    """A thread count: at least 1 and, for this machine (`local`), at most the cores this process may use; None
    leaves TVM_NUM_THREADS (checked the same way) or TVM's default."""
    most = USABLE_CORES if local else MAX_DEVICE_THREADS
    unit = " (the cores this machine lets this process use)" if local else " (threads on the device)"
    if value is None:
        env = os.environ.get(THREADS_ENV)
        if local and env is not None and env.strip() and (not re.fullmatch(r"\s*\d+\s*", env)
                                                          or not 1 <= int(env) <= most):
            raise MobilecError(f"{THREADS_ENV}={env!r} is not a thread count from 1 to {most}{unit}; "
                               f"fix or unset it, or pass {name}")
        return None
    return count(value, name, 1, most, unit)


def positive_number(value: Any, name: str) -> float:
    """A finite number above 0 (megabytes, GB/s, gigabytes of a target file)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise MobilecError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def seconds(value: Any, name: str) -> float | None:
    """A duration: a finite number of seconds above 0; None passes (no limit asked for)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise MobilecError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def temperature(value: Any, name: str = "--temperature") -> float:
    """A sampling temperature: 0 (greedy) or a finite positive number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise MobilecError(f"{name} must be 0 (greedy) or a positive number, got {value!r}")
    return float(value)


def probability(value: Any, name: str) -> float:
    """A probability mass above 0 and at most 1 (nucleus sampling's top-p)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise MobilecError(f"{name} must be above 0 and at most 1, got {value!r}")
    return float(value)


def seed(value: Any, name: str = "--seed") -> int:
    return count(value, name, 0, MAX_SEED)


def choice(value: Any, choices: tuple[str, ...] | list[str], name: str) -> str:
    if value not in choices:
        raise MobilecError(f"{name} is {value!r}; valid: {', '.join(choices)}")
    return value


def compute_dtype(value: Any, name: str) -> str:
    return choice(value, COMPUTE_DTYPES, name)


def text(value: Any, name: str, allow_empty: bool = False) -> str:
    """Text given on the command line: valid UTF-8 (the shell hands over bytes; invalid ones arrive as
    surrogate escapes the tokenizer cannot take) and, unless `allow_empty`, not blank."""
    if not isinstance(value, str):
        raise MobilecError(f"{name} must be text, got {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raw = value[err.start].encode("utf-8", "surrogateescape")
        raise MobilecError(f"{name} is not valid UTF-8 (byte 0x{raw.hex()} at character {err.start}); pass UTF-8 "
                           f"text") from None
    if not allow_empty and not value.strip():
        raise MobilecError(f"{name} is empty; pass some text")
    return value


def address(value: Any, name: str) -> tuple[str, int]:
    """HOST:PORT with a port from 1 to 65535."""
    host, sep, port = str(value).rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or any(c.isspace() for c in host):
        raise MobilecError(f"{name} {value!r} is not HOST:PORT (a port from 1 to 65535); pass e.g. "
                           f"{name} 127.0.0.1:9190")
    return host.strip("[]"), int(port)


def device_key(value: Any, name: str = "--key") -> str:
    """A tracker key: non-empty, no whitespace (TVM's handshake splits the key on spaces)."""
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise MobilecError(f"{name} must be a non-empty word without spaces, got {value!r}")
    return value


def input_file(value: Any, name: str) -> Path:
    """An existing, readable regular file."""
    path = Path(value)
    if not path.exists():
        raise MobilecError(f"{name} {path} does not exist")
    if not path.is_file():
        raise MobilecError(f"{name} {path} is not a file")
    if not os.access(path, os.R_OK):
        raise MobilecError(f"{name} {path} is not readable (permission denied)")
    return path


def read_text_file(value: Any, name: str) -> str:
    """The UTF-8 contents of an input file, refused when unreadable, not UTF-8 or blank."""
    path = input_file(value, name)
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise MobilecError(f"{name} {path} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset "
                           f"{err.start})") from None
    except OSError as err:
        raise MobilecError(f"cannot read {name} {path}: {err.strerror or err}") from None
    if not content.strip():
        raise MobilecError(f"{name} {path} is empty; pass a file with text in it")
    return content


def _writable_ancestor(path: Path, name: str) -> None:
    """The nearest existing ancestor of `path` is a directory this process may create entries in."""
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise MobilecError(f"cannot write {name} {path}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise MobilecError(f"cannot write {name} {path}: {ancestor} is not writable (permission denied); pick a "
                           f"path in a directory you can write")


# What an output file of each kind starts with: an existing file is replaced only when it is one (ours, or at
# least a file of the kind we write), never a file of another kind that happens to sit at that path.
_FILE_KINDS: dict[str, tuple[str, Callable[[bytes], bool]]] = {
    "png": ("a PNG image", lambda head: head.startswith(b"\x89PNG\r\n\x1a\n")),
}


def output_file(value: Any, name: str, kind: str) -> Path | None:
    """A file a command writes (`kind`: png, bench's --plot): a new path in a writable directory, or an existing file of
    that kind (a previous result, replaced); anything else at the path is refused, so no other file is lost."""
    if value is None:
        return None
    path = Path(value)
    what, looks_right = _FILE_KINDS[kind]
    if path.is_dir():
        raise MobilecError(f"{name} {path} is a directory; pass a file path")
    if path.exists():
        try:
            with open(path, "rb") as f:
                head = f.read(64)
        except OSError as err:
            raise MobilecError(f"cannot write {name} {path}: {err.strerror or err}") from None
        if head and not looks_right(head):
            raise MobilecError(f"{name} {path} exists and is not {what}; mobilec replaces only its own kind of "
                               f"file there: pick another path")
        if not os.access(path, os.W_OK):
            raise MobilecError(f"cannot write {name} {path}: permission denied")
        return path
    _writable_ancestor(path, name)
    return path


def output_directory(value: Any, name: str, owned: Callable[[Path], list[str] | None], what: str,
                     overwrite: bool | None) -> Path:
    """A directory a command writes: a path that does not exist, an empty directory, or one holding `what`
    (`owned(path)` lists the entries that are not part of it, or is None when the directory is not one). The last
    is replaced only with `overwrite` (None: replacing our own output needs no flag) and only when every entry is
    ours. Anything else is refused with one line: no file of the user's is ever replaced or deleted."""
    path = Path(value)
    if not path.exists() and not path.is_symlink():
        _writable_ancestor(path, name)
        return path
    if not path.is_dir():
        raise MobilecError(f"{name} {path} is an existing file, not a directory; mobilec writes only to a new "
                           f"path, an empty directory or {what}: pick another {name}")
    try:
        entries = sorted(p.name for p in path.iterdir())
    except OSError as err:
        raise MobilecError(f"cannot read {name} {path}: {err.strerror or err}") from None
    if entries:
        foreign = owned(path)
        if foreign is None:
            raise MobilecError(f"{name} {path} is a directory with files that are not {what} (e.g. "
                               f"{entries[0]!r}); mobilec writes only to a new path, an empty directory or {what}, "
                               f"so that nothing else is replaced: pick another {name}")
        if foreign:
            raise MobilecError(f"{name} {path} holds {what} but also other files ({', '.join(foreign[:3])}"
                               f"{', ...' if len(foreign) > 3 else ''}); replacing it would delete them: move them "
                               f"out or pick another {name}")
        if overwrite is False:
            raise MobilecError(f"{name} {path} already holds {what}; pass --overwrite to replace it, or pick another "
                               f"{name}")
    # Written beside the directory (a temporary sibling renamed into place) and into it.
    for where in (path.resolve().parent, path):
        if not os.access(where, os.W_OK | os.X_OK):
            raise MobilecError(f"cannot write {name} {path}: {where} is not writable (permission denied); pick a "
                               f"path in a directory you can write")
    return path


def json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in a file, or None when it is missing, unreadable or not a JSON object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None
