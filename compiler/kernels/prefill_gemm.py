"""Prefill matmul on CPUs: Y[m, n] = sum_k X[m, k] * W[n, k] for many rows m, as an outer-product GEMM.

A register tile holds NR outputs along n times MP rows of X along m (MP/LANES vectors per n): each step of
k broadcasts NR scalars of W against MP/LANES vectors of X and adds NR * MP/LANES FMAs into the tile, with
no horizontal sums and one load per ~two FMAs. The vectors run along m, so X is first copied transposed into
panels of MP rows, xt[panel, k, m % MP] (zero rows past M): once per call, a few % of the FMAs. The weights
(a dequantize of packed codes, or plain floats) are dequantized one task tile of TN rows at a time into a
buffer local to the task, vectorized along k, and reused by every panel of X.

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

LANES = 16  # float32 lanes of a 512-bit vector


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """The tile sizes: NR outputs along n times MV vectors of LANES rows along m in registers; TN rows of W
    per parallel task; `w_lanes` lanes of the weight tile's dequantize along k (1: scalar)."""

    nr: int
    mv: int
    tn: int
    w_lanes: int
    tile_weights: bool  # False: broadcast the weights straight from W (plain float weights)

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

    def acc_vec(acc, r, v):
        return acc[T.ramp((r * mv + v) * LANES, 1, LANES)]

    def w_scalar(wd, t, nb, r, kk):
        if tiles.tile_weights:
            return wd[(nb * nr + r) * stride + kk]
        return w_of(t * tn + nb * nr + r, kk)

    def fma(acc, wd, xt, t, p, nb, kk, r, v):
        x_vec = xt[T.ramp((p * k_ext + kk) * mp + v * LANES, 1, LANES)]
        return acc_vec(acc, r, v) + T.broadcast(w_scalar(wd, t, nb, r, kk), LANES) * x_vec

    def lane(acc, r, i):
        return acc[(r * mv + i // LANES) * LANES + i % LANES]

    def out_store(t, p, nb, acc, i, r):
        buf, indices, value = store(p * mp + i, t * tn + nb * nr + r, lane(acc, r, i))
        return T.buffer_store(buf, value, indices)

    panels = (m_ext + _i64(mp - 1)) // _i64(mp)

    @T.prim_func(private=True, s_tir=True, check_well_formed=False)
    def func():
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        with T.sblock("root"):
            xt = T.alloc_buffer((panels * _i64(k_ext * mp),), "float32")
            # X transposed into panels of mp rows, zeros past the last row
            for p in T.parallel(panels):
                for i in range(_i64(mp)):
                    if p * _i64(mp) + i < m_ext:
                        for kk in range(_i64(k_ext)):
                            xt[(p * _i64(k_ext) + kk) * _i64(mp) + i] = x_of(p * _i64(mp) + i, kk)
                    else:
                        for kk in range(_i64(k_ext)):
                            xt[(p * _i64(k_ext) + kk) * _i64(mp) + i] = T.float32(0)
            for t in T.parallel(_i64(n_ext // tn)):
                wd = T.alloc_buffer((tn * stride if tiles.tile_weights else 1,), "float32", scope="local")
                if tiles.tile_weights:
                    for r in range(_i64(tn)):
                        for kv in range(_i64(k_ext // wl)):
                            for kl in T.vectorized(_i64(wl)):
                                wd[r * _i64(stride) + kv * _i64(wl) + kl] = w_of(t * _i64(tn) + r, kv * _i64(wl) + kl)
                for p in range(panels):
                    for nb in range(_i64(tn // nr)):
                        acc = T.alloc_buffer((nr * mp,), "float32", scope="local")
                        for j in T.unroll(_i64(nr * mv)):
                            acc[T.ramp(j * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
                        for kk in range(_i64(k_ext)):
                            for r in T.unroll(_i64(nr)):
                                for v in T.unroll(_i64(mv)):
                                    acc[T.ramp((r * mv + v) * LANES, 1, LANES)] = fma(
                                        acc, wd, xt, t, p, nb, kk, r, v)
                        if p * _i64(mp) + _i64(mp) <= m_ext:
                            for i in T.unroll(_i64(mp)):
                                for r in T.unroll(_i64(nr)):
                                    out_store(t, p, nb, acc, i, r)
                        else:
                            for i in T.unroll(_i64(mp)):
                                if p * _i64(mp) + i < m_ext:
                                    for r in T.unroll(_i64(nr)):
                                        out_store(t, p, nb, acc, i, r)

    return func
