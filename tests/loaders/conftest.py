"""Checkpoints for loader tests: the tiny random models in every format, and SmolLM2's real GGUF."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from compiler.loaders import Checkpoint, open_checkpoint
from compiler.loaders.default_model import default_model_path
from tests.helpers.tiny_models import HF_FORMATS, build_model, save_hf, write_gguf


class TinyCheckpoints:
    """Lazily writes each tiny model once per session, in each requested format."""

    def __init__(self, root: Path):
        self._root = root
        self._models: dict[str, object] = {}
        self._paths: dict[tuple[str, str], Path] = {}

    def model(self, name: str):
        if name not in self._models:
            self._models[name] = build_model(name)
        return self._models[name]

    def path(self, name: str, fmt: str) -> Path:
        """`fmt` is one of tiny_models.HF_FORMATS or "gguf"."""
        key = (name, fmt)
        if key not in self._paths:
            folder = self._root / name
            if fmt == "gguf":
                folder.mkdir(parents=True, exist_ok=True)
                self._paths[key] = write_gguf(self.model(name), folder / f"{name}.gguf")
            else:
                assert fmt in HF_FORMATS, fmt
                self._paths[key] = save_hf(self.model(name), folder / fmt, fmt)
        return self._paths[key]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> Iterator[Checkpoint]:
    # Opening parses 49k tokenizer strings (~2 s); share one instance.
    with open_checkpoint(smollm2_path) as ckpt:
        yield ckpt


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(smollm2: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    smollm2.save_tokenizer(out)
    return out
