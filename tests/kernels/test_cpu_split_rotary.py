"""A float KV cache's split + RoPE (cpu_attention.float_split_rotary) against TVM's own (llama_rope_with_position_map,
which it replaces): the same q, k and v for float32 and float16 caches, one token (decode, not handed to the thread
pool) and many (prefill), RoPE on and off, plain, Llama 3 and linear RoPE scaling; and ReplaceCPUAttention swapping it
in only where the importer recorded the RoPE (ROPE_ATTR with rope_theta) and a scaling it computes."""

import json

import numpy as np
import pytest
import tvm
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode
from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map

from compiler.kernels.cpu_attention import float_split_rotary, vector_lanes
from compiler.model_import.kv_cache_dtype import ROPE_ATTR
from compiler.passes.replace_cpu_attention import ReplaceCPUAttention
from tests.kernels.test_cpu_attention import AVX512, D, RUN, _tvm_cache_module
from tests.kernels.test_cpu_attention_int8 import LLAMA3

H_QO, H_KV, THETA = 9, 3, 10000.0

def _build(func):
    return tvm.tirx.build(tvm.IRModule({"main": func}), target=RUN)["main"]

def _split(func, qkv: np.ndarray, pos: np.ndarray, apply_rope: int, dtype: str):
    n = len(pos)
    q, k, v = (tvm.runtime.tensor(np.zeros((n, h, D), dtype)) for h in (H_QO, H_KV, H_KV))
    func(tvm.runtime.tensor(qkv), tvm.runtime.tensor(pos), q, k, v, apply_rope)
    return [x.numpy().astype("float32") for x in (q, k, v)]

@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("scale,scaling", [(1.0, {}), (1.0, LLAMA3), (0.25, {})], ids=["plain", "llama3", "linear"])
def test_float_split_rotary_equals_tvms(dtype, scale, scaling):
    ours = _build(float_split_rotary(H_QO, H_KV, D, dtype, THETA, scale, scaling))
    theirs = _build(llama_rope_with_position_map(THETA, scale, D, H_QO, H_KV, dtype, scaling))
    other_theta = _build(llama_rope_with_position_map(5e5, scale, D, H_QO, H_KV, dtype, scaling))
    rng = np.random.default_rng(7)
    tolerance = {"float32": 2e-6, "float16": 2e-3}[dtype]  # one rounding of the stored value
    for n in (1, 21):
        qkv = rng.standard_normal((n, H_QO + 2 * H_KV, D)).astype(dtype)
        pos = (np.arange(n) * 37 + 5).astype("int32")
        for apply_rope in (1, 0):
            got = _split(ours, qkv, pos, apply_rope, dtype)
            want = _split(theirs, qkv, pos, apply_rope, dtype)
            for a, b in zip(got, want):
                np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance)
            # v, and q and k without RoPE, are the input's rows
            np.testing.assert_array_equal(got[2], qkv[:, H_QO + H_KV:].astype("float32"))
            if not apply_rope:
                np.testing.assert_array_equal(got[0], qkv[:, :H_QO].astype("float32"))
        # negative control: another theta rotates otherwise
        assert np.abs(_split(other_theta, qkv, pos, 1, dtype)[0] - _split(ours, qkv, pos, 1, dtype)[0]).max() > 0.1

def test_pass_swaps_the_split_rotary_where_the_rope_is_recorded():
    mod = _tvm_cache_module(RopeMode.NORMAL)
    lanes = vector_lanes(AVX512)
    # without ROPE_ATTR (a module built by hand) TVM's stays
    assert ReplaceCPUAttention(lanes)(mod)["tir_split_rotary"].same_as(mod["tir_split_rotary"])
    recorded = mod.with_attr(ROPE_ATTR, json.dumps({"rope_scale": 1.0, "rope_scaling": {}, "rope_theta": THETA}))
    swapped = ReplaceCPUAttention(lanes)(recorded)["tir_split_rotary"]
    old = mod["tir_split_rotary"]
    tvm.ir.assert_structural_equal(swapped, float_split_rotary(H_QO, H_KV, D, "float32", THETA).with_attrs(
        {**dict(old.attrs), "tirx.noalias": True}))
    assert swapped.attrs["global_symbol"] == old.attrs["global_symbol"]
    # a scaling rope_angle does not compute keeps TVM's
    yarn = mod.with_attr(ROPE_ATTR, json.dumps({"rope_scale": 1.0, "rope_theta": THETA,
                                                "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    assert ReplaceCPUAttention(lanes)(yarn)["tir_split_rotary"].same_as(mod["tir_split_rotary"])
