"""A tiny random Llama compiled once per test module for the serving tests: its vocabulary is the tiny tokenizer's
12 words, so every generated token has text."""

import json

import pytest

from compiler.commands.compile_model import CompileOptions, compile_model
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

CONTEXT_WINDOW = 128
# every message's words, each turn ended by "." (the tiny tokenizer's words only)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} . {% endfor %}"


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    save_compilable_checkpoint(build_model("llama_gqa", vocab_size=12), root / "hf")
    config = json.loads((root / "hf" / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
    compile_model(CompileOptions(str(root / "hf"), "host", "q0f32", str(root / "artifact"),
                                 context_window=CONTEXT_WINDOW, progress=False))
    return root / "artifact"
