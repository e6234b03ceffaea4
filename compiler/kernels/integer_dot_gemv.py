"""Decode GEMV on the CPU's integer dot-product instructions: y = W x with W in 4/8-bit group codes.

The activation x is quantized to int8, one scale per 32 values (as llama.cpp does for its Q4/Q8 matmuls), so
the inner loop multiplies bytes by bytes into int32 (`vpdpbusd`: 32 products, summed by 4, in one instruction;
AVX2's `vpmaddubsw` + `vpmaddwd` where VNNI is missing) instead of widening every code to float. Per 32-code
block the int32 sum is scaled once:

    sum_k w_k x_k = sum_blocks d * xs * sum_j c_j q_j  +  m * xs * sum_j q_j,     w = d c + m,  x = xs q

(symmetric codes: m = -offset * d). A 256-bit step reads 32 bytes of codes: two 4-bit blocks (low nibbles,
then high nibbles, against activations stored in that order) or one 8-bit block. Each int32 lane holds a sum of
4 products; the activation kernel writes its per-block terms already repeated per lane, so the only shuffle left
widens the two weight scales of a 4-bit step to [d0 x4, d1 x4].
"""

from __future__ import annotations

import dataclasses
import math

from tvm import tirx
from tvm.script import tirx as T
from tvm.target import Target
from tvm.target.codegen import target_has_features

BLOCK = 32  # activation values per int16 scale, and codes per int32 block sum
STEP_BYTES = 32  # 32 bytes of codes per step: 32 int16 lanes of a 512-bit vector once widened
LANES = 16  # int32 lanes of a 512-bit vector
ROWS_PER_TASK = 16
QMAX = 32767  # int16 activations: rounding error 1/65534 of a block's largest value, float-like results


def available(target: Target) -> bool:
    """x86 CPUs with AVX-512BW (x86-64-v4): 512-bit vpmaddwd."""
    return (target.kind.name == "llvm" and str(target.attrs.get("mtriple", "")).startswith("x86_64")
            and target_has_features("avx512bw", target))


@dataclasses.dataclass(frozen=True)
class GemvShape:
    """y[n] = sum_k W[n, k] x[k], W stored as `bits`-bit codes with one scale (and min) per `group` values."""

    n: int
    k: int
    bits: int
    group: int
    symmetric: bool
    scale_dtype: str

    @property
    def blocks_per_step(self) -> int:
        return STEP_BYTES * 8 // self.bits // BLOCK

    @property
    def lanes_per_block(self) -> int:
        return LANES // self.blocks_per_step

    @property
    def steps(self) -> int:
        return self.k // (BLOCK * self.blocks_per_step)

    @property
    def lane_terms(self) -> int:
        """Length of the per-lane activation terms (scale, sum): lanes_per_block per 32 values."""
        return self.k // BLOCK * self.lanes_per_block

    def supported(self) -> bool:
        # Both 32-code blocks of a 4-bit step must fall in one group, or each have their own (group 32).
        return (self.bits in (4, 8) and self.k % (BLOCK * self.blocks_per_step) == 0 and self.group % BLOCK == 0
                and (self.group == BLOCK or self.group % (BLOCK * self.blocks_per_step) == 0))

    def activation_name(self) -> str:
        """What the activation kernel depends on: K, the code order (bits) and the sum term (symmetric)."""
        return f"int{self.bits}_{'sym' if self.symmetric else 'asym'}_k{self.k}"

    def name(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        return f"int{self.bits}_g{self.group}_{kind}_{self.scale_dtype}_n{self.n}_k{self.k}"


def quantize_activation(shape: GemvShape, x_shape: tuple[int, ...]) -> tirx.PrimFunc:
    """x [..., K] float32 (one row) -> xq int8 [K] in the GEMV's code order, xs and xo float32 [lane_terms]:
    per lane, the block's scale and its sum term (xs * sum q / lanes, times -offset for symmetric codes)."""
    k, lanes = shape.k, shape.lanes_per_block
    sum_factor = (-(1 << (shape.bits - 1)) if shape.symmetric else 1) / lanes
    nibbles = shape.bits == 4

    @T.prim_func(private=True, s_tir=True)
    def quantize(x: T.Buffer(x_shape, "float32"), xq: T.Buffer((k,), "int16"), xs: T.Buffer((shape.lane_terms,), "float32"),
                 xo: T.Buffer((shape.lane_terms,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        with T.sblock("root"):  # Relax's analyses expect a root block
            xf = T.decl_buffer((k,), "float32", data=x.data)
            amax = T.alloc_buffer((1,), "float32", scope="local")
            qsum = T.alloc_buffer((1,), "int32", scope="local")
            for b in range(k // BLOCK):
                amax[0] = T.float32(0)
                for j in range(BLOCK):
                    amax[0] = T.max(amax[0], T.fabs(xf[b * BLOCK + j]))
                inv = T.if_then_else(amax[0] > T.float32(0), T.float32(QMAX) / amax[0], T.float32(0))
                qsum[0] = 0
                for j in range(BLOCK):
                    q = T.Cast("int32", T.round(xf[b * BLOCK + j] * inv))
                    qsum[0] = qsum[0] + q
                    if nibbles:
                        # low nibbles of blocks 2i and 2i+1 (values 0..15 of each), then their high nibbles (16..31)
                        xq[b // 2 * 64 + j // 16 * 32 + b % 2 * 16 + j % 16] = T.Cast("int16", q)
                    else:
                        xq[b * BLOCK + j] = T.Cast("int16", q)
                for lane in range(lanes):
                    xs[b * lanes + lane] = amax[0] / T.float32(QMAX)
                    xo[b * lanes + lane] = amax[0] / T.float32(QMAX) * T.Cast("float32", qsum[0]) * T.float32(sum_factor)

    return quantize


def _dot(codes, act):
    """Sums of pairs of products: codes (int16 x32) times activations (int16 x32) -> int32 x16."""
    return T.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.pmaddw.d.512", codes, act)


def _lane_scale(shape: GemvShape, buf, n, step):
    """The weight scale (or min) of each int32 lane of `step`, as float32 x16."""
    if shape.blocks_per_step == 2 and shape.group == BLOCK:
        pair = T.Cast("float32x2", buf[n, T.ramp(step * 2, 1, 2)])
        return T.Shuffle([pair] * 8, [0] * 8 + [1] * 8)
    return T.broadcast(T.Cast("float32", buf[n, step * shape.blocks_per_step * BLOCK // shape.group]), LANES)


def _step_dot(shape: GemvShape, w, xq, n, step):
    # Widened first (one vpmovzxbw from memory): a 4-bit byte as int16 gives its low code with one AND and its
    # high code with one shift, no mask.
    codes = T.Cast("int16x32", w[n, T.ramp(step * STEP_BYTES, 1, STEP_BYTES)])
    if shape.bits == 8:
        return _dot(codes, xq[T.ramp(step * STEP_BYTES, 1, STEP_BYTES)])
    low = T.bitwise_and(codes, T.broadcast(T.int16(15), STEP_BYTES))
    high = T.shift_right(codes, T.broadcast(T.int16(4), STEP_BYTES))
    return (_dot(low, xq[T.ramp(step * 64, 1, STEP_BYTES)])
            + _dot(high, xq[T.ramp(step * 64 + STEP_BYTES, 1, STEP_BYTES)]))


def _step_sum(shape: GemvShape, xq, xs, xo, w, d, m, n, step):
    """One step's contribution to the row's float32 x16 partial sums. Built as one expression: a vector bound to
    a name inside the kernel would become a Let that the Relax build spills to a stack buffer (8x slower)."""
    terms = T.ramp(step * LANES, 1, LANES)
    dot = T.Cast("float32x16", _step_dot(shape, w, xq, n, step))
    if shape.symmetric:
        # xo holds -offset * xs * sum q: one FMA gives the block's sum of (c - offset) x
        return (dot * xs[terms] + xo[terms]) * _lane_scale(shape, d, n, step)
    return dot * xs[terms] * _lane_scale(shape, d, n, step) + xo[terms] * _lane_scale(shape, m, n, step)


def _hsum(acc):
    eight = acc[T.ramp(0, 1, 8)] + acc[T.ramp(8, 1, 8)]
    four = T.Shuffle([eight], [0, 1, 2, 3]) + T.Shuffle([eight], [4, 5, 6, 7])
    two = T.Shuffle([four], [0, 1]) + T.Shuffle([four], [2, 3])
    return T.Shuffle([two], [0]) + T.Shuffle([two], [1])


def gemv(shape: GemvShape, y_shape: tuple[int, ...]) -> tirx.PrimFunc:
    """(xq, xs, xo, codes, scales[, mins]) -> y [..., N] float32; rows in parallel tasks of 16."""
    n_rows, k, groups = shape.n, shape.k, -(-shape.k // shape.group)
    rows = math.gcd(n_rows, ROWS_PER_TASK)
    code_bytes = k * shape.bits // 8
    sdt = shape.scale_dtype
    vec = T.ramp(0, 1, LANES)

    @T.macro
    def rows_loop(xq, xs, xo, w, d, m, y):
        yf = T.decl_buffer((n_rows,), "float32", data=y.data)
        for task in T.parallel(n_rows // rows):
            for r in range(rows):
                acc = T.alloc_buffer((LANES,), "float32", scope="local")
                acc[vec] = T.broadcast(T.float32(0), LANES)
                for step in range(shape.steps):
                    acc[vec] = acc[vec] + _step_sum(shape, xq, xs, xo, w, d, m, task * rows + r, step)
                yf[task * rows + r] = _hsum(acc)

    if shape.symmetric:
        @T.prim_func(private=True, s_tir=True)
        def func(xq: T.Buffer((k,), "int16"), xs: T.Buffer((shape.lane_terms,), "float32"),
                 xo: T.Buffer((shape.lane_terms,), "float32"), w: T.Buffer((n_rows, code_bytes), "uint8"),
                 d: T.Buffer((n_rows, groups), sdt), y: T.Buffer(y_shape, "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            with T.sblock("root"):
                rows_loop(xq, xs, xo, w, d, None, y)
    else:
        @T.prim_func(private=True, s_tir=True)
        def func(xq: T.Buffer((k,), "int16"), xs: T.Buffer((shape.lane_terms,), "float32"),
                 xo: T.Buffer((shape.lane_terms,), "float32"), w: T.Buffer((n_rows, code_bytes), "uint8"),
                 d: T.Buffer((n_rows, groups), sdt), m: T.Buffer((n_rows, groups), sdt),
                 y: T.Buffer(y_shape, "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            with T.sblock("root"):
                rows_loop(xq, xs, xo, w, d, m, y)

    return func
