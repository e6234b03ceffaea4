"""Tiny Qwen3 and Gemma 3 for android-adreno on this machine's OpenCL (PoCL, float32): the build whose norms run
inside the decode GEMVs (passes/fuse_gemv_norms.py: the input norm before, Gemma 3's post-norm with its residual add
before that, written again as the residual stream; the q/k norm per head after, and Gemma's RoPE after that) gives
the unfused build's greedy tokens, and its prompt and decode logits within 1e-5 relative. Likewise Llama, Qwen3 and
Gemma 3 with each input norm inside the prefill GEMM that reads it (passes/fuse_gemm_norms.py), and Gemma 3's last
post-feedforward norm inside the final norm's kernel (passes/fuse_norm_pairs.py)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from compiler.artifacts.artifact import load_artifact
from compiler.codegen import pipeline
from compiler.commands.compile_model import CompileOptions, compile_model
from tests.helpers.pocl_device import NEEDS_OPENCL, ON_POCL
from tests.helpers.reference import artifact_greedy
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

# two compiles per family (~45 s each here); the fused kernels' numerics are in tests/passes/test_fuse_gemv_norms.py
pytestmark = [NEEDS_OPENCL, pytest.mark.extended]

PROMPT = [3, 7, 1, 4, 4, 9, 2, 5]
STEPS = 8


def _build(checkpoint, out, prompt: list[int], function: str | None = None, target: str = "android-adreno"
           ) -> tuple[np.ndarray, list[int], list[str]]:
    """`checkpoint`'s `target` artifact in `out`, on PoCL: its logits and greedy tokens after `prompt`, and its
    kernels (each that `function` calls, if given)."""
    compile_model(CompileOptions(str(checkpoint), target, "q4f32_g32", str(out), context_window=64,
                                 progress=False, kv_dtype="f32", **ON_POCL))
    sites = load_artifact(out).config["call_sites"]
    kernels = sites["kernels"]
    if function is not None:
        kernels = list(dict.fromkeys(name for name, _ in sites["functions"][function]))
    return (*artifact_greedy(out, prompt, STEPS)[:2], kernels)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_fused_norms_decode_the_unfused_builds_tokens(tmp_path, monkeypatch, family):
    checkpoint = save_compilable_checkpoint(build_model(family), tmp_path / "hf")
    fused_logits, fused_tokens, fused_kernels = _build(checkpoint, tmp_path / "fused", PROMPT, "decode")
    monkeypatch.setattr(pipeline, "FuseGEMVNorms", lambda _: tvm.transform.Sequential([]))
    logits, tokens, kernels = _build(checkpoint, tmp_path / "unfused", PROMPT, "decode")
    # decode's q/k norm inside the QKV GEMV in one build only (prefill's is inside the QKV GEMM in both)
    assert [any("_then_qk_norm" in k for k in names) for names in (fused_kernels, kernels)] == [True, False]
    # Gemma 3: its post-norms with their residual adds inside the next GEMVs (gate/up, the next layer's QKV, lm_head)
    residual = [sum(k.count("_after_") == 2 for k in names) for names in (fused_kernels, kernels)]
    assert residual == ([3, 0] if family == "gemma3" else [0, 0]), fused_kernels
    assert fused_tokens == tokens
    np.testing.assert_allclose(fused_logits, logits, rtol=0, atol=1e-5 * np.abs(logits).max())
    # Negative control: the comparison sees a wrong step (the logits move from step to step).
    assert np.abs(fused_logits[1:] - logits[:-1]).max() > 1e-3 * np.abs(logits).max()


# more rows than one work group's tile of a prefill GEMM on android-adreno (8) and android-mali (32)
LONG_PROMPT = [(7 * i + 3) % 50 + 1 for i in range(37)]


@pytest.mark.parametrize("family,target,changes", [
    ("llama_gqa", "android-adreno", {}), ("qwen3", "android-adreno", {}), ("gemma3", "android-adreno", {}),
    ("gemma3", "android-mali", {}),
    # heads of 128, wider than android-mali's GEMM tile (64 columns), which the rule widens for the q/k norm
    ("qwen3", "android-mali", {"head_dim": 128}), ("gemma3", "android-mali", {"head_dim": 128})])
def test_norms_inside_prefill_gemms_give_the_unfused_builds_logits(tmp_path, monkeypatch, family, target, changes):
    checkpoint = save_compilable_checkpoint(build_model(family, **changes), tmp_path / "hf")
    fused_logits, fused_tokens, fused_kernels = _build(checkpoint, tmp_path / "fused", LONG_PROMPT, target=target)
    monkeypatch.setattr(pipeline, "FuseGEMMNorms", lambda _: tvm.transform.Sequential([]))
    logits, tokens, kernels = _build(checkpoint, tmp_path / "unfused", LONG_PROMPT, target=target)
    # the QKV and gate/up GEMMs of prefill with their norms, in one build only
    only_fused = set(fused_kernels) - set(kernels)
    assert len(only_fused) >= 2 and all("NT_matmul" in k and "_after_" in k for k in only_fused), only_fused
    # the q/k norm inside the QKV GEMM, and Gemma 3's RoPE after it, in one build only
    assert any("_then_qk_norm" in k for k in only_fused) == (family != "llama_gqa"), only_fused
    assert [any("rotary_embedding" in k for k in names) for names in (fused_kernels, kernels)] == \
        [False, family == "gemma3"]
    assert fused_tokens == tokens
    np.testing.assert_allclose(fused_logits, logits, rtol=0, atol=1e-5 * np.abs(logits).max())
    # Negative control: the comparison sees a wrong step (the logits move from step to step).
    assert np.abs(fused_logits[1:] - logits[:-1]).max() > 1e-3 * np.abs(logits).max()


def test_the_last_post_norm_inside_the_final_norm_gives_the_unpaired_builds_logits(tmp_path, monkeypatch):
    """Gemma 3's last post-feedforward norm with its residual add inside the final norm's kernel
    (passes/fuse_norm_pairs.py): prefill's logits (and the decode steps after it) within 1e-5 relative of the build
    that keeps them apart, the same greedy tokens."""
    checkpoint = save_compilable_checkpoint(build_model("gemma3"), tmp_path / "hf")
    paired_logits, paired_tokens, paired_kernels = _build(checkpoint, tmp_path / "paired", LONG_PROMPT, "prefill")
    monkeypatch.setattr(pipeline, "FuseNormPairs", lambda _: tvm.transform.Sequential([]))
    logits, tokens, kernels = _build(checkpoint, tmp_path / "apart", LONG_PROMPT, "prefill")
    # one norm kernel fewer in prefill: the pair's in place of the final norm's and the post-norm's
    only_paired, only_apart = set(paired_kernels) - set(kernels), set(kernels) - set(paired_kernels)
    assert len(only_paired) == 1 and next(iter(only_paired)).count("rms_norm") == 2, only_paired
    assert len(only_apart) == 2 and all("rms_norm" in k and "NT_matmul" not in k for k in only_apart), only_apart
    assert paired_tokens == tokens
    np.testing.assert_allclose(paired_logits, logits, rtol=0, atol=1e-5 * np.abs(logits).max())
    # Negative control: the comparison sees a wrong step (the logits move from step to step).
    assert np.abs(paired_logits[1:] - logits[:-1]).max() > 1e-3 * np.abs(logits).max()
