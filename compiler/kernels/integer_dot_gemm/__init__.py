"""Prefill GEMM on the CPU's integer matrix instructions: Y[m, n] = sum_k X[m, k] W[n, k] for many rows of X, W in
4/8-bit group codes as stored (the decode GEMV's layouts, compiler/kernels/integer_dot_gemv).

X is quantized as the decode GEMV's int8 activations are (`--decode-activations int8`): per row and 32 values, one
float scale xs and int8 q = round(x / xs). The activation kernel writes them in panels of TILE_M rows, in the order
the variant's instruction reads (arm.py: pairs of rows 8 values at a time for `smmla`, fours 4 at a time for
`sdot`), rows past M as zeros. A register tile is 8 X rows x 4 W rows: 8 int32x4 block tiles (each a 2x2 or 4x1
piece of it, the variant's), per block

    acc += float(dot) * xs * d                 symmetric: codes centred in registers, dot = sum (c - offset) q
    acc += float(dot) * xs * d + xo * m        asymmetric: xo = xs * sum q  (w = d c + m)

with xs (and xo) per lane (the activation kernel repeats them in the tile's lane order) and d, m the block's weight
scale and min: the scales once per block per output, never per code. A task first converts its W rows' d (and m)
to float32 in the tiles' lane order (lane_scales), once for every panel of X, so a block reads them as one vector
each instead of loading, converting and shuffling the rows' float16 values (NEON's two vector pipes, not the
multiplies, bound the loop on big cores). 8 float32x4 accumulators + 8 block tiles + the block's W operands + 4 X
operands fit NEON's 32 registers. Each parallel task takes TASK_N rows of W and walks every panel of X for them
(the task's W codes stay in cache).

llvm-mca (bench/arm_gemm_mca.py), cycles per 32 x 32 output tile over one 32-value block, each side built for the
modelled core, Neoverse-N2 / Cortex-A55 (llvm-15) / Cortex-A510 (llvm-19) models: smmla Q4_0 1154 / 4149 / 2315
against llama.cpp's repacked i8mm GEMM's 1313 / 4176 / 3504 (its weights interleaved and pre-flipped at load time;
ours are the decode GEMV's, re-laid per task the same way: GemmShape.relays), Q4_1 1587 / 4784 / 2256 and Q8_0
1155 / 2966 / 1819 (signed) against its two-row smmla dot products' 5210 / 13573 / 13062 and 3869 / 10757 / 10758;
sdot Q4_0 1732 / 4673 / 2337 against its repacked dotprod GEMM's 1697 / 4336 / 3392.
Built for the A55, LLVM unrolls the block loop twice and spills a few registers. Larger tiles (12 or 16 X rows)
spilled and modelled slower.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.script import tirx as T

from ...quantization.group import ORDER_MARKS, signed_codes, takes_code_order
from ...target.isa import CpuIsa
from .. import parse_cache
from . import arm

BLOCK = 32  # activation values per scale, and the values of one block product
TILE_M = 8  # X rows of a register tile (and of an activation panel)
TILE_N = 4  # W rows of a register tile
MAX_TASK_N = 64  # W rows per parallel task, at most
QMAX = 127


def family(isa: CpuIsa | None) -> str | None:
    """The integer matrix family the GEMM uses on a CPU of instruction set `isa` (compiler/target/isa.py; None: not a
    CPU target), or None where it has no variant."""
    if isa is None or isa.arch != "aarch64" or isa.int_dot not in arm.FAMILIES:
        return None
    return isa.int_dot


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """Y [1, M, n] = X [1, M, k] W^T, W stored as `bits`-bit codes with one scale (and min) per `group` values, with
    the instructions of `family` ("i8mm": smmla, "dotprod": sdot)."""

    n: int
    k: int
    bits: int
    group: int
    symmetric: bool
    scale_dtype: str
    family: str
    code_order: str = "plain"  # GroupLayout.code_order

    @property
    def signed_codes(self) -> bool:
        """8-bit symmetric codes stored as c - 128 (GroupLayout.signed_codes; the GEMM takes those about 128 only)."""
        return signed_codes(self.code_order, self.bits, self.symmetric, 1 << (self.bits - 1))

    @property
    def rows_per_vector(self) -> int:
        return arm.rows_per_vector(self.family)

    @property
    def columns_per_tile(self) -> int:
        return arm.columns_per_tile(self.family)

    @property
    def vectors_per_panel(self) -> int:
        """16-byte activation vectors side by side per step of a panel (its rows / rows per vector)."""
        return TILE_M // self.rows_per_vector

    @property
    def blocks(self) -> int:
        return self.k // BLOCK

    @property
    def terms_per_panel(self) -> int:
        """Per panel, the activation terms xs and xo: a 4-lane vector per block and activation vector."""
        return self.blocks * self.vectors_per_panel * arm.LANES

    @property
    def relays(self) -> bool:
        """Codes in the neon order (as ARM targets store them) are re-laid per task before its panels into the block
        products' own order (arm.relaid_set: 8-byte pieces of a pair of rows side by side for `smmla`, centred codes
        pre-flipped): one copy per task, read by every panel of X, instead of joining and flipping pieces in every
        panel. Rows in pairs (neon_pairs) are re-laid from the pairs' bytes (arm.neon_row_bytes)."""
        return self.code_order in ("neon", "neon_pairs")

    @property
    def task_n(self) -> int:
        return max(t for t in range(TILE_N, MAX_TASK_N + 1, TILE_N) if self.n % t == 0)

    @property
    def activation_sums(self) -> bool:
        """Asymmetric codes: the activation kernel also writes xo = xs sum q for the mins' term."""
        return not self.symmetric

    def supported(self) -> bool:
        # codes in the "neon" order are re-laid per task (relays); 8-bit ones are also read as they are in the plain
        # order, 4-bit ones (which ARM targets do not store so) are left to the dequantize path
        return (self.family in arm.FAMILIES and self.bits in (4, 8) and self.k % BLOCK == 0
                and self.group % BLOCK == 0 and self.n % TILE_N == 0 and arm.takes(self)
                and takes_code_order(self.code_order, self.bits, self.group, self.n)
                and (self.relays or self.bits == 8))

    def activation_name(self) -> str:
        return f"k{self.k}_{'sym' if self.symmetric else 'asym'}{self.bits}_{self.family}"

    def name(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        order = ORDER_MARKS[self.code_order]
        return f"int{self.bits}_g{self.group}_{kind}_{self.scale_dtype}_{self.family}{order}_n{self.n}_k{self.k}"


def activation_offset(shape: GemmShape, row, value):
    """Where X[row, value] of a panel (row < TILE_M) goes in the panel's int8 codes: vectors of rows_per_vector
    rows x 16 / rows_per_vector values, the panel's vectors for one step side by side."""
    rows = shape.rows_per_vector
    width = 16 // rows
    return (value // width * shape.vectors_per_panel + row // rows) * 16 + row % rows * width + value % width


# Parsed once (parse_cache), as cpu_attention's kernels: TVMScript parsing is the cost.
@parse_cache.cached
def quantize_rows(shape: GemmShape) -> tirx.PrimFunc:
    """x [1, M, k] float32 -> xq int8 [panels, TILE_M k] (activation_offset's order), xs float32 [panels,
    terms_per_panel] (per block and activation vector 4 lanes, lane l for row l // columns_per_tile of it) and,
    for asymmetric codes, xo = xs sum q in the same order; rows past M are zeros."""
    k, rows, vectors, lanes = shape.k, shape.rows_per_vector, shape.vectors_per_panel, arm.LANES
    columns = shape.columns_per_tile
    terms = shape.terms_per_panel
    sums = shape.activation_sums

    @T.macro
    def body(m, x, xq, xs, xo):
        amax = T.alloc_buffer((1,), "float32", scope="local")
        qsum = T.alloc_buffer((1,), "int32", scope="local")
        for p in T.parallel((m + TILE_M - 1) // TILE_M):
            for i in range(TILE_M):
                for b in range(k // BLOCK):
                    amax[0] = T.float32(0)
                    if p * TILE_M + i < m:
                        for j in range(BLOCK):
                            amax[0] = T.max(amax[0], T.fabs(x[0, p * TILE_M + i, b * BLOCK + j]))
                    inv = T.if_then_else(amax[0] > T.float32(0), T.float32(QMAX) / amax[0], T.float32(0))
                    qsum[0] = 0
                    for j in range(BLOCK):
                        # rows past M: amax 0, so q 0 (x is not read there)
                        q = T.Cast("int32", T.round(T.if_then_else(
                            p * TILE_M + i < m, x[0, p * TILE_M + i, b * BLOCK + j], T.float32(0)) * inv))
                        qsum[0] = qsum[0] + q
                        xq[p, activation_offset(shape, i, b * BLOCK + j)] = T.Cast("int8", q)
                    for copy in range(columns):
                        # the lanes of row i in its vector's 4-lane terms
                        xs[p, (b * vectors + i // rows) * lanes + i % rows * columns + copy] = amax[0] / T.float32(QMAX)
                        if sums:
                            xo[p, (b * vectors + i // rows) * lanes + i % rows * columns + copy] = (
                                amax[0] / T.float32(QMAX) * T.Cast("float32", qsum[0]))

    if sums:
        @T.prim_func(private=True, s_tir=True)
        def quantize(x_handle: T.handle, xq_handle: T.handle, xs_handle: T.handle, xo_handle: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            m = T.int64()
            x = T.match_buffer(x_handle, (1, m, k), "float32")
            xq = T.match_buffer(xq_handle, ((m + TILE_M - 1) // TILE_M, TILE_M * k), "int8")
            xs = T.match_buffer(xs_handle, ((m + TILE_M - 1) // TILE_M, terms), "float32")
            xo = T.match_buffer(xo_handle, ((m + TILE_M - 1) // TILE_M, terms), "float32")
            with T.sblock("root"):
                body(m, x, xq, xs, xo)
    else:
        @T.prim_func(private=True, s_tir=True)
        def quantize(x_handle: T.handle, xq_handle: T.handle, xs_handle: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            m = T.int64()
            x = T.match_buffer(x_handle, (1, m, k), "float32")
            xq = T.match_buffer(xq_handle, ((m + TILE_M - 1) // TILE_M, TILE_M * k), "int8")
            xs = T.match_buffer(xs_handle, ((m + TILE_M - 1) // TILE_M, terms), "float32")
            with T.sblock("root"):
                body(m, x, xq, xs, None)

    return quantize


def _block_term(shape: GemmShape, xq, xs, xo, w, lane_scales, lane_mins, p, n, lane_term, block, vector):
    """One block's float32x4 contribution to the tile of W rows from n (its weight scales and mins at lane_term of
    the task's lane_scales, lane_mins) and activation vector `vector` of panel p, built as one expression (a vector
    bound to a name inside a kernel is spilled to the stack by the Relax build)."""
    vectors = shape.vectors_per_panel
    dot = arm.to_float(shape, arm.block_dot(shape, w, xq, n, block,
                                            lambda step: (p, T.ramp((step * vectors + vector) * 16, 1, 16))))
    terms = T.ramp((block * vectors + vector) * arm.LANES, 1, arm.LANES)
    scale = lane_scales[T.ramp(lane_term, 1, arm.LANES)]
    if shape.symmetric:  # centred codes: the dot holds sum (c - offset) q
        return dot * xs[p, terms] * scale
    return dot * xs[p, terms] * scale + xo[p, terms] * lane_mins[T.ramp(lane_term, 1, arm.LANES)]


@parse_cache.cached
def gemm(shape: GemmShape) -> tirx.PrimFunc:
    """(xq, xs, codes, scales) or (xq, xs, xo, codes, scales, mins) -> y [1, M, n] float32; tasks of task_n W
    rows in parallel."""
    assert shape.supported(), shape
    n_rows, k, groups, task_n = shape.n, shape.k, -(-shape.k // shape.group), shape.task_n
    code_bytes, sdt, terms = k * shape.bits // 8, shape.scale_dtype, shape.terms_per_panel
    rows, columns, vectors = shape.rows_per_vector, shape.columns_per_tile, shape.vectors_per_panel
    units = TILE_N // columns  # tiles along n
    tiles = vectors * units
    blocks, sums = shape.blocks, shape.activation_sums
    relays = shape.relays
    # the neon order's sets of 4 blocks, interleaved by 4 bytes, then the blocks in place
    set_bytes, block_bytes = arm.set_bytes(shape.bits), 4 * shape.bits
    steps = code_bytes // set_bytes
    pieces = arm.pieces(shape)
    # The order of a block's tiles decides LLVM's register allocation: by W rows first (the X vectors stay live
    # across units), or by X vector first for 8-bit codes, whose W operands are twice 4-bit's: the other order
    # spilled vector registers (llvm-mca, bench/arm_gemm_mca.py, cortex-x3 / cortex-a715 builds).
    vector_major = shape.bits == 8

    lane_terms = task_n // TILE_N * blocks * units * arm.LANES

    def lane_term(nb, b, u):
        """Where the task's lane_scales (and lane_mins) hold tile unit u of W-row tile nb for block b."""
        return ((nb * blocks + b) * units + u) * arm.LANES

    @T.macro
    def block_step(xq, xs, xo, w, lane_scales, lane_mins, acc, p, row0, nb, b, u, v):
        acc[T.ramp((u * vectors + v) * 4, 1, 4)] = acc[T.ramp((u * vectors + v) * 4, 1, 4)] + (
            _block_term(shape, xq, xs, xo, w, lane_scales, lane_mins, p, row0 + nb * TILE_N + u * columns,
                        lane_term(nb, b, u), b, v))

    @T.macro
    def relay_unit(w, codes, t, pair, unit):
        # the `columns` rows from row 2 pair + unit columns of the task in the block products' order
        # (arm.relaid_set): per set of 4 blocks, its pieces; then the blocks past the last set (in place in the neon
        # order), piece by piece. `unit` is a Python int, so each row's place in its pair is known
        for s in T.unroll(steps):
            for h in T.unroll(pieces):
                codes[T.ramp(arm.relaid_start(shape, 2 * pair + unit * columns, s * 4, h), 1, 64)] = arm.relaid_set(
                    shape, [arm.neon_row_bytes(shape, w, t * task_n + 2 * pair + unit * columns + r,
                                               s * set_bytes + h * (64 // columns), 64 // columns, unit * columns + r)
                            for r in range(columns)])
        for j in T.unroll((code_bytes - steps * set_bytes) // block_bytes):
            for h in T.unroll(pieces):
                codes[T.ramp(arm.relaid_start(shape, 2 * pair + unit * columns, steps * 4 + j, h), 1, 16)] = (
                    arm.relaid_block(shape, [arm.neon_row_bytes(
                        shape, w, t * task_n + 2 * pair + unit * columns + r,
                        steps * set_bytes + j * block_bytes + h * (16 // columns), 16 // columns, unit * columns + r)
                        for r in range(columns)]))

    @T.macro
    def relay_codes(w, codes, t):
        # the task's rows by pairs (tasks hold whole tiles of W rows, an even number): with dotprod, a row a unit
        for pair in range(task_n // 2):
            relay_unit(w, codes, t, pair, 0)
            if columns == 1:
                relay_unit(w, codes, t, pair, 1)

    @T.macro
    def panels(m, xq, xs, xo, w, lane_scales, lane_mins, y, t, row0):
        for p in range((m + TILE_M - 1) // TILE_M):
            for nb in range(task_n // TILE_N):
                # default scope: a stack array LLVM keeps in registers
                acc = T.alloc_buffer((tiles * 4,), "float32")
                for tile in T.unroll(tiles):
                    acc[T.ramp(tile * 4, 1, 4)] = T.broadcast(T.float32(0), 4)
                for b in range(blocks):
                    if vector_major:
                        for v in T.unroll(vectors):
                            for u in T.unroll(units):
                                block_step(xq, xs, xo, w, lane_scales, lane_mins, acc, p, row0, nb, b, u, v)
                    else:
                        for u in T.unroll(units):
                            for v in T.unroll(vectors):
                                block_step(xq, xs, xo, w, lane_scales, lane_mins, acc, p, row0, nb, b, u, v)
                for u in T.unroll(units):
                    for v in T.unroll(vectors):
                        for lane in T.unroll(4):
                            if p * TILE_M + v * rows + lane // columns < m:
                                y[0, p * TILE_M + v * rows + lane // columns,
                                  t * task_n + nb * TILE_N + u * columns + lane % columns] = acc[(u * vectors + v) * 4 + lane]

    @T.macro
    def tasks(m, xq, xs, xo, w, d, mins, y):
        for t in T.parallel(n_rows // task_n):
            # the task's weight scales (and mins) as float32 in the lanes' order, once for every panel of X: in
            # the block loop they are one vector load instead of per-row loads, converts and shuffles
            lane_scales = T.alloc_buffer((lane_terms,), "float32")
            lane_mins = T.alloc_buffer((lane_terms if sums else 1,), "float32")
            for nb, b, u, lane in T.grid(task_n // TILE_N, blocks, units, arm.LANES):
                n = t * task_n + nb * TILE_N + u * columns + lane % columns
                lane_scales[lane_term(nb, b, u) + lane] = T.Cast("float32", d[n, b * BLOCK // shape.group])
                if sums:
                    lane_mins[lane_term(nb, b, u) + lane] = T.Cast("float32", mins[n, b * BLOCK // shape.group])
            if relays:
                codes = T.alloc_buffer((task_n * arm.relaid_bytes(shape),), "uint8")  # per task, as lane_scales
                relay_codes(w, codes, t)
                panels(m, xq, xs, xo, codes, lane_scales, lane_mins, y, t, 0)
            else:
                panels(m, xq, xs, xo, w, lane_scales, lane_mins, y, t, t * task_n)

    if shape.symmetric:
        @T.prim_func(private=True, s_tir=True)
        def func(xq_handle: T.handle, xs_handle: T.handle, w: T.Buffer((n_rows, code_bytes), "uint8"),
                 d: T.Buffer((n_rows, groups), sdt), y_handle: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            m = T.int64()
            y = T.match_buffer(y_handle, (1, m, n_rows), "float32")
            xq = T.match_buffer(xq_handle, ((m + TILE_M - 1) // TILE_M, TILE_M * k), "int8")
            xs = T.match_buffer(xs_handle, ((m + TILE_M - 1) // TILE_M, terms), "float32")
            with T.sblock("root"):
                tasks(m, xq, xs, None, w, d, None, y)
    else:
        @T.prim_func(private=True, s_tir=True)
        def func(xq_handle: T.handle, xs_handle: T.handle, xo_handle: T.handle,
                 w: T.Buffer((n_rows, code_bytes), "uint8"), d: T.Buffer((n_rows, groups), sdt),
                 mins: T.Buffer((n_rows, groups), sdt), y_handle: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            m = T.int64()
            y = T.match_buffer(y_handle, (1, m, n_rows), "float32")
            xq = T.match_buffer(xq_handle, ((m + TILE_M - 1) // TILE_M, TILE_M * k), "int8")
            xs = T.match_buffer(xs_handle, ((m + TILE_M - 1) // TILE_M, terms), "float32")
            xo = T.match_buffer(xo_handle, ((m + TILE_M - 1) // TILE_M, terms), "float32")
            with T.sblock("root"):
                tasks(m, xq, xs, xo, w, d, mins, y)

    return func
