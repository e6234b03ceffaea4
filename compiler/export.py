"""Write an artifact directory atomically: weight shards with their index, then rename into place."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .artifact import ALIGNMENT, PARAMS_INDEX, SHARD_BYTES


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


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `final`; on success it replaces `final`, on any error it is removed."""
    final = final.resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
