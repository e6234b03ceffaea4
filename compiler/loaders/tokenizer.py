"""The tokenizer files an artifact carries: written from a checkpoint by transformers, and read back by it, so they
are exactly what it reloads."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import MobilecError
from ..user_cache import cache_path, keep_directory
from .checkpoint import one_line


def save_auto_tokenizer(source: Path, out_dir: str | os.PathLike, what: str, cache_key: str | None = None,
                        **kwargs: Any) -> None:
    """Let transformers build the tokenizer and write it, so the saved files are exactly what it reloads.

    With `cache_key` (the text of everything the conversion reads), the files are kept in mobilec's cache under that
    text and the transformers and tokenizers versions, and copied from there the next time: transformers takes
    ~20 s to convert a GGUF vocabulary, on every compile, and every quantization of a model carries the same one.
    """
    entry = _cache_entry(cache_key) if cache_key is not None else None
    if entry is not None and entry.is_dir():
        shutil.copytree(entry, out_dir, dirs_exist_ok=True)
        return
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True, **kwargs)
        tokenizer.save_pretrained(str(out_dir))
    except Exception as e:  # transformers raises many types here; the user needs one line
        raise MobilecError(f"could not build the tokenizer of {what} ({one_line(e)}); check its tokenizer files") from e
    if entry is not None:
        keep_directory(Path(out_dir), entry)


def _cache_entry(cache_key: str) -> Path:
    key = "\0".join([cache_key, importlib.metadata.version("transformers"), importlib.metadata.version("tokenizers")])
    return cache_path("tokenizers", hashlib.sha256(key.encode()).hexdigest()[:24])


def load_tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as err:
        raise MobilecError(f"cannot load the tokenizer in {tokenizer_dir}: {str(err).splitlines()[0]}") from None
