"""A tiny random Llama compiled once per test module for the serving tests: its vocabulary is the tiny tokenizer's
12 words, so every generated token has text."""

import pytest

from compiler.compile_model import CompileOptions, compile_model
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

CONTEXT_WINDOW = 128


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    save_compilable_checkpoint(build_model("llama_gqa", vocab_size=12), root / "hf")
    compile_model(CompileOptions(str(root / "hf"), "host", "q0f32", str(root / "artifact"),
                                 context_window=CONTEXT_WINDOW, progress=False))
    return root / "artifact"
