"""Prefill matmul on CPUs: Y[m, n] = sum_k X[m, k] * W[n, k] for many rows m, as an outer-product GEMM.

A register tile holds NR = 12 outputs along n times MP = 32 rows of X along m (two 16-lane vectors per n): each
step of k broadcasts 12 weights against two vectors of X, 24 FMAs for 14 loads, no horizontal sums. The
vectors run along m, so X is first copied transposed into panels of 32 rows (zero rows past M), once per call.
Each parallel task dequantizes a tile of TN rows of W once, vectorized along k, into a task-local buffer and
reuses it for every panel. Sums run in blocks of <= 64 steps of k added into running sums (the float accuracy
of the lane-split sums of the schedule before; SmolLM2 prefill logits within 6e-5 of it). Rows past the last
full panel, up to SMALL_MAX, take dot products along k instead (tiles of 4 rows x 4 columns): a mostly empty
32-row panel would cost a full one.

SmolLM2-135M, 128-token prefill, one thread of this x86-64-v4 host: gate_up 369 -> 144 ms, down 171 -> 75 ms,
qkv 117 -> 47 ms, o_proj 70 -> 28 ms (all 30 layers); ~100 GFLOP/s in the 32-row panels.

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
from tvm.target import Target
from tvm.target.codegen import target_has_features

LANES = 16  # float32 lanes of a 512-bit vector
SMALL_ROWS = 4  # rows of X per dot-product tile (the rows past the last full panel)
SMALL_MAX = 24  # up to this many rows past the last full panel take the dot-product path (~1/7 panel per 4)


def available(target: Target) -> bool:
    """x86 CPUs with AVX-512 (x86-64-v4): 32 vector registers of 16 float32 lanes, for a tile of 24 of them.
    (llvm_get_vector_width reports 512 bits for AVX2 CPUs too: it cannot tell.)"""
    return (target.kind.name == "llvm" and str(target.attrs.get("mtriple", "")).startswith("x86_64")
            and target_has_features("avx512f", target))


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """The tile sizes: NR outputs along n times MP = MV vectors of LANES rows along m in registers; TN rows
    of W per parallel task; `w_lanes` lanes of the weight tile's dequantize along k (1: scalar)."""

    nr: int
    tn: int
    w_lanes: int
    mv: int = 2

    @property
    def mp(self) -> int:
        return self.mv * LANES


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
    nr, mv, mp, tn = tiles.nr, tiles.mv, tiles.mp, tiles.tn
    stride = k_ext + LANES if k_ext % 256 == 0 else k_ext  # rows 2^n floats apart would share L1 sets
    wl = tiles.w_lanes
    x_of, w_of, store = access.x, access.w, access.store

    # Rows past the last full panel: up to `small_max` of them go through the dot-product path in groups of
    # SMALL_ROWS (a panel for a few rows would be mostly zeros); more take one zero-padded panel.
    small_max = min(SMALL_MAX, mp - 1) if k_ext % LANES == 0 else 0
    ns = next(c for c in (4, 2, 1) if tn % c == 0)  # columns per dot-product tile
    dot_tile = SMALL_ROWS * ns

    # One task-local buffer holds the register tiles at offset 0 (acc; the GEMM's running sums after it), then
    # the task's copy of the X panel (xp) and its dequantized weight tile (wd). The Relax build's codegen may tag
    # every buffer as aliasing every other, and then LLVM cannot keep a tile held in a buffer of its own in
    # registers across the k loop (it stores every FMA result back); within one buffer, constant offsets below
    # xp and wd still prove the tile apart from them.
    tile = nr * mp
    soff = tile  # the tile's running sums over blocks of k_block steps (blocked summation: the float accuracy of
    # the lane-split sums before; one sequential sum over all of K drifts ~sqrt(K / 16) times further)
    hoff = dot_tile * LANES  # the dot-product path's horizontal sums
    xoff = max(2 * tile, hoff + LANES)
    woff = xoff + k_ext * mp
    scratch_len = woff + tn * stride
    k_block = next((b for b in range(64, 15, -1) if k_ext % b == 0), k_ext)

    def vec(base, lanes=LANES):
        return T.ramp(base, 1, lanes)

    def fma(sc, nb, kk, r, v):
        """acc[r, v] + w[n_r, kk] * xp[kk, rows v*16 .. v*16+15]: one vector expression, never bound to a name."""
        x_vec = sc[vec(xoff + kk * mp + v * LANES)]
        w = sc[woff + (nb * nr + r) * stride + kk]
        return sc[vec((r * mv + v) * LANES)] + T.broadcast(w, LANES) * x_vec

    def out_store(sc, t, p, nb, i, r):
        buf, indices, value = store(p * mp + i, t * tn + nb * nr + r,
                                    sc[soff + (r * mv + i // LANES) * LANES + i % LANES])
        return T.buffer_store(buf, value, indices)

    def dot_fma(sc, nb, kv, i, j):
        """acc[i, j] + xr[i, 16 kv ..] * wd[column j, 16 kv ..]: lane l sums the products of k = l mod 16."""
        return (sc[vec((i * ns + j) * LANES)] + sc[vec(xoff + i * k_ext + kv * LANES)]
                * sc[vec(woff + (nb * ns + j) * stride + kv * LANES)])

    def dot_store(sc, t, row, nb, i, j):
        buf, indices, value = store(row, t * tn + nb * ns + j, sc[hoff + 12] + sc[hoff + 13])
        return T.buffer_store(buf, value, indices)

    gemm_panels = (m_ext + _i64(mp - 1 - small_max)) // _i64(mp)
    small_start = gemm_panels * _i64(mp)
    small_groups = (T.max(m_ext - small_start, _i64(0)) + _i64(SMALL_ROWS - 1)) // _i64(SMALL_ROWS)

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
                    for j in range(_i64(k_ext * mp // LANES)):
                        sc[vec(_i64(xoff) + j * _i64(LANES))] = xt[vec(p * _i64(k_ext * mp) + j * _i64(LANES))]
                    for nb in range(_i64(tn // nr)):
                        for j in T.unroll(_i64(mv * nr)):
                            sc[vec(_i64(soff) + j * _i64(LANES))] = T.broadcast(T.float32(0), LANES)
                        for kb in range(_i64(k_ext // k_block)):
                            for j in T.unroll(_i64(mv * nr)):
                                sc[vec(j * _i64(LANES))] = T.broadcast(T.float32(0), LANES)
                            for kk in range(_i64(k_block)):
                                for r in T.unroll(_i64(nr)):
                                    for v in T.unroll(_i64(mv)):
                                        sc[vec((r * _i64(mv) + v) * _i64(LANES))] = fma(
                                            sc, nb, kb * _i64(k_block) + kk, r, v)
                            for j in T.unroll(_i64(mv * nr)):
                                sc[vec(_i64(soff) + j * _i64(LANES))] = (
                                    sc[vec(_i64(soff) + j * _i64(LANES))] + sc[vec(j * _i64(LANES))])
                        if p * _i64(mp) + _i64(mp) <= m_ext:
                            for i in T.unroll(_i64(mp)):
                                for r in T.unroll(_i64(nr)):
                                    out_store(sc, t, p, nb, i, r)
                        else:
                            for i in T.unroll(_i64(mp)):
                                if p * _i64(mp) + i < m_ext:
                                    for r in T.unroll(_i64(nr)):
                                        out_store(sc, t, p, nb, i, r)
                # The last rows (at most small_max), SMALL_ROWS at a time: dot products along k, tiles of
                # SMALL_ROWS x ns vectors, then one horizontal sum per output.
                for g in range(small_groups):
                    for i in range(_i64(SMALL_ROWS)):
                        if small_start + g * _i64(SMALL_ROWS) + i < m_ext:
                            for kv in range(_i64(k_ext // LANES)):
                                for kl in T.vectorized(_i64(LANES)):
                                    sc[_i64(xoff) + i * _i64(k_ext) + kv * _i64(LANES) + kl] = x_of(
                                        small_start + g * _i64(SMALL_ROWS) + i, kv * _i64(LANES) + kl)
                        else:
                            for kk in range(_i64(k_ext)):
                                sc[_i64(xoff) + i * _i64(k_ext) + kk] = T.float32(0)
                    for nb in range(_i64(tn // ns)):
                        for j in T.unroll(_i64(dot_tile)):
                            sc[vec(j * _i64(LANES))] = T.broadcast(T.float32(0), LANES)
                        for kv in range(_i64(k_ext // LANES)):
                            for i in T.unroll(_i64(SMALL_ROWS)):
                                for j in T.unroll(_i64(ns)):
                                    sc[vec((i * _i64(ns) + j) * _i64(LANES))] = dot_fma(sc, nb, kv, i, j)
                        for i in T.unroll(_i64(SMALL_ROWS)):
                            if small_start + g * _i64(SMALL_ROWS) + i < m_ext:
                                for j in T.unroll(_i64(ns)):
                                    sc[vec(_i64(hoff), 8)] = (sc[vec((i * _i64(ns) + j) * _i64(LANES), 8)]
                                                              + sc[vec((i * _i64(ns) + j) * _i64(LANES) + 8, 8)])
                                    sc[vec(_i64(hoff + 8), 4)] = sc[vec(_i64(hoff), 4)] + sc[vec(_i64(hoff + 4), 4)]
                                    sc[vec(_i64(hoff + 12), 2)] = (sc[vec(_i64(hoff + 8), 2)]
                                                                   + sc[vec(_i64(hoff + 10), 2)])
                                    dot_store(sc, t, small_start + g * _i64(SMALL_ROWS) + i, nb, i, j)

    return func
