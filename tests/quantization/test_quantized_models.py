"""Every scheme on the odd-shaped tiny model (vocab 32003, hidden 72), and --quant-skip, against the float model."""

import json

import numpy as np
import pytest

from compiler.artifacts.artifact import load_artifact
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.errors import MobilecError
from compiler.quantization.schemes import SCHEMES
from compiler.runtime.session import Session
from tests.helpers.reference import fake_quantized, reference_greedy
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint, write_gguf

pytestmark = pytest.mark.slow  # a compile per scheme: ~3 minutes

PROMPT = [3, 7, 1, 4, 4, 9, 2, 5, 6, 8, 10, 11, 2]
# cosine similarity of all logits with the float model's: int4 on random unstructured weights is coarse
# (0.85-0.95 here), int8 close, float exact. The exact check is against the numpy quantize-dequantize model.
MIN_COSINE = {"q0f32": 0.99999, "q0f16": 0.999, "gguf": 0.99999, "q8f16_g128": 0.999}
MIN_COSINE_INT4 = 0.8


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory):
    model = build_model("llama_odd")
    root = tmp_path_factory.mktemp("odd")
    save_compilable_checkpoint(model, root / "hf")
    write_gguf(model, root / "hf" / "odd.gguf", tokenizer=True)  # F32: K=72 has no whole 32-blocks, as llama.cpp would keep it
    _, ref_logits, _ = reference_greedy(model, PROMPT, 1)
    return root, model, ref_logits


def _compiled_logits(path, out, quant, skip=()):
    compile_model(CompileOptions(str(path), "host", quant, str(out), context_window=64, progress=False,
                                 quant_skip=list(skip), kv_dtype="f32"))
    session = Session(load_artifact(out))
    return session.prefill_all_logits(PROMPT)


def _cosine(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("quant", sorted(SCHEMES))
def test_every_scheme_compiles_and_tracks_the_float_model(odd_model, tmp_path, quant):
    root, model, ref = odd_model
    source = root / "hf" / "odd.gguf" if quant == "gguf" else root / "hf"
    logits = _compiled_logits(source, tmp_path / quant, quant)
    assert logits.shape == ref.shape
    assert _cosine(logits, ref) > MIN_COSINE.get(quant, MIN_COSINE_INT4)
    layout = SCHEMES[quant].layout
    if layout is not None:  # the compiled kernels compute exactly what numpy's quantize-dequantize predicts
        _, simulated, _ = reference_greedy(fake_quantized(model, layout), PROMPT, 1)
        assert np.abs(logits - simulated).max() < 1e-4 * np.abs(simulated).max()
    config = json.loads((tmp_path / quant / "mobilec-config.json").read_text())
    quantized = config["quantization"]["quantized_layers"]
    assert bool(quantized) == (SCHEMES[quant].kind == "group")


def test_int4_is_measurably_lossy(odd_model, tmp_path):
    """Negative control for the tolerance above: int4 must not look exact (else the test couldn't tell)."""
    root, _, ref = odd_model
    assert _cosine(_compiled_logits(root / "hf", tmp_path / "q4", "q4f16_g32"), ref) < 0.99999


def test_quant_skip_everything_gives_the_float_model(odd_model, tmp_path):
    root, _, ref = odd_model
    logits = _compiled_logits(root / "hf", tmp_path / "skip", "q4f16_g32", skip=["model", "lm_head"])
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    assert json.loads((tmp_path / "skip" / "mobilec-config.json").read_text())["quantization"]["quantized_layers"] == []


def test_quant_skip_one_block(odd_model, tmp_path):
    root, _, _ = odd_model
    compile_model(CompileOptions(str(root / "hf"), "host", "q4f16_g32", str(tmp_path / "a"), context_window=64,
                                 progress=False, kv_dtype="f32",
                                 quant_skip=["model.layers.0"]))
    layers = json.loads((tmp_path / "a" / "mobilec-config.json").read_text())["quantization"]["quantized_layers"]
    assert layers == ["lm_head", "model.embed_tokens"]
    index = json.loads((tmp_path / "a" / "params" / "index.json").read_text())
    names = {t["name"] for t in index["tensors"]}
    assert "model.layers.0.mlp.down_proj.weight" in names and "lm_head.q_weight" in names


def test_quant_skip_pattern_that_matches_nothing_is_an_error(odd_model, tmp_path):
    root, _, _ = odd_model
    with pytest.raises(MobilecError, match="matches no layer"):
        compile_model(CompileOptions(str(root / "hf"), "host", "q4f16_g32", str(tmp_path / "b"), progress=False,
                                     quant_skip=["model.layers.7"]))
    assert not (tmp_path / "b").exists()


def test_gguf_scheme_needs_a_gguf_checkpoint(odd_model, tmp_path):
    root, _, _ = odd_model
    with pytest.raises(MobilecError, match="GGUF"):
        compile_model(CompileOptions(str(root / "hf"), "host", "gguf", str(tmp_path / "c"), progress=False))
    assert not (tmp_path / "c").exists()
