"""A quantized KV cache's GPU kernels (kernels/gpu_attention.py on kv_cache_dtype.Carrier: decode, ragged and
paged prefill, split + RoPE + quantize, merge of the real heads' states), built for android-adreno and run on PoCL
through the int8 and int4 CPU kernels' tests (tests/kernels/test_cpu_attention_int8.py, _int4.py), which check them
against numpy on the dequantized values and against TVM's split + RoPE, with their negative controls (a wrong
stored scale, min or code is caught)."""

import functools

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from compiler.kernels import gpu_attention
from compiler.kernels.cpu_attention import AttentionShape
from compiler.kernels.gpu_attention import (
    gpu_attention_decode,
    gpu_attention_prefill_paged,
    gpu_attention_prefill_ragged,
    gpu_carrier_merge_state,
    gpu_quantized_split_rotary,
)
from tests.kernels import test_cpu_attention_int4 as int4
from tests.kernels import test_cpu_attention_int8 as int8
from tests.kernels.test_cpu_attention import PAGE, ROPE_SCALE, ROPE_THETA, D
from tests.kernels.test_gpu_attention import _OnPocl, _needs_pocl  # noqa: F401  (the fixture skips without PoCL)

TESTS = {"int8": int8, "int4": int4}
ORIGINAL_BUILDS = {module.__name__: module._build for module in TESTS.values()}  # pylint: disable=protected-access


@functools.cache
def _gpu_kernel(kind: str, dtype: str):
    module = TESTS[dtype] if dtype in TESTS else int4
    shape = AttentionShape(module.H_KV, module.H_QO, D, dtype, PAGE)
    return _OnPocl({"decode": lambda: gpu_attention_decode(shape),
                    "ragged": lambda: gpu_attention_prefill_ragged(shape),
                    "paged": lambda: gpu_attention_prefill_paged(shape),
                    "split": lambda: gpu_quantized_split_rotary(shape, ROPE_THETA, ROPE_SCALE),
                    "merge": lambda: gpu_carrier_merge_state(shape)}[kind]())


@pytest.fixture(params=sorted(TESTS))
def on_gpu(request, monkeypatch):
    """The CPU tests' module for a dtype, its kernels the GPU ones."""
    module = TESTS[request.param]
    monkeypatch.setattr(module, "_build", lambda kind, dtype=request.param, lanes=None: _gpu_kernel(kind, dtype))
    return module


@pytest.mark.parametrize("ctx", [[1], [37], [130, 5]])
def test_decode_matches_numpy_on_dequantized_values(on_gpu, ctx):
    on_gpu.test_decode_matches_numpy_on_dequantized_values(ctx)


def test_decode_negative_controls(on_gpu):
    (on_gpu.test_decode_negative_control_wrong_scales if on_gpu is int8 else on_gpu.test_decode_negative_controls)()


@pytest.mark.parametrize("q_lens,causal", [([37], 1), ([20, 0, 7], 1), ([19, 6], 0)])
def test_ragged_prefill_matches_numpy(on_gpu, q_lens, causal):
    on_gpu.test_ragged_prefill_matches_numpy(q_lens, causal)


@pytest.mark.parametrize("q_lens,ctx", [([5], [37]), ([16, 3], [128, 45]), ([3, 4], [20, 0])])
def test_paged_prefill_matches_numpy(on_gpu, q_lens, ctx):
    on_gpu.test_paged_prefill_matches_numpy(q_lens, ctx)


def test_split_rotary_quantizes_k_after_rope_and_v(on_gpu):
    """Without RoPE, the CPU test as it is; with it, the CPU kernel's results within the device's float32 cos and
    sin (PoCL's differ from LLVM's libm by up to 2e-4 at position 777, as TVM's own GPU split would): q within 3e-4,
    codes within one step, scales within 1e-3; negative control: RoPE shows."""
    on_gpu.test_split_rotary_quantizes_k_after_rope_and_v(0)
    n = 21
    qkv = np.random.default_rng(3).standard_normal((n, on_gpu.H_QO + 2 * on_gpu.H_KV, D)).astype("float32")
    pos = (np.arange(n) * 37 + 5).astype("int32")

    def split(build, apply_rope):
        q = np.zeros((n, on_gpu.HQ_DECL, on_gpu.CELL), "float32")
        k, v = (np.zeros((n, on_gpu.HKV_DECL, on_gpu.CELL), "float32") for _ in range(2))
        args = [tvm.runtime.tensor(x) for x in (qkv.reshape(n, on_gpu.CARRIER.fused_rows, on_gpu.CELL), pos, q, k, v)]
        build("split")(*args, apply_rope)
        return [a.numpy() for a in args[2:]]

    (q, k, v), (cpu_q, cpu_k, cpu_v) = split(on_gpu._build, 1), split(ORIGINAL_BUILDS[on_gpu.__name__], 1)
    np.testing.assert_allclose(q, cpu_q, atol=3e-4)
    params = slice(on_gpu.H_KV, None)
    for got, want in ((k, cpu_k), (v, cpu_v)):
        np.testing.assert_allclose(got[:, params], want[:, params], rtol=1e-3, atol=1e-6)
        codes = got[:, :on_gpu.H_KV].view("uint8" if on_gpu is int4 else "int8").astype(int)
        want_codes = want[:, :on_gpu.H_KV].view("uint8" if on_gpu is int4 else "int8").astype(int)
        if on_gpu is int4:  # two nibbles a byte
            codes, want_codes = (np.stack([c & 15, c >> 4]) for c in (codes, want_codes))
        assert np.abs(codes - want_codes).max() <= 1
    assert np.abs(split(on_gpu._build, 0)[0] - q).max() > 0.1



def test_split_rotary_writes_every_carrier_cell(on_gpu, monkeypatch):
    """TVM's append copies whole declared K/V rows into the pages, so the split writes every cell of their
    parameter rows (the code rows are whole cells of codes), the unused ones as 0 (they start as NaN here); negative
    control: without param_padding_zeroer (a macro that writes nothing) the GPU split leaves NaN in them."""
    n = 5
    qkv = np.random.default_rng(4).standard_normal((n, on_gpu.CARRIER.fused_rows, on_gpu.CELL)).astype("float32")

    def split(build):
        q = np.zeros((n, on_gpu.HQ_DECL, on_gpu.CELL), "float32")
        k, v = (np.full((n, on_gpu.HKV_DECL, on_gpu.CELL), np.nan, "float32") for _ in range(2))
        args = [tvm.runtime.tensor(x) for x in (qkv, np.arange(n, dtype="int32"), q, k, v)]
        build(*args, 1)
        return [a.numpy()[:, on_gpu.H_KV:].reshape(n, -1) for a in args[3:]]  # the parameter cells

    shape = on_gpu.SHAPE
    for k, v in (split(_gpu_kernel("split", shape.dtype)), split(ORIGINAL_BUILDS[on_gpu.__name__]("split"))):
        assert not np.isnan(k).any() and not np.isnan(v).any()
        for params, kv in ((k, 0), (v, 1)):
            assert (params[:, on_gpu.H_KV * on_gpu.CARRIER.row_params(kv):] == 0).all()

    @T.macro
    def writes_nothing(params, s):  # pylint: disable=unused-argument
        T.evaluate(0)

    monkeypatch.setattr(gpu_attention, "param_padding_zeroer", lambda shape, kv: writes_nothing)
    # the factory itself: parse_cache would answer with the kernel built above
    assert np.isnan(np.concatenate(split(_OnPocl(gpu_quantized_split_rotary.__wrapped__(shape, ROPE_THETA,
                                                                                      ROPE_SCALE))))).any()
