"""Quantized KV caches (int8, int4) under the attention of Gemma, Mistral and Phi-3: sliding-window layers beside
global ones (Gemma 3, Gemma 2), capped scores (Gemma 2), a window on every layer (Mistral, Phi-3) and RoPE applied by
the model (Gemma, Phi-3: the cache is RopeMode.NONE and our split kernel only splits and quantizes). Each tiny random
model is compiled for the host and run over a prompt longer than its window, 8 decode steps and a second prefill on
the cached tokens (tests/test_kv_cache_dtype.py's decode_against_transformers): within 1e-4 of transformers (eager
attention) with K/V quantized the same way. Negative controls: the quantization shows against the float model, and
the same model without its window (and Gemma 2 without its cap) is far off, so the kernels apply them. The same on
a GPU target (android-adreno on PoCL)."""

import pytest

from tests.helpers.pocl_device import NEEDS_OPENCL, ON_POCL
from tests.helpers.tiny_models import build_model
from tests.test_architectures_mistral_phi3 import _model as mistral_phi3_model
from tests.test_kv_cache_dtype import decode_against_transformers

NO_WINDOW = 1024  # a window no sequence here reaches
DIFFERS = 1e-2
# the largest relative difference from the float model's logits allowed per cache: these random weights (N(0, 0.5^2))
# show up to 7e-2 with int8 (mistral_window_8) and 0.7 with int4
TO_FLOAT = {"int8": 0.15, "int4": 1.0}


def _models(name: str, **changes):
    """(the model, its twins without each feature the kernels must apply: negative controls), with config
    `changes` for all of them."""
    if name.startswith("gemma"):
        controls = [build_model(name, **changes, sliding_window=NO_WINDOW)]
        if name == "gemma2":
            controls.append(build_model(name, **changes, attn_logit_softcapping=None))
        return build_model(name, **changes), controls
    return mistral_phi3_model(name, **changes), [mistral_phi3_model(name, **changes, sliding_window=None)]


def _assert_kernels_apply_it_all(decoded, kv_dtype: str) -> None:
    assert max(decoded.to_quantized) < 1e-4, decoded.to_quantized  # (PoCL's float32 sums too)
    assert 1e-4 < max(decoded.to_float) < TO_FLOAT[kv_dtype], decoded.to_float
    for control in decoded.to_controls:
        assert max(control) > DIFFERS, control


@pytest.mark.slow  # a compile of a tiny model and transformers: ~30 s each
@pytest.mark.parametrize("name, kv_dtype", [
    ("gemma3", "int8"), ("gemma2", "int8"), ("gemma2", "int4"),
    ("mistral_window_8", "int8"), ("phi3_window_12", "int8"), ("phi3_window_12", "int4"),
])
def test_quantized_cache_with_windows_and_caps_matches_transformers(tmp_path, name, kv_dtype):
    model, controls = _models(name)
    _assert_kernels_apply_it_all(decode_against_transformers(model, tmp_path, kv_dtype, controls=controls), kv_dtype)


@pytest.mark.slow  # a compile for a GPU target and PoCL: ~1 minute each
@NEEDS_OPENCL
@pytest.mark.parametrize("name", ["gemma2", "mistral_window_8"])
def test_quantized_cache_with_windows_on_a_gpu_target(tmp_path, name):
    """android-adreno on PoCL (float32 compute): the GPU kernels of an int8 cache apply Gemma 2's sliding layers (every
    page, masked by position) and cap, and Mistral's window; heads of 32 channels (TVM 0.27 does not build its GPU
    prefill kernels for the carrier of 16)."""
    model, controls = _models(name, head_dim=32)
    _assert_kernels_apply_it_all(decode_against_transformers(model, tmp_path, "int8", "android-adreno",
                                                             controls=controls, **ON_POCL), "int8")
