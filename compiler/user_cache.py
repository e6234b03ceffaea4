"""The one directory mobilec keeps reusable results in: ${MOBILEC_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/mobilec}.

Everything there can be deleted at any time; it is only measured or converted again."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


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
