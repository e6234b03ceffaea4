"""response_format json_schema / json_object through xgrammar's token mask, on a tiny random model with SmolLM2's
real tokenizer (braces, quotes and words are tokens of it): the output validates against the schema, and the same
request without the mask does not."""

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.loaders.default_model import default_model_path
from tests.helpers.tiny_models import build_model, save_hf
from tests.serve.test_http import ServerProcess

pytestmark = pytest.mark.slow  # a tiny compile (~25 s) and a server process
MODEL = "tiny-model"
SCHEMA = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "happy": {"type": "boolean"}},
          "required": ["pet", "happy"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    save_hf(build_model("llama_gqa", vocab_size=len(tokenizer)), root / "hf")
    tokenizer.save_pretrained(str(root / "hf"))
    compile_model(CompileOptions(str(root / "hf"), "host", "q0f32", str(root / "artifact"), context_window=128,
                                 progress=False))
    process = ServerProcess(root / "artifact")
    yield openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0)
    process.stop()


def ask(client, response_format=None, seed=3, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a pet as JSON."}], max_tokens=40,
        temperature=0.8, seed=seed, **({"response_format": response_format} if response_format else {}), **extra)


def test_json_schema_output_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    for seed in (1, 2, 3):
        out = ask(client, fmt, seed=seed)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_negative_control_without_the_mask_the_output_is_not_the_json(client):
    out = ask(client)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_json_object_starts_an_object(client):
    out = ask(client, {"type": "json_object"}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in out if c.choices)
    assert text.startswith("{")


def test_bad_schema_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="response_format"):
        ask(client, {"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(openai.BadRequestError, match="unknown"):
        ask(client, {"type": "yaml"})
