"""The HVX decode GEMV's and prefill GEMM's host half: activations quantized into the kernels' records, an
integer-exact numpy model of the kernels, calls of them on the emulated DSP's kernel server
(native/hexagon/hvx_gemv.c; weights laid out by quantization/hvx_blocks.py), and the kernels as TIR functions for
a hexagon target (`tir_kernel`, `tir_gemm_kernel`). The GEMM is the GEMV's step on several activation rows at once
(hvx_gemv.h's HVX_GEMM_ROWS), each with its own records and factors: its row sums are the GEMV's of each row.

`tir_kernel` calls the C kernel with call_extern, which TVM's Hexagon codegen leaves to the linker: an artifact's
kernels.o then links with hvx_gemv.c's object (the kernel server links it; with the SDK, hexagon-link would). So
the kernel has one source, the C file the tests check bit for bit and the packet bench counts; a TIR copy with
LLVM's HVX intrinsics would be a second one. The hexagon-npu pipeline calls them for the matmuls of weights in the
"hvx" code order (passes/hvx_gemv.py: the GEMV for one activation row, the GEMM for prefill's and batch_decode's),
after `tir_quantize_activations`, which runs on the DSP too.

Activations are quantized per 32 values to int8 as llama.cpp's Q8_0 (scale = largest |x| / 127); per pair of
blocks a record of 80 bytes: the 64 int8 values, the two scales X as int16 fixed point with one power of two for
the whole vector, the two terms xs * sum(q) the same way (for the mins of asymmetric codes), and the two sums of q
(int32, for the zero code of symmetric ones). For weights with a scale per 16 values ("halves", GGUF Q6_K) a record
of 96 bytes: the same with a term and a sum per half block (4 each: block 0's halves, then block 1's), 4 bytes of
padding.
"""

from __future__ import annotations

import functools
import operator

import numpy as np

from tvm import tirx
from tvm.script import tirx as T

from ..errors import MobilecError
from ..passes.expand_npu_math import reciprocal_1_to_2
from ..quantization.group import hvx_record_bytes
from ..quantization.hvx_blocks import BLOCK, FIXED_MAX, ROWS, HvxWeights, fixed_point
from ..testing import emulated_hexagon
from . import parse_cache

ACT_RECORD = 80  # hvx_gemv.h's hvx_gemv_act_record
ACT_RECORD_HALVES = 96


def leading_rows(shape: tuple):
    """The rows of an array of `shape` [..., k]: the product of its leading dimensions (ints, or tirx.Var for
    prefill's sequence length and batch_decode's sequences)."""
    return functools.reduce(operator.mul, shape[:-1], 1)


def act_record(halves: bool) -> int:
    """Bytes of a pair of blocks' activation record for weights with a scale per 32 values, or per 16 (halves)."""
    return ACT_RECORD_HALVES if halves else ACT_RECORD


def _record_parts(halves: bool) -> tuple[int, int]:
    """(where a record's terms start, where its sums start): after the 64 values and the X pair, the terms (int16)
    and sums (int32) of each block's parts (1, or 2 halves)."""
    parts = 1 + halves
    return 68, 68 + 4 * parts


def quantize_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [k] -> (int8 [pairs * 2, 32], float32 scales [pairs * 2]), zero-padded to whole pairs of blocks."""
    pairs = -(-x.shape[0] // (2 * BLOCK))
    padded = np.zeros(pairs * 2 * BLOCK, np.float32)
    padded[:x.shape[0]] = x
    blocks = padded.reshape(-1, BLOCK)
    scale = np.abs(blocks).max(axis=1) / np.float32(127)
    q = np.rint(np.divide(blocks, scale[:, None], out=np.zeros_like(blocks), where=scale[:, None] > 0))
    return np.clip(q, -127, 127).astype(np.int8), scale


def quantize_activations(x: np.ndarray, halves: bool = False) -> tuple[np.ndarray, float, float]:
    """float [k] -> (records uint8 [pairs * act_record(halves)], dot_factor, min_factor)."""
    q, scale = quantize_blocks(x)
    pairs, parts = q.shape[0] // 2, 1 + halves
    sums = q.astype(np.int32).reshape(-1, parts, BLOCK // parts).sum(axis=2, dtype=np.int32)  # [blocks, parts]
    x_fixed, x_power = fixed_point(scale, None)
    t_fixed, t_power = fixed_point(scale.astype(np.float64)[:, None] * sums, None)
    terms, sums_at = _record_parts(halves)
    records = np.zeros((pairs, act_record(halves)), np.uint8)
    records[:, :64] = q.reshape(pairs, 64).view(np.uint8)
    records[:, 64:terms] = x_fixed.reshape(pairs, 2).view(np.uint8)
    records[:, terms:sums_at] = t_fixed.reshape(pairs, 2 * parts).view(np.uint8)
    records[:, sums_at:sums_at + 8 * parts] = sums.reshape(pairs, 2 * parts).view(np.uint8)
    return records.reshape(-1), float(x_power.item()) * 2.0**30, float(t_power.item()) * 2.0**8


def quantize_rows(x: np.ndarray, halves: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """float [m, k] -> (records uint8 [m, pairs * act_record(halves)], factors float32 [m, 2]): each row's
    quantize_activations."""
    rows = [quantize_activations(row, halves) for row in x]
    return np.stack([records for records, _, _ in rows]), np.array([f[1:] for f in rows], np.float32)


def dot_shift(bits: int, mins: bool) -> int:
    """hvx_gemv.h's hvx_gemv_dot_shift."""
    return 4 if bits == 4 else 1 if mins else 2


def model(weights: HvxWeights, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's integer row sums (dot term, mins term) [n_tiles * 32], computed the way it computes them."""
    tiles, pairs, parts = weights.n_tiles, weights.n_pairs, 1 + weights.halves
    vectors = 128 * parts  # bytes of the scales' (and the mins') vectors
    data = weights.data.reshape(tiles, pairs, -1)
    r = records.reshape(pairs, act_record(weights.halves))
    terms_at, sums_at = _record_parts(weights.halves)
    q = r[:, :64].copy().view(np.int8).astype(np.int64).reshape(pairs, 2, parts, BLOCK // parts)
    x_fixed = r[:, 64:terms_at].copy().view(np.int16).astype(np.int64)  # [pairs, block]
    t_fixed = r[:, terms_at:sums_at].copy().view(np.int16).astype(np.int64).reshape(pairs, 2, parts)
    sums = r[:, sums_at:sums_at + 8 * parts].copy().view(np.int32).astype(np.int64).reshape(pairs, 2, parts)

    def fixed(start: int) -> np.ndarray:
        """A record's scale (or min) vectors as [tiles, pairs, rows, block, part]."""
        raw = data[:, :, start:start + vectors].copy().view(np.int16).reshape(tiles, pairs, parts, ROWS, 2)
        # halves: a vector per block, its halfword pair the parts; else one vector, its pair the blocks
        return (raw.transpose(0, 1, 3, 2, 4) if weights.halves else raw.transpose(0, 1, 3, 4, 2)).astype(np.int64)

    codes = data[:, :, (1 + weights.mins) * vectors:].reshape(tiles, pairs, 2, -1, ROWS, 4)
    if weights.bits == 4:
        low, high = codes & 0x0F, codes >> 4  # [tiles, pairs, block, v, rows, j]
        values = np.stack([low, high], axis=4).reshape(tiles, pairs, 2, 8, ROWS, 4)
    else:
        values = codes
    # value index of (group g, j) is 4 g + j: [tiles, pairs, block, rows, part, values]
    values = values.transpose(0, 1, 2, 4, 3, 5).reshape(tiles, pairs, 2, ROWS, parts, -1).astype(np.int64)
    dots = np.einsum("tpbrhk,pbhk->tprbh", values, q) - weights.zero * sums[None, :, None]
    factors = (fixed(0) * x_fixed[None, :, None, :, None] + (1 << 14)) >> 15  # [tiles, pairs, rows, block, part]
    shifted = dots << dot_shift(weights.bits, weights.mins)
    acc = ((shifted * factors * 2 + (1 << 15)) >> 16).sum(axis=(1, 3, 4)).reshape(-1)
    acc_mins = np.zeros_like(acc)
    if weights.mins:
        acc_mins = ((fixed(vectors) * t_fixed[None, :, None]) >> 8).sum(axis=(1, 3, 4)).reshape(-1)
    return acc, acc_mins


# (bits, mins, halves) -> the C kernel
KERNELS = {(4, False, False): "hvx_gemv_4bit", (4, True, False): "hvx_gemv_4bit_mins",
           (8, False, False): "hvx_gemv_8bit", (8, True, False): "hvx_gemv_8bit_mins",
           (8, False, True): "hvx_gemv_8bit_g16", (8, True, True): "hvx_gemv_8bit_mins_g16"}
GEMM_KERNELS = {key: name.replace("gemv", "gemm") for key, name in KERNELS.items()}


def _staged(device: emulated_hexagon.Device, weights: HvxWeights, *arrays: np.ndarray) -> list:
    """The emulated DSP's shared region reset (earlier arrays there are freed), then copies there of the weights,
    their row factors and `arrays`, in that order."""
    device.reset()
    staged = []
    for host in (weights.data, weights.row_factors.astype(np.float32).reshape(-1), *arrays):
        staged.append(device.array(host.shape, host.dtype))
        staged[-1][...] = host
    return staged


def run(device: emulated_hexagon.Device, weights: HvxWeights, x: np.ndarray
        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """y [n] and the kernel's integer row sums (dot, mins) [n_tiles * 32], computed on the emulated DSP (its shared
    region is reset: earlier arrays there are freed)."""
    records, dot_factor, min_factor = quantize_activations(x, weights.halves)
    stored, factors, activations = _staged(device, weights, records)
    rows = weights.n_tiles * ROWS
    y, acc, acc_mins = device.array(rows, np.float32), device.array(rows, np.int32), device.array(rows, np.int32)
    device.call(KERNELS[weights.bits, weights.mins, weights.halves], stored, factors, activations, weights.n_tiles,
                weights.n_pairs, weights.zero, dot_factor, min_factor, y, acc, acc_mins)
    return y[:weights.n].copy(), acc.copy(), acc_mins.copy()


def run_gemm(device: emulated_hexagon.Device, weights: HvxWeights, x: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Y [m, n] = x [m, k] W^T and the kernel's integer row sums (dot, mins) [m, n_tiles * 32] on the emulated DSP's
    GEMM (its shared region is reset)."""
    stored, factors, activations, act_factors = _staged(device, weights, *quantize_rows(x, weights.halves))
    shape = (x.shape[0], weights.n_tiles * ROWS)
    y, acc, acc_mins = device.array(shape, np.float32), device.array(shape, np.int32), device.array(shape, np.int32)
    device.call(GEMM_KERNELS[weights.bits, weights.mins, weights.halves], stored, factors, activations, act_factors,
                weights.n_tiles, weights.n_pairs, x.shape[0], weights.zero, y, acc, acc_mins)
    return y[:, :weights.n].copy(), acc.copy(), acc_mins.copy()


def _tir_layout(n: int, k: int, bits: int, mins: bool, halves: bool) -> tuple[int, int, int]:
    """(tiles, pairs of blocks, stored bytes per weight row) the C kernels take for W [n, k]."""
    if n % ROWS:
        raise MobilecError(f"the HVX GEMV's TIR kernel writes whole tiles of {ROWS} rows; N = {n} is not a multiple: "
                           "leave this weight to TVM's GEMV")
    pairs = -(-k // (2 * BLOCK))
    return n // ROWS, pairs, pairs * hvx_record_bytes(bits, mins, halves) // ROWS


@parse_cache.cached
def tir_kernel(n: int, k: int, bits: int, mins: bool, zero: int, halves: bool = False,
               y_shape: tuple[int, ...] | None = None) -> tirx.PrimFunc:
    """y [..., n] = W x for a hexagon target: the C kernel called on W as the "hvx" code order stores it
    (hvx_blocks.stored_arrays: `weights` [n, bytes], `row_factors` [n, 2]; halves: a scale per 16 values), x's
    records (`activations`) and `factors` = [dot_factor, min_factor] (quantize_activations,
    tir_quantize_activations, whose shapes have y's leading dimensions, all 1); y_shape None: [1, n]."""
    tiles, pairs, row_bytes = _tir_layout(n, k, bits, mins, halves)
    y_shape = y_shape or (1, n)
    name = KERNELS[bits, mins, halves]
    null = T.reinterpret("handle", T.uint64(0))  # no integer sums wanted
    leading = tuple(y_shape[:-1])
    dot_factor, min_factor = (0,) * len(leading) + (0,), (0,) * len(leading) + (1,)  # the one row's factors

    @T.prim_func(private=True)
    def gemv(weights: T.Buffer((n, row_bytes), "uint8"), row_factors: T.Buffer((n, 2), "float32"),
             activations: T.Buffer((*leading, pairs * act_record(halves)), "uint8"),
             factors: T.Buffer((*leading, 2), "float32"), y: T.Buffer(y_shape, "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        T.evaluate(T.call_extern("void", name, weights.data, row_factors.data, activations.data, tiles, pairs, zero,
                                 factors[dot_factor], factors[min_factor], y.data, null, null))

    return gemv


@parse_cache.cached
def tir_gemm_kernel(n: int, k: int, bits: int, mins: bool, zero: int, halves: bool, y_shape: tuple
                    ) -> tirx.PrimFunc:
    """Y [..., n] = X W^T for a hexagon target: the C GEMM called on W as the "hvx" code order stores it, the rows'
    records (`activations` [..., pairs * act_record(halves)]) and `factors` [..., 2] (tir_quantize_activations of
    X [..., k]); y_shape's leading dimensions (ints, or tirx.Var for prefill's sequence length and batch_decode's
    rows) are the activation rows."""
    tiles, pairs, row_bytes = _tir_layout(n, k, bits, mins, halves)
    name = GEMM_KERNELS[bits, mins, halves]
    null = T.reinterpret("handle", T.uint64(0))
    leading = tuple(y_shape[:-1])
    rows = leading_rows(y_shape)

    @T.prim_func(private=True)
    def gemm(weights: T.Buffer((n, row_bytes), "uint8"), row_factors: T.Buffer((n, 2), "float32"),
             activations: T.Buffer((*leading, pairs * act_record(halves)), "uint8"),
             factors: T.Buffer((*leading, 2), "float32"), y: T.Buffer(y_shape, "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        T.evaluate(T.call_extern("void", name, weights.data, row_factors.data, activations.data, factors.data, tiles,
                                 pairs, T.Cast("int32", rows), zero, y.data, null, null))

    return gemm


def _reciprocal(x):
    """1 / x for a normal positive float32 x, without a division (a compiler-rt call on Hexagon): the mantissa's
    reciprocal on [1, 2] (expand_npu_math, 3 Newton steps) times 2^-exponent."""
    bits = T.reinterpret("int32", x)
    mantissa = T.reinterpret("float32", T.bitwise_or(T.bitwise_and(bits, T.int32((1 << 23) - 1)), T.int32(127 << 23)))
    exponent = T.shift_right(bits, T.int32(23))
    return reciprocal_1_to_2(mantissa) * T.reinterpret("float32", T.shift_left(T.int32(254) - exponent, T.int32(23)))


def _rounded(value):
    """value rounded to the nearest integer, ties away from zero, as int32 (a truncating conversion: nearbyint
    would be a libm call on Hexagon)."""
    return T.Cast("int32", value + T.if_then_else(value < T.float32(0), T.float32(-0.5), T.float32(0.5)))


@parse_cache.cached
def tir_quantize_activations(k: int, x_shape: tuple | None = None, halves: bool = False) -> tirx.PrimFunc:
    """quantize_activations of each row as a TIR kernel that runs on the DSP (no float division, no float64, no
    libm): x [..., k] (x_shape; its leading dimensions, ints or tirx.Var, are the rows; None: [1, k]) float32 ->
    records uint8 [..., pairs * act_record(halves)] and factors float32 [..., 2] = [dot_factor, min_factor] per row.
    Its results differ from numpy's by roundings only: q = x * 127 (1 / amax) by a reciprocal within an ulp, ties
    away from zero (a code off by one at a near tie), xs = amax * (1 / 127); the fixed-point exponent
    floor(log2(largest)) - 14 (largest / 2^E in [2^14, 2^15), 32768 clamped), which keeps 15 bits as numpy's
    ceil(log2(largest / 32767)) does. Blocks whose largest |x| is below 2^-126 (denormal) quantize to zero."""
    x_shape = x_shape or (1, k)
    leading = tuple(x_shape[:-1])
    rows = leading_rows(x_shape)
    pairs = -(-k // (2 * BLOCK))
    blocks, parts = 2 * pairs, 1 + halves
    record = act_record(halves)
    words = record // 2  # int16 per record
    dwords = record // 4  # int32 per record
    terms_at, sums_at = (at // size for at, size in zip(_record_parts(halves), (2, 4)))

    def sum_at(b, part):
        """The int32 index of block b's sum of part `part` (a half block, or the block)."""
        return b // 2 * dwords + sums_at + b % 2 * parts + part

    @T.macro
    def fixed(values, count, out, first, power):
        """values[:count] ~ int16 out[first(b)] * 2^E, one E for all; power[0] = 2^E."""
        largest = T.alloc_buffer((1,), "float32", scope="local")
        largest[0] = T.float32(0)
        for b in range(count):
            largest[0] = T.max(largest[0], T.fabs(values[b]))
        # E = floor(log2(largest)) - 14 from the float's exponent bits, at least -126 (2^-E a float32); 0 for zero
        biased = T.shift_right(T.reinterpret("int32", largest[0]), T.int32(23))
        exponent = T.if_then_else(biased > T.int32(0), T.max(biased - T.int32(127 + 14), T.int32(-126)), T.int32(0))
        power[0] = T.reinterpret("float32", T.shift_left(exponent + T.int32(127), T.int32(23)))
        inverse = T.reinterpret("float32", T.shift_left(T.int32(127) - exponent, T.int32(23)))
        for b in range(count):
            out[first(b)] = T.Cast("int16", T.min(T.max(_rounded(values[b] * inverse), T.int32(-FIXED_MAX)),
                                                  T.int32(FIXED_MAX)))

    @T.macro
    def quantize_row(x, records, factors, amax, scale, terms, power, row):
        xf = T.decl_buffer((k,), "float32", data=x.data, elem_offset=row * k)
        q = T.decl_buffer((pairs * record,), "int8", data=records.data, elem_offset=row * (pairs * record))
        halfwords = T.decl_buffer((pairs * words,), "int16", data=records.data, elem_offset=row * (pairs * words))
        sums = T.decl_buffer((pairs * dwords,), "int32", data=records.data, elem_offset=row * (pairs * dwords))
        out = T.decl_buffer((2,), "float32", data=factors.data, elem_offset=row * 2)
        for b in range(blocks):
            amax[0] = T.float32(0)
            for j in range(BLOCK):
                if b * BLOCK + j < k:
                    amax[0] = T.max(amax[0], T.fabs(xf[b * BLOCK + j]))
            normal = amax[0] >= T.float32(2.0**-126)
            inverse = T.if_then_else(normal, T.float32(127) * _reciprocal(T.max(amax[0], T.float32(2.0**-126))),
                                     T.float32(0))
            for part in range(parts):
                sums[sum_at(b, part)] = 0
            for j in range(BLOCK):
                value = T.if_then_else(b * BLOCK + j < k, xf[T.min(b * BLOCK + j, k - 1)], T.float32(0))
                code = T.min(T.max(_rounded(value * inverse), T.int32(-127)), T.int32(127))
                q[b // 2 * record + b % 2 * BLOCK + j] = T.Cast("int8", code)
                sums[sum_at(b, j // (BLOCK // parts))] = sums[sum_at(b, j // (BLOCK // parts))] + code
            scale[b] = T.if_then_else(normal, amax[0] * T.float32(1 / 127), T.float32(0))
            for part in range(parts):
                terms[b * parts + part] = scale[b] * T.Cast("float32", sums[sum_at(b, part)])
        fixed(scale, blocks, halfwords, lambda b: b // 2 * words + 32 + b % 2, power)
        out[0] = power[0] * T.float32(2.0**30)
        fixed(terms, blocks * parts, halfwords, lambda t: t // (2 * parts) * words + terms_at + t % (2 * parts), power)
        out[1] = power[0] * T.float32(2.0**8)

    @T.prim_func(private=True, s_tir=True)
    def quantize(x: T.Buffer(x_shape, "float32"), records: T.Buffer((*leading, pairs * record), "uint8"),
                 factors: T.Buffer((*leading, 2), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        with T.sblock("root"):  # Relax's analyses expect a root block
            amax = T.alloc_buffer((1,), "float32", scope="local")
            scale = T.alloc_buffer((blocks,), "float32")
            terms = T.alloc_buffer((blocks * parts,), "float32")
            power = T.alloc_buffer((1,), "float32", scope="local")
            if isinstance(rows, int) and rows == 1:
                quantize_row(x, records, factors, amax, scale, terms, power, 0)
            else:
                for row in range(rows):
                    quantize_row(x, records, factors, amax, scale, terms, power, row)

    return quantize
