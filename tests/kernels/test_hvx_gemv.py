"""The HVX decode GEMV (native/hexagon/hvx_gemv.c) on the emulated Hexagon DSP (qemu-hexagon, CPU v69): GGUF
Q4_0, Q4_1, Q8_0 blocks quantized by the gguf package, K-quants (Q4_K, Q5_K, Q6_K, and a Q4_K_M file's q/k/v
joined with a Q6_K v) packed by tests/helpers/k_quants.py, and our own g32 and g128 schemes, against numpy, with
negative controls."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from tvm import tirx
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from compiler.codegen import hexagon
from compiler.errors import MobilecError
from compiler.kernels import hvx_gemv
from compiler.quantization import hvx_blocks
from compiler.quantization.gguf_blocks import LAYOUTS, convert_blocks, convert_joined, layout_for
from compiler.quantization.group import GroupLayout, dequantize, quantize
from compiler.target.targets import load_target
from compiler.testing import emulated_hexagon
from tests.helpers import k_quants


pytestmark = pytest.mark.skipif(not emulated_hexagon.ready(), reason="scripts/fetch_qemu_hexagon.sh installs it")
# (n, k): whole tiles and pairs; rows that are not a whole tile and an odd number of blocks (K = 96, 160: not a
# multiple of the 128-byte vector either); SmolLM2's K
SHAPES = [(64, 256), (40, 96), (33, 160), (32, 576)]
GGUF_TYPES = ["Q4_0", "Q4_1", "Q8_0"]


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    with emulated_hexagon.Device(emulated_hexagon.build_device(tmp_path_factory.mktemp("hvx")), 8 << 20) as running:
        yield running


K_QUANT_TYPES = ["Q4_K", "Q5_K", "Q6_K"]
ROWS_Q6 = 32  # the Q6_K rows of _mixed_weight


def _raw_blocks(ggml_type: str, n: int, k: int, rng) -> np.ndarray:
    """Random weights [n, k] as GGUF blocks: the gguf package's quantizer, or k_quants' for K-quants (gguf has
    none)."""
    qtype = GGMLQuantizationType[ggml_type]
    weights = rng.standard_normal((n, k)).astype(np.float32)
    return k_quants.quantize(weights, qtype) if ggml_type in K_QUANT_TYPES else gguf_quantize(weights, qtype)


def _gguf_weight(ggml_type: str, n: int, k: int, rng) -> tuple[dict[str, np.ndarray], GroupLayout, np.ndarray]:
    """Random weights as GGUF blocks: (our arrays, layout, gguf's own dequantized values)."""
    raw = _raw_blocks(ggml_type, n, k, rng)
    layout = LAYOUTS[ggml_type]
    return convert_blocks(ggml_type, raw, layout), layout, gguf_dequantize(raw, GGMLQuantizationType[ggml_type])


def _mixed_weight(n: int, k: int, rng) -> tuple[dict[str, np.ndarray], GroupLayout, np.ndarray]:
    """A Q4_K_M file's q/k/v: Q4_K rows joined with Q6_K rows, in the layout that holds both (8-bit asymmetric codes
    with a float32 scale and min per 16 values)."""
    parts = [(t, _raw_blocks(t, rows, k, rng)) for t, rows in (("Q4_K", n - ROWS_Q6), ("Q6_K", ROWS_Q6))]
    layout = layout_for({t: t for t, _ in parts}, "qkv")
    w = np.concatenate([gguf_dequantize(raw, GGMLQuantizationType[t]) for t, raw in parts])
    return convert_joined(parts, layout), layout, w


def _reference(w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W x with the activations as the kernel quantizes them, in float64; |W| |x|, the scale of its error)."""
    q, scale = hvx_gemv.quantize_blocks(x)
    xq = (q.astype(np.float64) * scale[:, None]).reshape(-1)[:x.shape[0]]
    return w.astype(np.float64) @ xq, np.abs(w.astype(np.float64)) @ np.abs(xq)


def _check(device, weights: hvx_blocks.HvxWeights, w: np.ndarray, x: np.ndarray) -> float:
    """Runs the kernel; its integer sums must equal the numpy model's; returns its largest error relative to |W| |x|."""
    y, acc, acc_mins = hvx_gemv.run(device, weights, x)
    model_acc, model_mins = hvx_gemv.model(weights, hvx_gemv.quantize_activations(x, weights.halves)[0])
    np.testing.assert_array_equal(acc, model_acc)
    np.testing.assert_array_equal(acc_mins, model_mins)
    expected, scale = _reference(w, x)
    return float(np.max(np.abs(y - expected) / scale))


# Fixed-point scales (16 bits, per row / per vector) and the rounding of each block's term: ~1e-5 of |W| |x|
# measured (K-quants: 1e-5 to 6e-5); the int8 activations' own error is ~1.5e-3 of it, 30x more.
TOLERANCE = 1e-4
# Q6_K's codes about 32 stored asymmetric (a Q4_K_M q/k/v, _mixed_weight) with a min of -32 s: the dot term, twice
# the weights' size, cancels against the mins' term, and so does its rounding: 1.2e-4 to 1.6e-4 measured.
MIXED_TOLERANCE = 2.5e-4


@pytest.mark.parametrize("ggml_type", GGUF_TYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_gguf_blocks(device, ggml_type, n, k):
    rng = np.random.default_rng(n * k)
    arrays, layout, w = _gguf_weight(ggml_type, n, k, rng)
    assert _check(device, hvx_blocks.relayout(arrays, layout, k), w, rng.standard_normal(k).astype(np.float32)) \
        < TOLERANCE


@pytest.mark.parametrize("layout", [GroupLayout(4, 32, True, "float16"), GroupLayout(4, 32, False, "float16"),
                                    GroupLayout(8, 32, False, "float16")], ids=lambda layout: layout.describe())
def test_our_group_schemes(device, layout):
    rng = np.random.default_rng(7)
    n, k = 48, 320
    arrays = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, layout)
    w = dequantize(arrays, layout, k)
    assert _check(device, hvx_blocks.relayout(arrays, layout, k), w, rng.standard_normal(k).astype(np.float32)) \
        < TOLERANCE


@pytest.mark.parametrize("ggml_type", K_QUANT_TYPES)
@pytest.mark.parametrize("n,k", [(64, 256), (40, 512)])
def test_k_quants(device, ggml_type, n, k):
    """K-quants' float32 scales d sc (and mins) in the kernel's 16-bit fixed point, Q6_K's per 16 values (halves)."""
    rng = np.random.default_rng(n * k + len(ggml_type))
    arrays, layout, w = _gguf_weight(ggml_type, n, k, rng)
    weights = hvx_blocks.relayout(arrays, layout, k)
    assert weights.halves == (ggml_type == "Q6_K")
    assert _check(device, weights, w, rng.standard_normal(k).astype(np.float32)) < TOLERANCE


def test_q4_k_m_joined_qkv(device):
    rng = np.random.default_rng(5)
    arrays, layout, w = _mixed_weight(64, 256, rng)
    assert (layout.bits, layout.group, layout.symmetric) == (8, 16, False)
    x = rng.standard_normal(256).astype(np.float32)
    assert _check(device, hvx_blocks.relayout(arrays, layout, 256), w, x) < MIXED_TOLERANCE


@pytest.mark.parametrize("layout", [GroupLayout(4, 128, True, "float16"), GroupLayout(8, 128, True, "float16"),
                                    GroupLayout(4, 128, False, "float16")], ids=lambda layout: layout.describe())
@pytest.mark.parametrize("k", [320, 576])
def test_g128_schemes(device, layout, k):
    """Groups of 128 (K = 320, 576: the last group shorter) with their scale repeated for each 32-value block."""
    rng = np.random.default_rng(k)
    arrays = quantize(rng.standard_normal((48, k)).astype(np.float32) * 0.05, layout)
    w = dequantize(arrays, layout, k)
    assert _check(device, hvx_blocks.relayout(arrays, layout, k), w, rng.standard_normal(k).astype(np.float32)) \
        < TOLERANCE


@pytest.mark.parametrize("ggml_type", ["Q6_K", "mixed"])
def test_negative_controls_halves(device, ggml_type):
    """A scale per 16 values: one half block's scale (or min) made wrong, or the two halves' scales of a block
    swapped in the re-laid record, must give wrong numbers."""
    rng = np.random.default_rng(9)
    n, k = 64, 256
    arrays, layout, w = _mixed_weight(n, k, rng) if ggml_type == "mixed" else _gguf_weight(ggml_type, n, k, rng)
    tolerance = MIXED_TOLERANCE if ggml_type == "mixed" else TOLERANCE
    x = rng.standard_normal(k).astype(np.float32)
    for name in ("q_scale", "q_min") if ggml_type == "mixed" else ("q_scale",):
        wrong = {**arrays, name: arrays[name].copy()}
        wrong[name][n - 3, 5] *= np.float32(4)  # a Q6_K row's (mixed: the joined Q6_K rows are the last)
        assert _check(device, hvx_blocks.relayout(wrong, layout, k), w, x) > 10 * tolerance, name
    weights = hvx_blocks.relayout(arrays, layout, k)
    records = weights.data.reshape(weights.n_tiles, weights.n_pairs, -1, 128).copy()
    scales = records[1, 0, 0].view(np.int16).reshape(32, 2)  # tile 1, pair 0, block 0's scale vector
    scales[...] = scales[:, ::-1].copy()
    assert _check(device, dataclasses.replace(weights, data=records.reshape(-1)), w, x) > 10 * tolerance


@pytest.mark.parametrize("ggml_type", GGUF_TYPES)
def test_negative_controls(device, ggml_type):
    """A wrong scale or a block with its vectors permuted must give wrong numbers (the check can fail)."""
    rng = np.random.default_rng(3)
    n, k = 32, 256
    arrays, layout, w = _gguf_weight(ggml_type, n, k, rng)
    x = rng.standard_normal(k).astype(np.float32)
    wrong_scale = {**arrays, "q_scale": arrays["q_scale"].copy()}
    wrong_scale["q_scale"][5, 2] *= np.float16(1.5)
    assert _check(device, hvx_blocks.relayout(wrong_scale, layout, k), w, x) > 10 * TOLERANCE
    weights = hvx_blocks.relayout(arrays, layout, k)
    records = weights.data.reshape(weights.n_tiles, weights.n_pairs, -1, 128).copy()
    first_codes = 1 + weights.mins
    records[0, 1, [first_codes, first_codes + 1]] = records[0, 1, [first_codes + 1, first_codes]]
    permuted = dataclasses.replace(weights, data=records.reshape(-1))
    assert _check(device, permuted, w, x) > 10 * TOLERANCE


@pytest.mark.parametrize("ggml_type", [*GGUF_TYPES, "Q6_K", "mixed"])
def test_gemm_rows_are_the_gemvs(device, ggml_type):
    """The GEMM (prefill) on 1..9 activation rows (whole groups of HVX_GEMM_ROWS = 2 and the rest): each row's
    integer sums equal the numpy model's of that row bit for bit, and its y the GEMV's of that row; y is within the
    GEMV's tolerance of W x. Negative control: a record of the second row's activations given to the first moves
    its sums (the rows are not mixed up)."""
    rng = np.random.default_rng(17)
    n, k = 64, 160 if ggml_type in GGUF_TYPES else 256  # K-quants: whole super-blocks
    arrays, layout, w = _mixed_weight(n, k, rng) if ggml_type == "mixed" else _gguf_weight(ggml_type, n, k, rng)
    tolerance = MIXED_TOLERANCE if ggml_type == "mixed" else TOLERANCE
    weights = hvx_blocks.relayout(arrays, layout, k)
    record = hvx_gemv.act_record(weights.halves)
    for m in (1, 4, 7, 9):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y, acc, acc_mins = hvx_gemv.run_gemm(device, weights, x)
        records, _ = hvx_gemv.quantize_rows(x, weights.halves)
        for row in range(m):
            model_acc, model_mins = hvx_gemv.model(weights, records[row])
            np.testing.assert_array_equal(acc[row], model_acc)
            np.testing.assert_array_equal(acc_mins[row], model_mins)
            np.testing.assert_array_equal(y[row], hvx_gemv.run(device, weights, x[row])[0])
            expected, scale = _reference(w, x[row])
            assert np.max(np.abs(y[row] - expected) / scale) < tolerance
    swapped = records.copy()
    swapped[0, :record] = records[1, :record]
    assert np.any(hvx_gemv.model(weights, swapped[0])[0] != acc[0])


@pytest.mark.parametrize("layout", [GroupLayout(4, 16, True, "float16"), GroupLayout(8, 48, True, "float16")],
                         ids=lambda layout: layout.describe())
def test_refuses_other_layouts(layout):
    with pytest.raises(MobilecError, match="groups of a multiple of 32"):
        hvx_blocks.relayout({}, layout, 256)


def _quantize_on_host(x: np.ndarray, halves: bool) -> tuple[np.ndarray, np.ndarray]:
    """hvx_gemv.tir_quantize_activations built for this machine's CPU on x [k]: (records, factors)."""
    k = x.shape[0]
    func = hvx_gemv.tir_quantize_activations(k, None, halves).with_attr("global_symbol", "main")
    built = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    records = tvm.runtime.tensor(np.zeros((1, -(-k // 64) * hvx_gemv.act_record(halves)), np.uint8))
    factors = tvm.runtime.tensor(np.zeros((1, 2), np.float32))
    built["main"](tvm.runtime.tensor(x.reshape(1, k)), records, factors)
    return records.numpy()[0], factors.numpy()[0]


def _record_values(records: np.ndarray, factors: np.ndarray, halves: bool) -> dict[str, np.ndarray]:
    """What records hold, as numbers: int8 codes, the blocks' scales and xs * sum(q) terms (per half block in
    halves), the sums of the codes (likewise)."""
    r = records.reshape(-1, hvx_gemv.act_record(halves))
    terms = 72 + 4 * halves
    return {"codes": r[:, :64].copy().view(np.int8).astype(np.int32),
            "scales": r[:, 64:68].copy().view(np.int16) * np.float64(factors[0]) / 2**30,
            "terms": r[:, 68:terms].copy().view(np.int16) * np.float64(factors[1]) / 2**8,
            "sums": r[:, terms:terms + 8 * (1 + halves)].copy().view(np.int32)}


@pytest.mark.parametrize("k,halves", [(96, False), (160, False), (576, False), (160, True)])
def test_tir_quantize_activations(k, halves):
    """The TIR activation kernel (no division: it runs on the DSP) writes what numpy's quantize_activations does up
    to its roundings: codes within 1 (equal for these inputs), scales and terms within 2^-14 of the largest, the
    sums of its own codes (per block, or per half block); zero blocks stay zero. Negative control: x scaled by 1.01
    is told apart."""
    x = (np.random.default_rng(k).standard_normal(k) * 3).astype(np.float32)
    x[32:64] = 0
    for values in (x, np.zeros(k, np.float32)):
        got = _record_values(*_quantize_on_host(values, halves), halves)
        expected, dot_factor, min_factor = hvx_gemv.quantize_activations(values, halves)
        want = _record_values(expected, np.array([dot_factor, min_factor], np.float32), halves)
        np.testing.assert_array_equal(got["codes"], want["codes"])
        np.testing.assert_array_equal(got["sums"], got["codes"].reshape(-1, 2 * (1 + halves), 32 // (1 + halves))
                                      .sum(axis=2))
        for name in ("scales", "terms"):
            assert np.abs(got[name] - want[name]).max() <= 2**-14 * max(np.abs(want[name]).max(), 1e-30), name
    expected, dot_factor, min_factor = hvx_gemv.quantize_activations(x, halves)
    want = _record_values(expected, np.array([dot_factor, min_factor], np.float32), halves)
    scaled = _record_values(*_quantize_on_host(x * np.float32(1.01), halves), halves)
    assert np.abs(scaled["scales"] - want["scales"]).max() > 2**-10 * np.abs(want["scales"]).max()


def test_tir_kernel_calls_the_c_kernel(tmp_path):
    """hvx_gemv.tir_kernel, tir_gemm_kernel (a symbolic row count) and tir_quantize_activations built by TVM for
    hexagon-npu (v73, as for emulation) and linked with hvx_gemv.c into the kernel server, all run there on weights
    as the "hvx" code order stores them (hvx_blocks.stored_arrays): y equals the C kernel called directly on numpy's
    activations, bit for bit, for each GGUF format and Q6_K (a scale per 16 values; the GEMM for Q4_1 and Q6_K)."""
    n = 64
    sizes = {**{t: 160 for t in GGUF_TYPES}, "Q6_K": 256}  # K-quants: whole super-blocks
    rng = np.random.default_rng(11)
    weights = {t: _gguf_weight(t, n, k, rng) for t, k in sizes.items()}
    relaid = {t: hvx_blocks.relayout(arrays, layout, sizes[t]) for t, (arrays, layout, _) in weights.items()}
    gemm_types = ("Q4_1", "Q6_K")  # the GEMM's wrapper differs by format only in the C kernel's name and records
    kernels = {}
    for t, w in relaid.items():
        k, halves = sizes[t], w.halves
        kernels[f"gemv_{t}"] = hvx_gemv.tir_kernel(n, k, w.bits, w.mins, w.zero, halves)
        if t in gemm_types:  # and the activations' quantize of each record size (halves: the rows' one for both)
            kernels[f"gemm_{t}"] = hvx_gemv.tir_gemm_kernel(n, k, w.bits, w.mins, w.zero, halves,
                                                            (tirx.Var("rows", "int64"), n))
            kernels[f"quantize_rows_{halves}"] = hvx_gemv.tir_quantize_activations(
                k, (tirx.Var("rows", "int64"), k), halves)
    kernels["quantize_False"] = hvx_gemv.tir_quantize_activations(160)
    kernels = {name: func.with_attr("global_symbol", name) for name, func in kernels.items()}
    hexagon.build_object(kernels, emulated_hexagon.emulation_spec(load_target("hexagon-npu")), tmp_path, link=False)
    program = emulated_hexagon.build_device(tmp_path, (tmp_path / hexagon.OBJECT,))
    with emulated_hexagon.Device(program, 1 << 20) as device:
        for ggml_type, w in relaid.items():
            k, record = sizes[ggml_type], hvx_gemv.act_record(w.halves)
            x = rng.standard_normal(k).astype(np.float32)
            xs = rng.standard_normal((6, k)).astype(np.float32)  # prefill's rows
            direct, _, _ = hvx_gemv.run(device, w, x)
            device.reset()
            x_dsp = device.array((1, k), np.float32)
            x_dsp[...] = x
            records = device.array((1, -(-k // 64) * record), np.uint8)
            factors = device.array((1, 2), np.float32)
            device.call("quantize_rows_True" if w.halves else "quantize_False", x_dsp, records, factors)
            stored = hvx_blocks.stored_arrays(*weights[ggml_type][:2], k)
            placed = [device.array(a.shape, a.dtype) for a in (stored["q_weight"], stored["q_scale"])]
            for dst, name in zip(placed, ("q_weight", "q_scale")):
                dst[...] = stored[name]
            y = device.array((1, n), np.float32)
            device.call(f"gemv_{ggml_type}", *placed, records, factors, y)
            np.testing.assert_array_equal(y[0], direct, err_msg=ggml_type)
            expected, scale = _reference(weights[ggml_type][2], x)
            assert np.max(np.abs(y[0] - expected) / scale) < TOLERANCE, ggml_type
            if ggml_type not in gemm_types:
                continue
            direct_rows, _, _ = hvx_gemv.run_gemm(device, w, xs)
            device.reset()
            placed = [device.array(a.shape, a.dtype) for a in (stored["q_weight"], stored["q_scale"])]
            for dst, name in zip(placed, ("q_weight", "q_scale")):
                dst[...] = stored[name]
            x_rows = device.array(xs.shape, np.float32)
            x_rows[...] = xs
            records = device.array((len(xs), -(-k // 64) * record), np.uint8)
            factors = device.array((len(xs), 2), np.float32)
            device.call(f"quantize_rows_{w.halves}", x_rows, records, factors)
            y_rows = device.array((len(xs), n), np.float32)
            device.call(f"gemm_{ggml_type}", *placed, records, factors, y_rows)
            np.testing.assert_array_equal(y_rows, direct_rows, err_msg=ggml_type)
    with pytest.raises(MobilecError, match="multiple"):
        hvx_gemv.tir_kernel(40, 160, 4, False, 8)
