"""Checkpoint readers: one streaming interface over HF model directories and GGUF files.

`open_checkpoint(path)` picks the reader; every reader yields HF tensor names, float32 arrays in HF layout
and an HF-style config, so the rest of the compiler never needs to know where the weights came from.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MobilecError

__all__ = ["Checkpoint", "ConfigCheckpoint", "open_checkpoint"]

_GGUF_MAGIC = b"GGUF"
_USAGE = "pass a Hugging Face model directory (config.json + weights) or a .gguf file"


class Checkpoint:
    """A read-only view of one model's weights, config and tokenizer.

    Subclasses fill in `hf_config`, `description` and the tensor accessors; tensors are read one at a
    time from memory-mapped files, so opening a checkpoint never loads the whole model.
    """

    hf_config: dict[str, Any]
    description: str

    def tensor_names(self) -> list[str]:
        raise NotImplementedError

    def get(self, name: str) -> np.ndarray:
        """One tensor as a float32 array in HF layout ([out, in] for linear weights)."""
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        """One tensor's shape in HF layout, without reading its values (readers override this)."""
        return tuple(self.get(name).shape)

    def get_gguf_blocks(self, name: str) -> tuple[str, np.ndarray, tuple[int, int]]:
        """The still-quantized rows of a GGUF tensor; only GGUF checkpoints have them."""
        raise MobilecError(
            f"{self.description} is not a GGUF file, so tensor {name!r} has no quantized blocks; "
            "pass a .gguf checkpoint to reuse its quantization"
        )

    def save_tokenizer(self, out_dir: str | os.PathLike) -> None:
        """Write tokenizer files (with the chat template) that `AutoTokenizer.from_pretrained` loads offline."""
        raise NotImplementedError

    def close(self) -> None:
        """Drop the file mappings; arrays already returned by `get` stay valid."""

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _missing(self, name: str) -> MobilecError:
        names = self.tensor_names()
        hint = f" (it has {len(names)} tensors, e.g. {names[0]!r})" if names else ""
        return MobilecError(f"tensor {name!r} is not in {self.description}{hint}; check the tensor name")


class ConfigCheckpoint(Checkpoint):
    """A model's config without its weights: enough for shapes and sizes (`mobilec estimate`), not to compile."""

    def __init__(self, hf_config: dict[str, Any], description: str):
        self.hf_config = hf_config
        self.description = description

    def tensor_names(self) -> list[str]:
        return []

    def get(self, name: str) -> np.ndarray:
        raise MobilecError(f"{self.description} has no weights, so tensor {name!r} cannot be read; "
                           "pass a model directory with its weight files")


def _one_line(e: BaseException) -> str:
    """The first line of a library's error, to quote inside a one-line MobilecError."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _save_auto_tokenizer(source: Path, out_dir: str | os.PathLike, what: str, **kwargs: Any) -> None:
    """Let transformers build the tokenizer and write it, so the saved files are exactly what it reloads."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True, **kwargs)
        tokenizer.save_pretrained(str(out_dir))
    except Exception as e:  # transformers raises many types here; the user needs one line
        raise MobilecError(f"could not build the tokenizer of {what} ({_one_line(e)}); check its tokenizer files") from e


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
    with open(p, "rb") as f:
        magic = f.read(len(_GGUF_MAGIC))
    if magic == _GGUF_MAGIC:
        from .gguf import GGUFCheckpoint

        return GGUFCheckpoint(p)
    # A user pointing at a weight or config file inside a model directory most likely meant the directory.
    if (p.parent / "config.json").is_file() and p.suffix in (".safetensors", ".bin", ".json"):
        raise MobilecError(f"{str(p)!r} is a file inside a model directory; pass the directory {str(p.parent)!r}")
    raise MobilecError(f"{str(p)!r} is not a GGUF file (no GGUF magic bytes) nor a model directory; {_USAGE}")
