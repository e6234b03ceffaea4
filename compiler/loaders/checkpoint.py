"""The checkpoint interface every reader implements, and what the readers share."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import MobilecError


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

    def rows(self, name: str) -> np.ndarray | Rows:
        """One tensor as `get` gives it or, from a reader that can, as Rows read a slice at a time."""
        return self.get(name)

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


class Rows:
    """A tensor read a slice of rows at a time: `rows[a:b]` is a float32 array of its own, `np.asarray(rows)` the
    whole tensor. A quantizer that takes it in slices never holds it whole (an 8B model's embedding: 2 GB)."""

    def __init__(self, shape: tuple[int, ...], read: Callable[[slice], np.ndarray]):
        self.shape, self._read = shape, read

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> np.ndarray:
        return self._read(rows)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:  # pylint: disable=unused-argument
        return self._read(slice(None)).astype(dtype or np.float32, copy=False)


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


def one_line(e: BaseException) -> str:
    """The first line of a library's error, to quote inside a one-line MobilecError."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
