"""Checkpoint readers: one streaming interface over HF model directories and GGUF files.

`open_checkpoint(path)` picks the reader; every reader yields HF tensor names, float32 arrays in HF layout
and an HF-style config, so the rest of the compiler never needs to know where the weights came from.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import MobilecError
from .checkpoint import Checkpoint, ConfigCheckpoint

__all__ = ["Checkpoint", "ConfigCheckpoint", "is_gguf_file", "open_checkpoint"]

_GGUF_MAGIC = b"GGUF"
_USAGE = "pass a Hugging Face model directory (config.json + weights) or a .gguf file"


def open_checkpoint(path: str | os.PathLike, weights_required: bool = True) -> Checkpoint:
    """Open an HF model directory or a GGUF file; anything else raises MobilecError. Unless `weights_required`,
    a directory with a config.json and no weight files opens as a ConfigCheckpoint."""
    p = Path(path).expanduser()
    if not p.exists():
        raise MobilecError(f"checkpoint {str(p)!r} does not exist; {_USAGE}")
    if p.is_dir():
        from .hf import HFCheckpoint, has_weights, read_config  # imported lazily: it pulls in torch

        if not weights_required and not has_weights(p):
            return ConfigCheckpoint(read_config(p), f"HF {p.name} (config.json only)")
        return HFCheckpoint(p)
    if not p.is_file():  # a FIFO or device would block the read below, or never end
        raise MobilecError(f"checkpoint {str(p)!r} is neither a regular file nor a directory; {_USAGE}")
    if is_gguf_file(p):
        from .gguf import GGUFCheckpoint

        return GGUFCheckpoint(p)
    # A user pointing at a weight or config file inside a model directory most likely meant the directory.
    if (p.parent / "config.json").is_file() and p.suffix in (".safetensors", ".bin", ".json"):
        raise MobilecError(f"{str(p)!r} is a file inside a model directory; pass the directory {str(p.parent)!r}")
    raise MobilecError(f"{str(p)!r} is not a GGUF file (no GGUF magic bytes) nor a model directory; {_USAGE}")


def is_gguf_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a regular file that starts with GGUF's magic bytes (anything else: False, never an error)."""
    p = Path(path).expanduser()
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(len(_GGUF_MAGIC)) == _GGUF_MAGIC
