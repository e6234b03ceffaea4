"""Paged-KV attention kernels for CPUs, vectorized: drop-in replacements for TVM's scalar CPU kernels.

TVM's `_attention_decode_cpu` (relax/frontend/nn/llm/_decode_kernels.py) walks the KV cache one row and one query
head at a time in scalar loops, calls libm's exp2 three times per score and checks the rotary mode per element. The
decode kernel here has exactly its signature (the paged KV cache calls it by position) and computes the same thing:

- one task per (sequence, KV head), in parallel: the `group` query heads that share a KV head are handled together,
  so every K and V row is loaded once for all of them;
- the KV rows are walked page by page (page_size rows, contiguous in memory for one head): the scores of a page
  are computed first (one vector dot product over head_dim per row and query head), then the online softmax is
  rescaled once per page with a vectorized exp2 over the page's scores, then the page's V rows are accumulated;
- vectors are `lanes` float32 wide (16 on AVX-512, 8 on AVX2, 4 on NEON), built as explicit expressions (ramp
  loads) and stored only into small local buffers: a vector value bound to a name would become a Let that the
  Relax build spills to a stack buffer and gathers back lane by lane.

Scores are in log2 units (q.k * sm_scale * log2 e) as in TVM's kernel, and lse is written the same way
(m + log2(d)), so the runtime's merge of attention states is unchanged. rotary_mode 1 (RoPE applied inside the
kernel, RopeMode.INLINE) is supported with TVM's own `_rope` expression, on a slower path that rotates each K row
into a local buffer first; the models here use RopeMode.NORMAL (RoPE applied before K enters the cache), which
the runtime passes as rotary_mode 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from tvm import tirx
from tvm.relax.frontend.nn.llm._kernel_common import _rope
from tvm.script import tirx as T
from tvm.target import Target
from tvm.target.codegen import target_has_features

DECODE_SYMBOL = "batch_decode_paged_kv_cpu"  # TVM's global symbol for the CPU decode kernel
LOG2E = math.log2(math.e)
NO_SCORE = -5e4  # TVM's initial running max (and the lse of a sequence with no KV rows)
MASKED = -3.0e38  # score of the rows past the end of the last page: below any real score
# 2^f on [-0.5, 0.5] = 1 + f P(f) (Cephes exp2f), relative error 1.7e-7
EXP2_POLY = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2,
             2.402264791363012e-1, 6.931472028550421e-1)


def vector_lanes(target: Target) -> int | None:
    """float32 lanes of the target's vector registers, or None for a target that is not an LLVM CPU."""
    if target.kind.name != "llvm":
        return None
    triple = str(target.attrs.get("mtriple", ""))
    if triple.startswith(("x86_64", "i686", "i386")) or not triple:
        if target_has_features("avx512f", target):
            return 16
        if target_has_features("avx2", target) or target_has_features("avx", target):
            return 8
        return 4
    return 4  # aarch64 NEON, and a safe width for other CPUs (LLVM legalizes it)


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """The shape parameters TVM's CPU attention kernels are built with."""

    num_kv_heads: int
    num_qo_heads: int
    head_dim: int
    dtype: str
    page_size: int

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    def supported(self, lanes: int) -> bool:
        return (self.num_qo_heads % self.num_kv_heads == 0 and self.head_dim % lanes == 0
                and self.head_dim % 2 == 0 and self.page_size % lanes == 0 and self.dtype in ("float32", "float16"))


def _vec(dtype: str, lanes: int) -> str:
    return f"{dtype}x{lanes}"


def _f32(expr, dtype: str, lanes: int):
    """A loaded `dtype` vector as float32 (float16 KV caches are widened on load)."""
    return expr if dtype == "float32" else T.Cast(_vec("float32", lanes), expr)


def _bcast(value, lanes: int):
    return T.broadcast(T.Cast("float32", value) if not isinstance(value, float) else T.float32(value), lanes)


def _tree(buf, base, lanes: int, combine):
    """Combine the `lanes` values buf[base : base + lanes] into one scalar: halves, then shuffles."""
    if lanes == 1:
        return buf[base]
    half = lanes // 2
    if half == 1:
        return combine(buf[base], buf[base + 1])
    vec = combine(buf[T.ramp(base, 1, half)], buf[T.ramp(base + half, 1, half)])
    while half > 2:
        half //= 2
        vec = combine(T.Shuffle([vec], list(range(half))), T.Shuffle([vec], list(range(half, 2 * half))))
    return combine(T.Shuffle([vec], [0]), T.Shuffle([vec], [1]))


def _hsum(buf, base, lanes: int):
    return _tree(buf, base, lanes, lambda a, b: a + b)


def _hmax(buf, base, lanes: int):
    return _tree(buf, base, lanes, T.max)


def _exp2(x, lanes: int):
    """2^x for a float32 vector x <= 0 (clamped at -126, where the result is 1.2e-38 rather than ~0): 2^n * 2^f
    with n = floor(x + 1/2), f = x - n in [-1/2, 1/2], 2^f by a degree-6 polynomial; relative error ~2e-7.
    `x` is an expression of loads and arithmetic; it is repeated, and LLVM computes it once."""
    x = T.max(x, _bcast(-126.0, lanes))
    n = T.floor(x + _bcast(0.5, lanes))
    f = x - n
    poly = _bcast(EXP2_POLY[0], lanes)
    for coef in EXP2_POLY[1:]:
        poly = poly * f + _bcast(coef, lanes)
    scale = T.reinterpret(_vec("float32", lanes), T.shift_left(
        T.Cast(_vec("int32", lanes), n) + T.broadcast(T.int32(127), lanes), T.broadcast(T.int32(23), lanes)))
    return (poly * f + _bcast(1.0, lanes)) * scale


def _sum(terms):
    return functools.reduce(lambda a, b: a + b, terms)


def attention_decode(shape: AttentionShape, lanes: int, rope_scaling: dict[str, Any] | None = None) -> tirx.PrimFunc:
    """The paged-KV decode kernel: TVM's `batch_decode_paged_kv_cpu` signature (no sliding window)."""
    rope_scaling = rope_scaling or {}
    H_qo, H_kv, D, P, G = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.page_size, shape.group
    dtype, VL = shape.dtype, lanes
    DC, PC = D // VL, P // VL  # vectors per head row, per page of scores
    assert shape.supported(VL), shape

    def q_chunk(q_loc, g, c):
        return q_loc[T.ramp(g * D + c * VL, 1, VL)]

    def dot_terms(q_loc, g, k_chunk):
        """sum_c q[g, chunk c] * k[chunk c]: VL partial sums of one score."""
        return _sum([q_chunk(q_loc, g, c) * k_chunk(c) for c in range(DC)])

    def page_k(pages, page, h, r):
        return lambda c: _f32(pages[page, 0, h, r, T.ramp(c * VL, 1, VL)], dtype, VL)

    def local_k(k_row):
        return lambda c: k_row[T.ramp(c * VL, 1, VL)]

    def page_v(pages, page, h, r, c):
        return _f32(pages[page, 1, h, r, T.ramp(c * VL, 1, VL)], dtype, VL)

    def lane_ids(c):
        return T.ramp(c * VL, 1, VL)

    @T.macro
    def head_task(task, rope, Q, pages, page_table_indptr, page_table_values, length_info, k_rope_pos_offset,
                  q_rope_position, output, lse, rope_scale, rope_theta, sm_scale):
        # query heads h*G .. h*G+G-1 of sequence b against KV head h; `rope` (a Python bool) selects the
        # rotary_mode 1 path when the kernel is built
        q_loc = T.alloc_buffer((G * D,), "float32")  # q * sm_scale * log2 e
        acc = T.alloc_buffer((G * D,), "float32")  # sum of p * V, at the running max
        scores = T.alloc_buffer((G * P,), "float32")  # one page's scores, then exp2
        part = T.alloc_buffer((VL,), "float32")
        k_row = T.alloc_buffer((D,), "float32")  # a rotated K row (rotary_mode 1)
        run_max = T.alloc_buffer((G,), "float32")
        run_sum = T.alloc_buffer((G,), "float32")
        new_max = T.alloc_buffer((1,), "float32")
        rescale = T.alloc_buffer((1,), "float32")
        # through a buffer: a float Let (as CSE would make of the product) breaks the CPU codegen's
        # parallel closure (an integer analyzer is bound to it)
        q_scale = T.alloc_buffer((1,), "float32")
        k_pos = T.alloc_buffer((1,), "int32")
        b: T.let[T.int32] = task // H_kv
        h: T.let[T.int32] = task % H_kv
        page_begin: T.let[T.int32] = page_table_indptr[b]
        num_pages: T.let[T.int32] = page_table_indptr[b + 1] - page_begin
        for g in T.unroll(G):
            run_max[g] = T.float32(NO_SCORE)
            run_sum[g] = T.float32(0)
            for c in T.unroll(DC):
                acc[T.ramp(g * D + c * VL, 1, VL)] = _bcast(0.0, VL)
        q_scale[0] = sm_scale * T.float32(LOG2E)
        if rope:
            for g in range(G):  # not unrolled: copies of the RoPE expression's Let would bind one var twice
                for d in range(D):
                    q_loc[g * D + d] = T.Cast("float32", _rope(
                        Q, q_rope_position[b], D, rope_theta, rope_scale, (b, h * G + g, d), dtype,
                        rope_scaling)) * q_scale[0]
        else:
            for g in T.unroll(G):
                for c in T.unroll(DC):
                    q_loc[T.ramp(g * D + c * VL, 1, VL)] = _f32(
                        Q[b, h * G + g, T.ramp(c * VL, 1, VL)], dtype, VL) * _bcast(q_scale[0], VL)
        for p in range(num_pages):
            page: T.let[T.int32] = page_table_values[page_begin + p]
            rows: T.let[T.int32] = T.if_then_else(p == num_pages - 1, length_info[b], P)
            # scores of the page's rows, for every query head of the group
            if rope:
                for r in range(rows):
                    # the position through a buffer: the codegen's integer analysis of the RoPE Let's value
                    # fails on p * P + r
                    k_pos[0] = k_rope_pos_offset[b] + p * P + r
                    for d in range(D):
                        k_row[d] = T.Cast("float32", _rope(
                            pages, k_pos[0], D, rope_theta, rope_scale,
                            (page, 0, h, r, d), dtype, rope_scaling))
                    for g in T.unroll(G):
                        part[T.ramp(0, 1, VL)] = dot_terms(q_loc, g, local_k(k_row))
                        scores[g * P + r] = _hsum(part, 0, VL)
            else:
                for r in range(rows):
                    for g in T.unroll(G):
                        part[T.ramp(0, 1, VL)] = dot_terms(q_loc, g, page_k(pages, page, h, r))
                        scores[g * P + r] = _hsum(part, 0, VL)
            for r in range(P - rows):
                for g in T.unroll(G):
                    scores[g * P + rows + r] = T.float32(MASKED)
            # online softmax, rescaled once per page
            for g in T.unroll(G):
                part[T.ramp(0, 1, VL)] = scores[T.ramp(g * P, 1, VL)]
                for c in T.unroll(PC - 1):
                    part[T.ramp(0, 1, VL)] = T.max(part[T.ramp(0, 1, VL)],
                                                   scores[T.ramp(g * P + (c + 1) * VL, 1, VL)])
                new_max[0] = T.max(run_max[g], _hmax(part, 0, VL))
                rescale[0] = T.exp2(run_max[g] - new_max[0])
                for c in T.unroll(PC):
                    scores[T.ramp(g * P + c * VL, 1, VL)] = T.Select(
                        lane_ids(c) < T.broadcast(rows, VL),
                        _exp2(scores[T.ramp(g * P + c * VL, 1, VL)] - _bcast(new_max[0], VL), VL),
                        _bcast(0.0, VL))
                part[T.ramp(0, 1, VL)] = scores[T.ramp(g * P, 1, VL)]
                for c in T.unroll(PC - 1):
                    part[T.ramp(0, 1, VL)] = part[T.ramp(0, 1, VL)] + scores[T.ramp(g * P + (c + 1) * VL, 1, VL)]
                run_sum[g] = run_sum[g] * rescale[0] + _hsum(part, 0, VL)
                run_max[g] = new_max[0]
                for c in T.unroll(DC):
                    acc[T.ramp(g * D + c * VL, 1, VL)] = acc[T.ramp(g * D + c * VL, 1, VL)] * _bcast(rescale[0], VL)
            # the page's V rows, weighted
            for r in range(rows):
                for g in T.unroll(G):
                    for c in T.unroll(DC):
                        acc[T.ramp(g * D + c * VL, 1, VL)] = (
                            acc[T.ramp(g * D + c * VL, 1, VL)]
                            + _bcast(scores[g * P + r], VL) * page_v(pages, page, h, r, c))
        for g in T.unroll(G):
            for c in T.unroll(DC):
                output[b, h * G + g, T.ramp(c * VL, 1, VL)] = T.Cast(_vec(dtype, VL), acc[
                    T.ramp(g * D + c * VL, 1, VL)] * _bcast(T.if_then_else(
                        run_sum[g] > T.float32(0), T.float32(1) / run_sum[g], T.float32(0)), VL))
            lse[b, h * G + g] = T.if_then_else(run_sum[g] > T.float32(0), run_max[g] + T.log2(run_sum[g]),
                                               T.float32(NO_SCORE))


    # pylint: disable=too-many-locals,too-many-statements
    @T.prim_func(private=True, s_tir=True)
    def batch_decode_paged_kv(
        Q_handle: T.handle,
        pages_handle: T.handle,
        page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle,
        var_length_info: T.handle,  # [b]: the rows used in the last page of each sequence
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()

        Q = T.match_buffer(Q_handle, (B, H_qo, D), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, H_kv, P, D), dtype)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (B, H_qo, D), dtype)
        lse = T.match_buffer(lse_handle, (B, H_qo), "float32")
        length_info = T.match_buffer(var_length_info, (B,), "int32", elem_offset=length_info_elem_offset)

        with T.sblock("root"):
            if rotary_mode == 1:
                # TVM's RoPE expression binds a float Let, which the parallel closure's codegen rejects
                for task in range(B * H_kv):
                    head_task(task, True, Q, pages, page_table_indptr, page_table_values, length_info,
                              k_rope_pos_offset, q_rope_position, output, lse, rope_scale, rope_theta, sm_scale)
            else:
                for task in T.parallel(B * H_kv):
                    head_task(task, False, Q, pages, page_table_indptr, page_table_values, length_info,
                              k_rope_pos_offset, q_rope_position, output, lse, rope_scale, rope_theta, sm_scale)

    return batch_decode_paged_kv.with_attr("global_symbol", DECODE_SYMBOL)
