"""Prefill matmul on CPUs: Y[m, n] = sum_k X[m, k] * W[n, k] for many rows m, as an outer-product GEMM.

A register tile holds NR outputs along n times MP = MV vectors of X rows along m: each step of k broadcasts NR
weights against MV vectors of X, NR x MV FMAs for NR + MV loads, no horizontal sums. The tile sizes come from
the target's instruction set (`tile_shape`, one TileShape per vector width): with AVX-512 (16 float lanes, 32
registers) NR = 12 x MP = 32 (two vectors), 24 accumulators; with AVX2 + FMA (8 lanes, 16 registers) NR = 6 x
MP = 16 (two vectors), 12 accumulators + 2 vectors of X + 1 broadcast. The vectors run along m, so X is first
copied transposed into panels of MP rows (zero rows past M), once per call. Each parallel task dequantizes a
tile of TN rows of W once, vectorized along k, into a task-local buffer and reuses it for every panel. Sums run
in blocks of <= 64 steps of k added into running sums (the float accuracy of the lane-split sums of the
schedule before; SmolLM2 prefill logits within 6e-5 of it). Rows past the last full panel, up to `small_max`,
take dot products along k instead (tiles of `dot_rows` rows x `dot_cols` columns, one vector of partial sums
each, then a horizontal sum): a mostly empty panel would cost a full one.

SmolLM2-135M, 128-token prefill, one thread of an x86-64-v4 host: gate_up 369 -> 144 ms, down 171 -> 75 ms,
qkv 117 -> 47 ms, o_proj 70 -> 28 ms (all 30 layers); ~100 GFLOP/s in the 32-row panels.
One thread of an AMD EPYC Zen 3 (znver3: AVX2 + FMA, no AVX-512; a shared, noisy machine): the same matmuls of one
layer 15.9 -> 12.5 ms (down 5.9 -> 3.3 ms, the others ~1.1x: the row tiles reach ~67 GFLOP/s there while W rows stay
in L1), ~75 GFLOP/s in the 16-row panels; SmolLM2 q4f16_g32 128-token prefill 188 -> 248-263 tok/s (best of 20),
logits within 1.5e-4 of the row tiles'. Tile choices: AVX2_SHAPE.

The weight, activation and output accesses come in as callables returning PrimExprs (the caller substitutes
the iteration variables of the original kernel's blocks), so one template serves every weight layout and
epilogue. Vector values are never bound to names: a vector Let inside a kernel built through the Relax
pipeline is spilled to a stack buffer and gathered back lane by lane.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tvm import tirx
from tvm.script import tirx as T

from ..target.isa import CpuIsa


@dataclasses.dataclass(frozen=True)
class TileShape:
    """The tile parameters for one vector instruction set (all of them: gemm_body reads no other constants)."""

    lanes: int  # float32 lanes of a vector
    register_tiles: tuple[tuple[int, int], ...]  # (NR outputs along n, MV vectors of X rows): the first NR dividing N
    task_tiles: int  # register tiles of n per parallel task (and per dequantized W tile), at most
    dot_rows: int  # the last rows' dot-product tiles: rows of X ...
    dot_cols: tuple[int, ...]  # ... times columns of W, the first of these that divides TN
    small_max: int  # up to this many rows past the last full panel take the dot-product path (at most MP - 1)

    def tiles(self, n: int, w_lanes: int) -> GemmTiles | None:
        """The tiles for N outputs (None when no NR divides N); `w_lanes`: the weight dequantize's lanes."""
        nr, mv = next(((nr, mv) for nr, mv in self.register_tiles if n % nr == 0), (None, None))
        if nr is None:
            return None
        tn = nr * max(g for g in range(1, self.task_tiles + 1) if n % (nr * g) == 0)
        return GemmTiles(nr=nr, tn=tn, w_lanes=w_lanes, mv=mv, shape=self)


# AVX-512 (x86-64-v4): 32 zmm registers of 16 float32 lanes; 12 x 2 vectors: 24 accumulators + 2 vectors of X + 1
# broadcast. The 4 x 4 dot-product tiles cost ~1/7 of a 32-row panel per 4 rows, so up to 24 rows take them.
AVX512_SHAPE = TileShape(lanes=16, register_tiles=((12, 2), (8, 2), (6, 2), (4, 2), (2, 2)), task_tiles=8,
                         dot_rows=4, dot_cols=(4, 2, 1), small_max=24)
# AVX2 + FMA (x86-64-v3, or AVX + FMA): 16 ymm registers of 8 float32 lanes. 6 x 2 vectors: 12 accumulators + 2
# vectors of X + 1 broadcast; 4 x 3 (16 registers, no spill) where 6 does not divide N. Measured on one thread of
# an AMD EPYC Zen 3 (znver3, shared and noisy: best of 80 interleaved rounds), SmolLM2 q4f16_g32 prefill matmuls of
# 128 rows (qkv + o + gate_up + down of one layer, dequantize included): 6 x 2 12.5 ms (gate_up ~75 GFLOP/s),
# 4 x 3 13.0, 4 x 2 12.1, 3 x 4 (spills) 20.3, 12 x 1 28.0; the row-tile schedule 15.9 (down, K = 1536:
# 5.9 -> 3.3 ms; the others within 10%). 4 x 2 (8 accumulators) was 3-4% faster on Zen 3, but llvm-mca models
# its k loop at 1.6 FMAs per cycle on Haswell and Zen 2 (FMA latency 5: 8 chains are too few), where 6 x 2 and
# 4 x 3 issue 2 per cycle. 16 tiles per task (96 rows of W, as AVX-512's 12 x 8): 8 were 3-10% slower (each task
# copies every X panel). Dot-product tiles of 4 x 3 ran as fast as 4 x 2, 4 x 4 spilled (+35%); they take up to
# 15 rows (MP - 1): 12 rows 0.81 ms vs 1.01 ms for a padded 16-row panel (gate_up), 15 rows about even.
AVX2_SHAPE = TileShape(lanes=8, register_tiles=((6, 2), (4, 3), (2, 2)), task_tiles=16, dot_rows=4,
                       dot_cols=(3, 2, 1), small_max=24)


def tile_shape(isa: CpuIsa | None) -> TileShape | None:
    """The tiles for a CPU of instruction set `isa` (None: not a CPU target), or None where the kernel is not used:
    x86 CPUs with FMA and 512-bit (AVX-512) or 256-bit (AVX) vectors. aarch64 (NEON: 4 lanes, 32 registers) and x86
    without FMA keep the row-tile schedule (compiler/schedules/cpu.py): nothing measured for them (aarch64 with i8mm
    or dotprod and int8 activations: quantized matmuls become integer GEMMs first, compiler/kernels/integer_dot_gemm)."""
    if isa is None or isa.arch != "x86_64" or not isa.has("fma"):
        return None
    return {512: AVX512_SHAPE, 256: AVX2_SHAPE}.get(isa.vector_bits)


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """The tile sizes for one kernel (TileShape.tiles): NR outputs along n times MP = MV vectors of `lanes` rows
    along m in registers; TN rows of W per parallel task; `w_lanes` lanes of the weight tile's dequantize along k
    (1: scalar); the rest from the instruction set's TileShape."""

    nr: int
    tn: int
    w_lanes: int
    mv: int = 2
    shape: TileShape = AVX512_SHAPE

    @property
    def lanes(self) -> int:
        return self.shape.lanes

    @property
    def mp(self) -> int:
        return self.mv * self.lanes


@dataclasses.dataclass(frozen=True)
class GemmAccess:
    """How the kernel reads and writes the original function's buffers, as PrimExpr builders over int64
    indices: x(m, k), w(n, k) float32 scalars (w(n, k) may be vectorized along k by the caller's loop), and
    store(m, n, value) -> (buffer, indices, stored value) for the output, epilogue included."""

    m: tirx.PrimExpr  # the number of rows (dynamic)
    n: int
    k: int
    x: Callable
    w: Callable
    store: Callable


def _i64(value: int):
    return T.int64(value)


def gemm_body(access: GemmAccess, tiles: GemmTiles) -> tirx.PrimFunc:
    """A parameterless PrimFunc whose body computes the GEMM over the original function's buffers; the caller
    moves the body into the original function (which defines those buffers)."""
    n_ext, k_ext, m_ext = access.n, access.k, access.m
    nr, mv, mp, tn, lanes = tiles.nr, tiles.mv, tiles.mp, tiles.tn, tiles.lanes
    dot_rows = tiles.shape.dot_rows
    stride = k_ext + lanes if k_ext % 256 == 0 else k_ext  # rows 2^n floats apart would share L1 sets
    wl = tiles.w_lanes
    x_of, w_of, store = access.x, access.w, access.store

    # Rows past the last full panel: up to `small_max` of them go through the dot-product path in groups of
    # dot_rows (a panel for a few rows would be mostly zeros); more take one zero-padded panel.
    small_max = min(tiles.shape.small_max, mp - 1) if k_ext % lanes == 0 else 0
    ns = next(c for c in tiles.shape.dot_cols if tn % c == 0)  # columns per dot-product tile
    dot_tile = dot_rows * ns

    # One task-local buffer holds the register tiles at offset 0 (acc; the GEMM's running sums after it), then
    # the task's copy of the X panel (xp) and its dequantized weight tile (wd). The Relax build's codegen may tag
    # every buffer as aliasing every other, and then LLVM cannot keep a tile held in a buffer of its own in
    # registers across the k loop (it stores every FMA result back); within one buffer, constant offsets below
    # xp and wd still prove the tile apart from them.
    tile = nr * mp
    soff = tile  # the tile's running sums over blocks of k_block steps (blocked summation: the float accuracy of
    # the lane-split sums before; one sequential sum over all of K drifts ~sqrt(K / lanes) times further)
    hoff = dot_tile * lanes  # the dot-product path's horizontal sums (lanes - 2 floats)
    xoff = max(2 * tile, hoff + lanes)
    woff = xoff + k_ext * mp
    scratch_len = woff + tn * stride
    k_block = next((b for b in range(64, 15, -1) if k_ext % b == 0), k_ext)

    def vec(base, width=lanes):
        return T.ramp(base, 1, width)

    def fma(sc, nb, kk, r, v):
        """acc[r, v] + w[n_r, kk] * xp[kk, rows v*lanes ..]: one vector expression, never bound to a name."""
        x_vec = sc[vec(xoff + kk * mp + v * lanes)]
        w = sc[woff + (nb * nr + r) * stride + kk]
        return sc[vec((r * mv + v) * lanes)] + T.broadcast(w, lanes) * x_vec

    def out_store(sc, t, p, nb, i, r):
        buf, indices, value = store(p * mp + i, t * tn + nb * nr + r,
                                    sc[soff + (r * mv + i // lanes) * lanes + i % lanes])
        return T.buffer_store(buf, value, indices)

    def dot_fma(sc, nb, kv, i, j):
        """acc[i, j] + xr[i, lanes kv ..] * wd[column j, lanes kv ..]: lane l sums the products of k = l mod lanes."""
        return (sc[vec((i * ns + j) * lanes)] + sc[vec(xoff + i * k_ext + kv * lanes)]
                * sc[vec(woff + (nb * ns + j) * stride + kv * lanes)])

    def dot_store(sc, t, row, nb, i, j):
        """The horizontal sum of acc[i, j] by halves (lanes/2 wide at hoff, then lanes/4 after it, ... 2 wide),
        the last two lanes added as scalars, stored with the epilogue."""
        width, dst = lanes // 2, hoff
        lo = (i * _i64(ns) + j) * _i64(lanes)
        hi = lo + width
        while True:
            T.buffer_store(sc, sc[vec(lo, width)] + sc[vec(hi, width)], [vec(_i64(dst), width)])
            if width == 2:
                break
            lo, hi = _i64(dst), _i64(dst + width // 2)
            dst, width = dst + width, width // 2
        buf, indices, value = store(row, t * tn + nb * ns + j, sc[dst] + sc[dst + 1])
        return T.buffer_store(buf, value, indices)

    gemm_panels = (m_ext + _i64(mp - 1 - small_max)) // _i64(mp)
    small_start = gemm_panels * _i64(mp)
    small_groups = (T.max(m_ext - small_start, _i64(0)) + _i64(dot_rows - 1)) // _i64(dot_rows)

    @T.prim_func(private=True, s_tir=True, check_well_formed=False)
    def func():
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        with T.sblock("root"):
            xt = T.alloc_buffer((T.max(gemm_panels, _i64(1)) * _i64(k_ext * mp),), "float32")
            # X transposed into panels of mp rows, zeros past the last row
            for p in T.parallel(gemm_panels):
                for i in range(_i64(mp)):
                    if p * _i64(mp) + i < m_ext:
                        for kk in range(_i64(k_ext)):
                            xt[(p * _i64(k_ext) + kk) * _i64(mp) + i] = x_of(p * _i64(mp) + i, kk)
                    else:
                        for kk in range(_i64(k_ext)):
                            xt[(p * _i64(k_ext) + kk) * _i64(mp) + i] = T.float32(0)
            for t in T.parallel(_i64(n_ext // tn)):
                sc = T.alloc_buffer((scratch_len,), "float32", scope="local")
                for r in range(_i64(tn)):
                    for kv in range(_i64(k_ext // wl)):
                        for kl in T.vectorized(_i64(wl)):
                            sc[_i64(woff) + r * _i64(stride) + kv * _i64(wl) + kl] = w_of(
                                t * _i64(tn) + r, kv * _i64(wl) + kl)
                for p in range(gemm_panels):
                    for j in range(_i64(k_ext * mp // lanes)):
                        sc[vec(_i64(xoff) + j * _i64(lanes))] = xt[vec(p * _i64(k_ext * mp) + j * _i64(lanes))]
                    for nb in range(_i64(tn // nr)):
                        for j in T.unroll(_i64(mv * nr)):
                            sc[vec(_i64(soff) + j * _i64(lanes))] = T.broadcast(T.float32(0), lanes)
                        for kb in range(_i64(k_ext // k_block)):
                            for j in T.unroll(_i64(mv * nr)):
                                sc[vec(j * _i64(lanes))] = T.broadcast(T.float32(0), lanes)
                            for kk in range(_i64(k_block)):
                                for r in T.unroll(_i64(nr)):
                                    for v in T.unroll(_i64(mv)):
                                        sc[vec((r * _i64(mv) + v) * _i64(lanes))] = fma(
                                            sc, nb, kb * _i64(k_block) + kk, r, v)
                            for j in T.unroll(_i64(mv * nr)):
                                sc[vec(_i64(soff) + j * _i64(lanes))] = (
                                    sc[vec(_i64(soff) + j * _i64(lanes))] + sc[vec(j * _i64(lanes))])
                        if p * _i64(mp) + _i64(mp) <= m_ext:
                            for i in T.unroll(_i64(mp)):
                                for r in T.unroll(_i64(nr)):
                                    out_store(sc, t, p, nb, i, r)
                        else:
                            for i in T.unroll(_i64(mp)):
                                if p * _i64(mp) + i < m_ext:
                                    for r in T.unroll(_i64(nr)):
                                        out_store(sc, t, p, nb, i, r)
                # The last rows (at most small_max), dot_rows at a time: dot products along k, tiles of
                # dot_rows x ns vectors, then one horizontal sum per output.
                for g in range(small_groups):
                    for i in range(_i64(dot_rows)):
                        if small_start + g * _i64(dot_rows) + i < m_ext:
                            for kv in range(_i64(k_ext // lanes)):
                                for kl in T.vectorized(_i64(lanes)):
                                    sc[_i64(xoff) + i * _i64(k_ext) + kv * _i64(lanes) + kl] = x_of(
                                        small_start + g * _i64(dot_rows) + i, kv * _i64(lanes) + kl)
                        else:
                            for kk in range(_i64(k_ext)):
                                sc[_i64(xoff) + i * _i64(k_ext) + kk] = T.float32(0)
                    for nb in range(_i64(tn // ns)):
                        for j in T.unroll(_i64(dot_tile)):
                            sc[vec(j * _i64(lanes))] = T.broadcast(T.float32(0), lanes)
                        for kv in range(_i64(k_ext // lanes)):
                            for i in T.unroll(_i64(dot_rows)):
                                for j in T.unroll(_i64(ns)):
                                    sc[vec((i * _i64(ns) + j) * _i64(lanes))] = dot_fma(sc, nb, kv, i, j)
                        for i in T.unroll(_i64(dot_rows)):
                            if small_start + g * _i64(dot_rows) + i < m_ext:
                                for j in T.unroll(_i64(ns)):
                                    dot_store(sc, t, small_start + g * _i64(dot_rows) + i, nb, i, j)

    return func


def replace_kernel(func: tirx.PrimFunc, access: GemmAccess, tiles: GemmTiles) -> tirx.PrimFunc:
    """`func` (same parameters and buffers) with its body replaced by the GEMM, marked scheduled."""
    return func.with_body(gemm_body(access, tiles).body).with_attr("tirx.is_scheduled", True)
