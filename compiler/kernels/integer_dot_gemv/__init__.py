"""Decode GEMV on the CPU's integer multiply-add instructions: y = W x with W in 4/8-bit group codes.

The activation x is quantized per 32 values (one float scale each) to int16 (default: errors ~1/65534 of a
block's largest value, results equal to the float GEMV's to ~2e-5) or, with `--decode-activations int8`, to int8
as llama.cpp does for its Q4/Q8 dot products (~100x the error, ~1.4x faster). The inner loop then multiplies
codes by activations in integer arithmetic instead of widening every code to float: the instructions are the
CPU's integer dot-product family (compiler/isa.py), one variant file per architecture (x86.py: `vpmaddwd` for int16
on AVX-512BW or AVX2, `vpdpbusd` for int8 with VNNI, else `vpmaddubsw` + `vpmaddwd`). Per 32-code block the int32
sum is scaled once:

    sum_k w_k x_k = sum_blocks d * xs * sum_j c_j q_j  +  m * xs * sum_j q_j,     w = d c + m,  x = xs q

(symmetric codes: m = -offset * d). A step reads 32 bytes of codes: two 4-bit blocks or one 8-bit block. The
variant turns them into int32 lanes, each a sum of products of one block, and says in which order the activation
kernel stores the activations so that every instruction reads them contiguously; the activation kernel also writes
its per-block terms already repeated per lane, so the only shuffle left widens the two weight scales of a 4-bit
step to [d0 ..., d1 ...].

SmolLM2 decode GEMVs, one Zen 3 core (AVX2), weights in cache, int16 activations: 4-bit gate_up 0.128 ms with
vpmovzxbw widening, 0.093 ms widened in-lane (x86.py); int8 activations 0.062 ms.
"""

from __future__ import annotations

import dataclasses
import math

from tvm import tirx
from tvm.script import tirx as T
from tvm.target import Target

from ...isa import cpu_isa
from . import x86

BLOCK = 32  # activation values per scale, and codes per int32 block sum
STEP_BYTES = 32  # bytes of codes per step (the variants' steps: x86.STEP_BYTES)
ROWS_PER_TASK = 16
# Software prefetch this far ahead in the codes, 4-bit rows only. Streamed from DRAM, interleaved runs: SmolLM2's
# down_proj 0.044 -> 0.036 ms, qkv 0.034 -> 0.030, gate_up 0.071 -> 0.068; the 8-bit lm_head, already at ~23 GB/s
# with the hardware prefetcher alone, went 1.29 -> 1.44 ms with it.
PREFETCH_BYTES = 2048
ACTIVATION_BITS = (16, 8)
# architecture -> the variant file with its families (compiler/isa.py INT_DOT_FAMILIES) and dot step
VARIANTS = {"x86_64": x86}


def family(target: Target) -> str | None:
    """The integer dot-product family the kernel uses on `target`, or None where it has no variant for it."""
    isa = cpu_isa(target)
    if isa is None or isa.arch not in VARIANTS or isa.int_dot not in VARIANTS[isa.arch].FAMILIES:
        return None
    return isa.int_dot


def available(target: Target) -> bool:
    return family(target) is not None


def _variant(name: str):
    return next(module for module in VARIANTS.values() if name in module.FAMILIES)


@dataclasses.dataclass(frozen=True)
class GemvShape:
    """y[n] = sum_k W[n, k] x[k], W stored as `bits`-bit codes with one scale (and min) per `group` values;
    activations quantized to `act_bits` (16 or 8), multiplied with the instructions of `family` (compiler/isa.py)."""

    n: int
    k: int
    bits: int
    group: int
    symmetric: bool
    scale_dtype: str
    act_bits: int = 16
    family: str = "avx512bw"

    @property
    def act_dtype(self) -> str:
        return f"int{self.act_bits}"

    @property
    def qmax(self) -> int:
        return (1 << (self.act_bits - 1)) - 1

    @property
    def lanes(self) -> int:
        """int32 lanes of a step's dot products (the family's choice: see its variant file)."""
        return _variant(self.family).int32_lanes(self)

    @property
    def blocks_per_step(self) -> int:
        return STEP_BYTES * 8 // self.bits // BLOCK

    @property
    def lanes_per_block(self) -> int:
        return self.lanes // self.blocks_per_step

    @property
    def steps(self) -> int:
        return self.k // (BLOCK * self.blocks_per_step)

    @property
    def lane_terms(self) -> int:
        """Length of the per-lane activation terms (scale, sum): lanes_per_block per 32 values."""
        return self.k // BLOCK * self.lanes_per_block

    @property
    def centered(self) -> bool:
        """8-bit codes on AVX2's int8 path go in as c - 128: c * q pair sums would overflow vpmaddubsw's int16."""
        return self.act_bits == 8 and not _variant(self.family).FAMILIES[self.family] and self.bits == 8

    @property
    def sum_terms(self) -> int:
        """Length of the activation sum terms: per lane (symmetric: folded into each step's FMA) or per 32-value
        block (asymmetric: one dot with the row's mins after the steps)."""
        return self.lane_terms if self.symmetric else self.k // BLOCK

    def supported(self) -> bool:
        # Both 32-code blocks of a 4-bit step must fall in one group, or each have their own (group 32); mins
        # are read per 32-value block; centred codes drop the -offset term, which only symmetric codes have.
        return (self.bits in (4, 8) and self.act_bits in ACTIVATION_BITS and any(
                    self.family in module.FAMILIES for module in VARIANTS.values())
                and self.k % (BLOCK * self.blocks_per_step) == 0 and self.group % BLOCK == 0
                and (self.group == BLOCK or self.group % (BLOCK * self.blocks_per_step) == 0)
                and (self.symmetric or (self.group == BLOCK and not self.centered)))

    def activation_name(self) -> str:
        """What the activation kernel depends on: K, the code order (bits, and the family's lanes), the sum term and
        the int width."""
        return f"int{self.bits}_{'sym' if self.symmetric else 'asym'}_k{self.k}_a{self.act_bits}_l{self.lanes}"

    def name(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        return f"int{self.bits}_g{self.group}_{kind}_{self.scale_dtype}_a{self.act_bits}_{self.family}_n{self.n}_k{self.k}"


def quantize_activation(shape: GemvShape, x_shape: tuple[int, ...]) -> tirx.PrimFunc:
    """x [..., K] float32 (one row) -> xq [K] (int16 or int8) in the GEMV's code order, xs float32 [lane_terms]
    (per lane, its block's scale) and xo float32 [sum_terms] (symmetric codes: per lane, -offset * xs * sum q /
    lanes; asymmetric: per block, xs * sum q)."""
    k, lanes, qmax, act = shape.k, shape.lanes_per_block, float(shape.qmax), shape.act_dtype
    sum_factor = -(1 << (shape.bits - 1)) / lanes
    symmetric = shape.symmetric
    order = _variant(shape.family).activation_index

    @T.prim_func(private=True, s_tir=True)
    def quantize(x: T.Buffer(x_shape, "float32"), xq: T.Buffer((k,), act), xs: T.Buffer((shape.lane_terms,), "float32"),
                 xo: T.Buffer((shape.sum_terms,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        with T.sblock("root"):  # Relax's analyses expect a root block
            xf = T.decl_buffer((k,), "float32", data=x.data)
            amax = T.alloc_buffer((1,), "float32", scope="local")
            qsum = T.alloc_buffer((1,), "int32", scope="local")
            for b in range(k // BLOCK):
                amax[0] = T.float32(0)
                for j in range(BLOCK):
                    amax[0] = T.max(amax[0], T.fabs(xf[b * BLOCK + j]))
                inv = T.if_then_else(amax[0] > T.float32(0), T.float32(qmax) / amax[0], T.float32(0))
                qsum[0] = 0
                for j in range(BLOCK):
                    q = T.Cast("int32", T.round(xf[b * BLOCK + j] * inv))
                    qsum[0] = qsum[0] + q
                    xq[order(shape, b, j)] = T.Cast(act, q)
                for lane in range(lanes):
                    xs[b * lanes + lane] = amax[0] / T.float32(qmax)
                    if symmetric:
                        xo[b * lanes + lane] = amax[0] / T.float32(qmax) * T.Cast("float32", qsum[0]) * T.float32(sum_factor)
                if not symmetric:
                    xo[b] = amax[0] / T.float32(qmax) * T.Cast("float32", qsum[0])

    return quantize


def _lane_scale(shape: GemvShape, buf, n, step):
    """The weight scale (or min) of each int32 lane of `step`, as float32 x lanes."""
    half = shape.lanes // 2
    if shape.blocks_per_step == 2 and shape.group == BLOCK:
        pair = T.Cast("float32x2", buf[n, T.ramp(step * 2, 1, 2)])
        return T.Shuffle([pair] * half, [0] * half + [1] * half)
    return T.broadcast(T.Cast("float32", buf[n, step * shape.blocks_per_step * BLOCK // shape.group]), shape.lanes)


def _step_sum(shape: GemvShape, xq, xs, xo, w, d, m, n, step):
    """One step's contribution to the row's float32 partial sums. Built as one expression: a vector bound to
    a name inside the kernel would become a Let that the Relax build spills to a stack buffer (8x slower)."""
    terms = T.ramp(step * shape.lanes, 1, shape.lanes)
    dot = T.Cast(f"float32x{shape.lanes}", _variant(shape.family).step_dot(shape, w, xq, n, step))
    if shape.centered:  # the dot already holds sum (c - 128) q
        return dot * xs[terms] * _lane_scale(shape, d, n, step)
    if shape.symmetric:
        # xo holds -offset * xs * sum q: one FMA gives the block's sum of (c - offset) x
        return (dot * xs[terms] + xo[terms]) * _lane_scale(shape, d, n, step)
    return dot * xs[terms] * _lane_scale(shape, d, n, step)  # the mins' term comes once per row (gemv)


def _mins_tail(m, xo, n, start: int, stop: int):
    """sum_b m[n, b] * xo[b] for the blocks a 16-wide vector step leaves over (scalar)."""
    total = T.float32(0)
    for b in range(start, stop):
        total = total + T.Cast("float32", m[n, b]) * xo[b]
    return total


def _hsum(acc, lanes: int):
    width, total = lanes, acc[T.ramp(0, 1, lanes)]
    while width > 1:
        width //= 2
        total = T.Shuffle([total], list(range(width))) + T.Shuffle([total], list(range(width, 2 * width)))
    return total


def gemv(shape: GemvShape, y_shape: tuple[int, ...]) -> tirx.PrimFunc:
    """(xq, xs, xo, codes, scales[, mins]) -> y [..., N] float32; rows in parallel tasks of 16."""
    n_rows, k, groups = shape.n, shape.k, -(-shape.k // shape.group)
    rows = math.gcd(n_rows, ROWS_PER_TASK)
    code_bytes = k * shape.bits // 8
    sdt, act, lanes = shape.scale_dtype, shape.act_dtype, shape.lanes
    vec = T.ramp(0, 1, lanes)
    prefetch = PREFETCH_BYTES if shape.bits == 4 else 0
    assert shape.supported(), shape

    @T.macro
    def rows_loop(xq, xs, xo, w, d, m, y):
        yf = T.decl_buffer((n_rows,), "float32", data=y.data)
        for task in T.parallel(n_rows // rows):
            for r in range(rows):
                # default scope: a stack array LLVM keeps in registers ("local" became a workspace call per task)
                acc = T.alloc_buffer((lanes,), "float32")
                acc[vec] = T.broadcast(T.float32(0), lanes)
                for step in range(shape.steps):
                    if prefetch > 0:
                        T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(
                            w[task * rows + r, step * STEP_BYTES + prefetch]), T.int32(0), T.int32(3), T.int32(1)))
                    acc[vec] = acc[vec] + _step_sum(shape, xq, xs, xo, w, d, m, task * rows + r, step)
                if shape.symmetric:
                    yf[task * rows + r] = _hsum(acc, lanes)
                else:
                    # sum_b m_b * xs_b * sum q_b once per row, 16 blocks per vector: lane-widening the mins at
                    # every step cost 4 instructions per 64 codes (GGUF Q4_1 decode step 8.2 ms)
                    mins = T.alloc_buffer((16,), "float32")
                    mins[T.ramp(0, 1, 16)] = T.broadcast(T.float32(0), 16)
                    for c in range(groups // 16):
                        mins[T.ramp(0, 1, 16)] = mins[T.ramp(0, 1, 16)] + T.Cast(
                            "float32x16", m[task * rows + r, T.ramp(c * 16, 1, 16)]) * xo[T.ramp(c * 16, 1, 16)]
                    yf[task * rows + r] = (_hsum(acc, lanes) + _hsum(mins, 16)
                                           + _mins_tail(m, xo, task * rows + r, groups // 16 * 16, groups))

    if shape.symmetric:
        @T.prim_func(private=True, s_tir=True)
        def func(xq: T.Buffer((k,), act), xs: T.Buffer((shape.lane_terms,), "float32"),
                 xo: T.Buffer((shape.sum_terms,), "float32"), w: T.Buffer((n_rows, code_bytes), "uint8"),
                 d: T.Buffer((n_rows, groups), sdt), y: T.Buffer(y_shape, "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            with T.sblock("root"):
                rows_loop(xq, xs, xo, w, d, None, y)
    else:
        @T.prim_func(private=True, s_tir=True)
        def func(xq: T.Buffer((k,), act), xs: T.Buffer((shape.lane_terms,), "float32"),
                 xo: T.Buffer((shape.sum_terms,), "float32"), w: T.Buffer((n_rows, code_bytes), "uint8"),
                 d: T.Buffer((n_rows, groups), sdt), m: T.Buffer((n_rows, groups), sdt),
                 y: T.Buffer(y_shape, "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            with T.sblock("root"):
                rows_loop(xq, xs, xo, w, d, m, y)

    return func
