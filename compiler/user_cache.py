"""The one directory mobilec keeps reusable results in: ${MOBILEC_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/mobilec}.

Everything there can be deleted at any time; it is only measured or converted again."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cache_path(*parts: str) -> Path:
    base = os.environ.get("MOBILEC_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mobilec"
    return Path(base, *parts)


def keep_directory(source: Path, entry: Path) -> None:
    """Copy `source` to the cache entry `entry` atomically (a reader never sees half of it); a cache that cannot
    be written (read-only home, full disk) is skipped: the result is only computed again next time."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        try:
            tmp.rename(entry)
        except OSError:  # another process kept it first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass


def keep_file(entry: Path, write: Callable[[str], None]) -> bool:
    """`write(path)` to a temporary file beside `entry`, then rename it to `entry` (a reader sees all of it or
    none); False, and nothing left behind, where the cache cannot be written."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{entry.name}.", suffix=entry.suffix, dir=entry.parent)
        os.close(fd)
        write(tmp)
        os.replace(tmp, entry)
        return True
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return False


def drop_older_folders(folder: Path, kept: int) -> None:
    """Delete the folders beside `folder` beyond the `kept` most recently modified (other versions' sets)."""
    try:
        others = sorted((p for p in folder.parent.iterdir() if p.is_dir() and p != folder),
                        key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:  # another process is deleting them
        return
    for old in others[kept:]:
        shutil.rmtree(old, ignore_errors=True)
