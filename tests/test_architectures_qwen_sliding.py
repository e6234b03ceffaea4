"""Qwen2 / Qwen3 with use_sliding_window: tiny seeded random models (window 8, shorter than the sequences) compiled at
q0f32 against transformers' own (eager attention). Qwen2 with max_window_layers 1 mixes global and sliding layers
(TVM's "mha_sliding" kind, models/sliding_layers.py); Qwen3 with max_window_layers 0 slides on every layer (the
plain kernels' window, as Mistral's). Negative controls: the same weights without the window are far off."""

import numpy as np
import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from compiler.artifacts.artifact import load_artifact
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.kernels.cpu_attention import LAYER_SLIDING_WINDOW_ATTR, SLIDING_WINDOW_ATTR
from compiler.models.registry import family_for
from compiler.runtime.session import Session
from tests.helpers.pocl_device import NEEDS_OPENCL, ON_POCL
from tests.helpers.reference import reference_greedy
from tests.helpers.tiny_models import random_model, save_compilable_checkpoint

PROMPT = [3, 7, 1, 4, 4, 9, 2, 5, 6, 8, 10, 12, 40, 41, 7, 3, 99, 100, 5, 6]
GREEDY = 16
TOLERANCE = 1e-4
DIFFERS = 1e-2
_SHAPE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=50000.0,
              tie_word_embeddings=False, attn_implementation="eager")
MODELS = {  # name -> (transformers classes, config changes)
    "qwen2_mixed": (Qwen2ForCausalLM, Qwen2Config, dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3_all_sliding": (Qwen3ForCausalLM, Qwen3Config, dict(use_sliding_window=True, sliding_window=8,
                                                              max_window_layers=0, head_dim=16)),
}


def _model(name: str, **changes):
    model_cls, config_cls, fields = MODELS[name]
    return random_model(model_cls, config_cls(**{**_SHAPE, **fields, **changes}))


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_layer_types_are_transformers_own():
    """As transformers derives them (from max_window_layers on, where use_sliding_window), with its layer_types
    given or not; the window binds only past the context window."""
    for name, first in (("qwen2_mixed", 1), ("qwen3_all_sliding", 0)):
        hf = _model(name).config.to_dict()
        cfg = family_for(hf).config_class.from_hf(hf, 64)
        assert cfg.layer_types == tuple(hf["layer_types"]) and cfg.layer_types.index("sliding_attention") == first
        assert cfg.sliding_window == 8 and cfg.prefill_chunk_size == 8 and cfg.window_binds()
        older = {k: v for k, v in hf.items() if k != "layer_types"}
        assert family_for(older).config_class.from_hf(older, 64).layer_types == cfg.layer_types
        off = family_for(hf).config_class.from_hf({**older, "use_sliding_window": False}, 64)
        assert set(off.layer_types) == {"full_attention"} and off.sliding_window == 0 and not off.window_binds()
    model_cls = family_for(hf).model_class
    mixed = family_for(hf).config_class.from_hf(_model("qwen2_mixed").config.to_dict(), 64)
    assert model_cls(mixed).attention_attrs() == {LAYER_SLIDING_WINDOW_ATTR: 8}
    assert model_cls(mixed).kv_cache_attention()["attn_kind"] == ["mha", "mha_sliding", "mha_sliding"]
    every = family_for(hf).config_class.from_hf(_model("qwen3_all_sliding").config.to_dict(), 64)
    assert model_cls(every).attention_attrs() == {SLIDING_WINDOW_ATTR: 8}
    assert model_cls(every).kv_cache_attention()["attn_kind"] == "mha"


@pytest.mark.slow  # a compile of a tiny model and transformers: ~30 s each
@pytest.mark.parametrize("target", ["host", pytest.param("android-adreno", marks=NEEDS_OPENCL)])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_sliding_layers_match_transformers(tmp_path, name, target):
    """A 20-token prompt (in chunks of the window: the paged prefill and the merge) and 16 greedy decode steps, on the
    host and on android-adreno (PoCL, float32)."""
    model = _model(name)
    save_compilable_checkpoint(model, tmp_path / "hf")
    gpu = dict(ON_POCL, kv_dtype="f32") if target != "host" else {}
    compile_model(CompileOptions(str(tmp_path / "hf"), target, "q0f32", str(tmp_path / "artifact"),
                                 context_window=64, progress=False, **gpu))
    session = Session(load_artifact(tmp_path / "artifact"))
    ref_tokens, ref_prefill, ref_decode = reference_greedy(model, PROMPT, GREEDY)
    session.reset()
    prefill = session.prefill_all_logits(PROMPT)
    assert _rel_err(prefill, ref_prefill) < TOLERANCE
    for step, token in enumerate(ref_tokens[:-1]):
        assert _rel_err(session.decode(token), ref_decode[step]) < TOLERANCE, f"decode step {step}"
    _, no_window, _ = reference_greedy(_model(name, use_sliding_window=False), PROMPT, 1)
    assert _rel_err(prefill, no_window) > DIFFERS
