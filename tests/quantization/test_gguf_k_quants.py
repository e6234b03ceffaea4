"""GGUF K-quants (Q4_K, Q5_K, Q6_K) re-laid by gguf_blocks.py: the stored values equal gguf's reference
dequantizer bit for bit (numpy reference, the TE dequantize the kernels inline, the embedding lookup), also when
layers of different types are joined; the integer-dot GEMV takes the Q4_K / Q5_K layouts (numerics on the families
this CPU runs, assembly for the others). Blocks are random bytes with chosen fp16 d / dmin (gguf cannot quantize
K-quants) plus edge cases, and blocks packed from floats by tests/helpers/k_quants.py."""

import re

import gguf
import numpy as np
import pytest
import tvm
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize
from tvm import te

from compiler.kernels.integer_dot_gemv import GemvShape
from compiler.quantization import dequantize_te as D
from compiler.quantization import group as G
from compiler.quantization.gguf_blocks import LAYOUTS, convert_blocks, layout_for
from compiler.quantization.group import GroupLayout
from tests.helpers import k_quants
from tests.helpers.assertions import assert_mobilec_error
from tests.helpers.cpu import X86_FAMILY_TARGETS, assembly, runs_here
from tests.kernels.test_integer_dot_gemv import ARM_FAMILY_TARGETS, _module, _run

Q = gguf.GGMLQuantizationType
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]
ROWS, SUPERS = 6, 2
K = SUPERS * 256
FP16_MAX = np.float16(65504)


def _set_fp16(blocks: np.ndarray, offset: int, values) -> None:
    blocks[..., offset:offset + 2] = np.asarray(values, np.float16)[..., None].view(np.uint8)


def random_blocks(ggml_type: str, seed: int = 0) -> np.ndarray:
    """[ROWS, bytes] of valid blocks: random codes and 6/8-bit scales, fp16 d (and dmin) of both signs. Row 0 is
    all zero bytes; row 1 the largest scales, mins and codes with d = dmin = 65504 (Q6_K: scales -128 and 127);
    row 2 subnormal fp16 d and dmin."""
    qtype = Q[ggml_type]
    size = GGML_QUANT_SIZES[qtype][1]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (ROWS, SUPERS, size), dtype=np.uint8)
    d_offsets = [208] if ggml_type == "Q6_K" else [0, 2]
    for offset in d_offsets:
        _set_fp16(blocks, offset, rng.standard_normal((ROWS, SUPERS)) * 1e-2)
        _set_fp16(blocks[1], offset, FP16_MAX)
        _set_fp16(blocks[2], offset, [np.float16(2.0**-24), np.float16(-(2.0**-20))])
    blocks[0] = 0
    blocks[1, :, :208 if ggml_type == "Q6_K" else size] = 0xFF
    if ggml_type == "Q6_K":
        blocks[1, :, 192:208] = np.tile(np.array([-128, 127], np.int8), 8).view(np.uint8)
    else:
        _set_fp16(blocks[1], 0, FP16_MAX)
        _set_fp16(blocks[1], 2, FP16_MAX)
    return blocks.reshape(ROWS, -1)


def _reference(ggml_type: str, raw: np.ndarray) -> np.ndarray:
    return dequantize(np.ascontiguousarray(raw), Q[ggml_type]).reshape(raw.shape[0], -1)


def _te_dequantize(layout: GroupLayout, arrays: dict, k: int, ids: np.ndarray | None = None) -> np.ndarray:
    """The compiled TE dequantize (or, with `ids`, the embedding lookup) of the stored arrays, in float32."""
    names = [n for n in ("q_weight", "q_scale", "q_min") if n in arrays]
    ph = [te.placeholder(arrays[n].shape, str(arrays[n].dtype), n) for n in names]
    inputs = [tvm.runtime.tensor(arrays[n]) for n in names]
    if ids is None:
        out = D.dequantize_te(layout, k, "float32")(*ph)
        args, rows = ph, arrays["q_weight"].shape[0]
    else:
        ph_ids = te.placeholder(ids.shape, "int32", "ids")
        out = D.take_dequantize_te(layout, k, "float32")(ph_ids, *ph)
        args, rows = [ph_ids, *ph], len(ids)
        inputs = [tvm.runtime.tensor(ids), *inputs]
    lib = tvm.compile(te.create_prim_func([*args, out]), target="llvm")
    result = tvm.runtime.tensor(np.zeros((rows, k), np.float32))
    lib(*inputs, result)
    return result.numpy()


@pytest.mark.parametrize("ggml_type", K_QUANTS)
def test_random_blocks_keep_gguf_values_bit_for_bit(ggml_type):
    raw = random_blocks(ggml_type)
    want = _reference(ggml_type, raw)
    assert np.isfinite(want).all() and np.abs(want[1]).max() > 1e7 and np.abs(want[2]).max() < 1e-2
    assert not want[0].any() and (want[3:] < 0).any() and (want[3:] > 0).any()
    layout = LAYOUTS[ggml_type]
    arrays = convert_blocks(ggml_type, raw, layout)
    assert {n: (a.shape, str(a.dtype)) for n, a in arrays.items()} == layout.shapes(ROWS, K)
    np.testing.assert_array_equal(G.dequantize(arrays, layout, K), want)
    np.testing.assert_array_equal(_te_dequantize(layout, arrays, K), want)
    ids = np.array([5, 1, 1, 0, 2], np.int32)  # embedding rows, repeated and out of order
    np.testing.assert_array_equal(_te_dequantize(layout, arrays, K, ids), want[ids])


@pytest.mark.parametrize("ggml_type", K_QUANTS)
def test_a_swapped_scale_or_code_is_caught(ggml_type):
    """Negative controls: a converter that read one scale nibble (Q4_K/Q5_K: sub-block 4's sc and m nibbles; Q6_K:
    the scales of sub-blocks 0 and 1) or one fifth / high code bit in the wrong place would fail the test above."""
    raw = random_blocks(ggml_type, seed=1)
    want = _reference(ggml_type, raw)
    blocks = raw.reshape(ROWS, SUPERS, -1).copy()
    if ggml_type == "Q6_K":
        blocks[..., [192, 193]] = blocks[..., [193, 192]]
    else:
        blocks[..., 12] = (blocks[..., 12] >> 4) | (blocks[..., 12] << 4)
    code_byte = {"Q4_K": 50, "Q5_K": 20, "Q6_K": 150}[ggml_type]  # a nibble byte, a fifth-bit byte, a high-bits byte
    flipped = raw.reshape(ROWS, SUPERS, -1).copy()
    flipped[..., code_byte] ^= 0x10
    layout = LAYOUTS[ggml_type]
    for wrong in (blocks, flipped):
        got = G.dequantize(convert_blocks(ggml_type, wrong.reshape(ROWS, -1), layout), layout, K)
        differs = (got != want).any(axis=1)
        assert differs[3:].all(), ggml_type  # random rows: every one is caught


@pytest.mark.parametrize("ggml_type", K_QUANTS)
def test_test_quantizer_makes_blocks_gguf_reads_as_the_floats(ggml_type):
    """tests/helpers/k_quants.py (used for the tiny K-quant Llama) packs what gguf dequantizes back to the floats,
    within half a step of each sub-block plus the 6-bit rounding of its scale."""
    w = np.random.default_rng(2).standard_normal((ROWS, K)).astype(np.float32)
    w[0] = 0
    w[1, :256] = -np.abs(w[1, :256])  # a super-block of negative values only
    raw = k_quants.quantize(w, Q[ggml_type])
    want = _reference(ggml_type, raw)
    bound = {"Q4_K": 0.3, "Q5_K": 0.15, "Q6_K": 0.08}[ggml_type]
    assert np.abs(want - w).max() < bound and not want[0].any()
    assert np.abs(k_quants.quantize(np.roll(w, 1, axis=1), Q[ggml_type]) - raw).max() > 0  # the data matters
    layout = LAYOUTS[ggml_type]
    np.testing.assert_array_equal(G.dequantize(convert_blocks(ggml_type, raw, layout), layout, K), want)


@pytest.mark.parametrize("types, joined", [
    (("Q4_K", "Q4_K", "Q6_K"), GroupLayout(8, 16, False, "float32")),  # Q4_K_M: q, k Q4_K and v Q6_K
    (("Q5_K", "Q6_K"), GroupLayout(8, 16, False, "float32")),
    (("Q4_K", "Q5_K"), GroupLayout(8, 32, False, "float32")),
    (("Q4_0", "Q4_K"), GroupLayout(4, 32, False, "float32")),
    (("Q8_0", "Q6_K", "Q4_1"), GroupLayout(8, 16, False, "float32")),
    (("Q6_K", "Q6_K"), LAYOUTS["Q6_K"]),
])  # fmt: skip
def test_joined_layers_of_mixed_types_keep_every_value(types, joined):
    names = {f"model.layers.0.part{i}.weight": t for i, t in enumerate(types)}
    assert layout_for(names, "model.layers.0.joined") == joined
    rng = np.random.default_rng(3)
    parts, wants = [], []
    for i, t in enumerate(types):
        if t in K_QUANTS:
            raw = random_blocks(t, seed=10 + i)
        else:  # gguf quantizes the 32-value types itself
            raw = gguf.quants.quantize(rng.standard_normal((ROWS, K)).astype(np.float32), Q[t]).reshape(ROWS, -1)
        parts.append(convert_blocks(t, raw, joined))
        wants.append(_reference(t, raw))
    arrays = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    want = np.concatenate(wants)
    np.testing.assert_array_equal(G.dequantize(arrays, joined, K), want)
    np.testing.assert_array_equal(_te_dequantize(joined, arrays, K), want)


def test_types_it_cannot_keep_are_refused_in_one_line():
    assert_mobilec_error(lambda: layout_for({"blk.0.attn_q.weight": "IQ4_XS"}, "q"), "IQ4_XS",
                         "Q4_K, Q5_K, Q6_K", "--quant q4f16_g32_asym")
    assert_mobilec_error(lambda: layout_for({"a.weight": "F32", "b.weight": "Q4_K"}, "model.layers.0.mlp.gate_up"),
                         "model.layers.0.mlp.gate_up", "F32", "Q4_K")
    assert layout_for({"a.weight": "F16", "b.weight": "F32"}, "x") is None


# --- the integer-dot decode GEMV on the K-quant layouts ---

N = 48
RUNNABLE = [pytest.param(f, marks=pytest.mark.skipif(not runs_here(t), reason=f"this CPU cannot run {f} code"))
            for f, t in X86_FAMILY_TARGETS.items()]


def _gemv_case(ggml_type: str, act_bits: int, dot_family: str):
    rng = np.random.default_rng(4)
    raw = k_quants.quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.1, Q[ggml_type])
    layout = LAYOUTS[ggml_type]
    shape = GemvShape(N, K, layout.bits, layout.group, layout.symmetric, layout.scale_dtype, act_bits, dot_family,
                      layout.zero_code)
    x = rng.standard_normal(K).astype(np.float32)
    x[7] = 30.0  # an outlier, as hidden states have
    return shape, convert_blocks(ggml_type, raw, layout), x, _reference(ggml_type, raw)


@pytest.mark.parametrize("dot_family", RUNNABLE)
@pytest.mark.parametrize("ggml_type,act_bits", [("Q4_K", 16), ("Q4_K", 8), ("Q5_K", 16), ("Q6_K", 16), ("Q6_K", 8)])
def test_integer_dot_gemv_on_k_quants_matches_gguf_values_times_x(ggml_type, act_bits, dot_family):
    shape, arrays, x, weights = _gemv_case(ggml_type, act_bits, dot_family)
    ref = weights @ x
    assert shape.supported()
    lib = tvm.tirx.build(_module(shape), target=X86_FAMILY_TARGETS[dot_family])
    got = _run(lib, shape, x, arrays)
    tol = (2e-4 if act_bits == 16 else 2e-2) * np.abs(ref).max()  # activation rounding: 1/65534 or 1/254 per block
    assert np.abs(got - ref).max() < tol
    # and exactly what the rounded activations give, up to float32 sums: the rounding is the only difference
    blocks = x.reshape(-1, 32)
    step = np.abs(blocks).max(axis=1, keepdims=True) / shape.qmax
    rounded = weights @ (np.round(blocks / step) * step).reshape(-1)
    assert np.abs(got - rounded).max() < (1e-5 if act_bits == 16 else 1e-4) * np.abs(rounded).max()
    # negative controls: one group's float32 min (Q6_K: scale) off by 1 changes that row alone; Q6_K: a block's two
    # half scales swapped (a kernel that used one scale per block, or the wrong half, fails like this)
    name = "q_min" if "q_min" in arrays else "q_scale"
    for group in (0, 1):  # Q6_K: both halves of the first block
        changed = dict(arrays, **{name: arrays[name].copy()})
        changed[name][5, group] += 1.0
        diff = np.abs(_run(lib, shape, x, changed) - ref)
        assert diff[5] > 5 * tol and np.delete(diff, 5).max() < tol
    if ggml_type == "Q6_K":
        swapped = dict(arrays, q_scale=arrays["q_scale"].copy())
        swapped["q_scale"][:, [0, 1]] = swapped["q_scale"][:, [1, 0]]
        assert np.abs(_run(lib, shape, x, swapped) - ref).max() > 5 * tol


@pytest.mark.parametrize("dot_family", list(X86_FAMILY_TARGETS) + list(ARM_FAMILY_TARGETS))
@pytest.mark.parametrize("ggml_type", K_QUANTS)
def test_every_family_builds_k_quant_gemvs(dot_family, ggml_type):
    """Built, not run, for every x86 and aarch64 family with int16 activations: its dot instructions read the
    layout (aarch64: Q6_K's 16-value groups a block per step, two lanes per half; Q5_K's 8-bit asymmetric codes on
    dotprod centred, the 128 joining each step's mins)."""
    target = {**X86_FAMILY_TARGETS, **ARM_FAMILY_TARGETS}[dot_family]
    layout = LAYOUTS[ggml_type]
    shape = GemvShape(N, K, layout.bits, layout.group, layout.symmetric, layout.scale_dtype, 16, dot_family,
                      layout.zero_code)
    assert shape.supported()
    asm = assembly(tvm.tirx.build(_module(shape), target=target))
    instruction = "vpmaddwd" if dot_family in X86_FAMILY_TARGETS else "s?u?s?dot"
    assert re.search(rf"\b{instruction}\b", asm), dot_family


def test_int8_activations_leave_centred_asymmetric_8_bit_k_quants_to_the_float_gemv_on_x86():
    """Asymmetric 8-bit codes where the family centres codes about 128 (int8 activations on AVX2 or AVX-512BW
    without VNNI) are not integer-dot shapes on x86, whose mins' term comes once per row: IntegerDotGEMV leaves Q5_K
    there to the float GEMV. Centred symmetric codes about 32 (Q6_K) keep 96 of each code's offset in the
    activation sums; dotprod's steps take Q5_K's centring into their mins (arm.py: mins per step)."""
    for ggml_type in ("Q5_K", "Q6_K"):
        lay = LAYOUTS[ggml_type]
        for dot_family in ("avx2", "avx512bw", "avxvnni", "dotprod"):
            shape = GemvShape(N, K, lay.bits, lay.group, lay.symmetric, lay.scale_dtype, 8, dot_family, lay.zero_code)
            assert shape.supported() == (ggml_type == "Q6_K" or dot_family in ("avxvnni", "dotprod")), \
                (ggml_type, dot_family)  # vpdpbusd: uncentred