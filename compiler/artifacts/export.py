"""Write an artifact directory atomically: weight shards with their index, then rename into place, never over a
user's files (the output rule: check_output)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .. import stop_signals, validate
from ..errors import MobilecError
from .artifact import ALIGNMENT, CONFIG_FILE, PARAMS_INDEX, PARTIAL_MARKER, SHARD_BYTES, foreign_files


class ShardWriter:
    """Appends tensors to ≤ SHARD_BYTES files, each tensor at an ALIGNMENT-byte offset; hashes as it writes."""

    def __init__(self, params_dir: Path):
        self.dir = params_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tensors: list[dict[str, Any]] = []
        self.shards: list[dict[str, Any]] = []
        self._file = None
        self._hash = None
        self._offset = 0

    def _open_shard(self) -> None:
        self._close_shard()
        name = f"shard_{len(self.shards):03d}.bin"
        self._file = open(self.dir / name, "wb")  # pylint: disable=consider-using-with
        self._hash = hashlib.sha256()
        self._offset = 0
        self.shards.append({"file": name})

    def _close_shard(self) -> None:
        if self._file is not None:
            self._file.close()
            self.shards[-1].update(nbytes=self._offset, sha256=self._hash.hexdigest())
            self._file = None

    def _write(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)
        self._offset += len(data)

    def add(self, name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        pad = -self._offset % ALIGNMENT
        if self._file is None or (self._offset + pad + array.nbytes > SHARD_BYTES and self._offset > 0):
            self._open_shard()
            pad = 0
        self._write(b"\0" * pad)
        self.tensors.append(
            {
                "name": name,
                "shape": list(array.shape),
                "dtype": str(array.dtype),
                "shard": self.shards[-1]["file"],
                "offset": self._offset,
                "nbytes": array.nbytes,
            }
        )
        self._write(memoryview(array).cast("B"))

    def finish(self, root: Path) -> dict[str, Any]:
        self._close_shard()
        index = {"alignment": ALIGNMENT, "tensors": self.tensors, "shards": self.shards}
        (root / PARAMS_INDEX).write_text(json.dumps(index, indent=1))
        return index


def check_output(final: Path, overwrite: bool, name: str = "--output", owned=foreign_files,
                 what: str = "a mobilec artifact") -> Path:
    """The output rule: a path that does not exist, an empty directory, or `what` (a mobilec artifact; `owned`
    lists the entries that are not its) with no files of the user's in it, the last only with `overwrite`.
    Anything else is refused with one line."""
    return validate.output_directory(final, name, owned, what, overwrite)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_partials(final: Path) -> list[Path]:
    """Remove what compiles of `final` killed beyond cleaning up (SIGKILL, power loss) left beside it: directories
    named like ours whose marker says this host made them for this output in a process that has ended. Nothing
    without our marker is touched. Returns what was removed."""
    removed = []
    for pattern in (f".{final.name}.partial-*", f".{final.name}.old-*"):
        for path in final.parent.glob(pattern):
            marker = validate.json_object(path / PARTIAL_MARKER) if path.is_dir() and not path.is_symlink() else None
            if (marker is None or marker.get("output") != str(final) or marker.get("host") != socket.gethostname()
                    or not isinstance(marker.get("pid"), int) or _alive(marker["pid"])):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _mark(path: Path, final: Path) -> None:
    (path / PARTIAL_MARKER).write_text(json.dumps({"output": str(final), "host": socket.gethostname(),
                                                   "pid": os.getpid(), "started": time.time()}))


def _make_partial(final: Path) -> Path:
    """A new sibling `.NAME.partial-XXXXXXXX` with our marker. os.mkdir applies the umask, so the artifact, which
    is this directory renamed, gets the permissions of any directory the user makes (mkdtemp's are 0700)."""
    for _ in range(100):
        path = final.with_name(f".{final.name}.partial-{secrets.token_hex(4)}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        _mark(path, final)
        return path
    raise FileExistsError(f"no free temporary name beside {final}")


def _install(tmp: Path, final: Path) -> None:
    """Put the finished directory in place: rename it to a new path; move its entries into an empty directory (the
    directory itself, its permissions, and a shell's current directory in it, stay); or, replacing an artifact,
    rename the old one aside, the new one in, and delete the old one."""
    if not final.exists():
        tmp.rename(final)
        return
    if not any(final.iterdir()):
        entries = sorted(tmp.iterdir(), key=lambda p: p.name == CONFIG_FILE)  # the config, which marks it, last
        moved = []
        try:
            for entry in entries:
                entry.rename(final / entry.name)
                moved.append(entry.name)
        except BaseException:
            for name in moved:
                (final / name).rename(tmp / name)
            raise
        tmp.rmdir()
        return
    old = final.with_name(f".{final.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
    final.rename(old)
    try:
        _mark(old, final)  # a kill from here on leaves a directory the next compile removes
        tmp.rename(final)
    except BaseException:
        if not final.exists():
            old.rename(final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_error(err: OSError, final: Path, name: str) -> MobilecError:
    where = err.filename or final.parent
    return MobilecError(f"cannot write {name} {final}: {err.strerror or err} ({where})")


@contextlib.contextmanager
def atomic_directory(final: Path, overwrite: bool = False, name: str = "--output", owned=foreign_files,
                     what: str = "a mobilec artifact") -> Iterator[Path]:
    """Yield a temporary sibling of `final` to write into; on success it becomes `final`, on any error or signal
    it is removed. `final` must pass the output rule (check_output) when this starts and again when it ends; stale
    temporary directories of earlier, killed runs for the same output are removed first."""
    final = Path(os.path.realpath(final))  # a link to an artifact: the artifact is replaced, the link stays
    check_output(final, overwrite, name, owned, what)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(final)
        tmp = _make_partial(final)
    except OSError as err:
        raise _write_error(err, final, name) from None
    try:
        try:
            yield tmp
            check_output(final, overwrite, name, owned, what)  # the path may have changed while this ran
            stop_signals.raise_if_received()  # a signal TVM's C++ swallowed still stops the command here
            (tmp / PARTIAL_MARKER).unlink()
            _install(tmp, final)
        except OSError as err:
            if err.filename is not None and str(err.filename).startswith(str(tmp)):
                raise _write_error(err, final, name) from None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
