"""The tokenizer files an artifact carries: written from a checkpoint by transformers, and read back by it, so they
are exactly what it reloads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import MobilecError
from .checkpoint import one_line


def save_auto_tokenizer(source: Path, out_dir: str | os.PathLike, what: str, **kwargs: Any) -> None:
    """Let transformers build the tokenizer and write it, so the saved files are exactly what it reloads."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True, **kwargs)
        tokenizer.save_pretrained(str(out_dir))
    except Exception as e:  # transformers raises many types here; the user needs one line
        raise MobilecError(f"could not build the tokenizer of {what} ({one_line(e)}); check its tokenizer files") from e


def load_tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as err:
        raise MobilecError(f"cannot load the tokenizer in {tokenizer_dir}: {str(err).splitlines()[0]}") from None
