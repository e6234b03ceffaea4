"""Shared fixtures: the default model compiled once per test session, and its float reference."""

from pathlib import Path

import pytest

from compiler.loaders.default_model import default_model_path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf):
    """transformers' float32 SmolLM2, dequantized from the same GGUF (~30 s to load)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2_q0f32(tmp_path_factory, smollm2_gguf) -> Path:
    from compiler.compile_model import compile_model

    out = tmp_path_factory.mktemp("artifacts") / "smollm2-q0f32"
    compile_model(str(smollm2_gguf), "host", "q0f32", str(out), context_window=512, progress=False)
    return out


@pytest.fixture(scope="session")
def smollm2_gguf_exact(tmp_path_factory, smollm2_gguf) -> Path:
    from compiler.compile_model import compile_model

    out = tmp_path_factory.mktemp("artifacts") / "smollm2-gguf"
    compile_model(str(smollm2_gguf), "host", "gguf", str(out), context_window=512, progress=False)
    return out
