"""Paged-KV attention kernels for CPUs, vectorized: drop-in replacements for TVM's scalar CPU kernels.

TVM's CPU kernels (`_attention_decode_cpu`, `_attention_prefill_cpu`, `_attention_prefill_ragged_cpu` in
relax/frontend/nn/llm) walk the keys one row and one query head at a time in scalar loops, call libm's exp2 per
score and check the rotary mode per element. The kernels here have exactly their signatures (the paged KV cache
calls them by position) and compute the same thing:

- decode: one parallel task per (sequence, chunk of at most CHUNK_PAGES pages; a short sequence is cut into
  MIN_DECODE_TASKS chunks, so that its few pages still spread over the cores); a task walks its pages in order, and per
  page first the K rows of every KV head (scores), then the V rows of every head, so K and V are each read in
  memory order: the hardware prefetchers then stream them (reading one head's 4 KiB blocks at a time, or adding
  software prefetches, was 1.5-2x slower from DRAM); a score's lanes are summed by shuffles of its dot product (not
  through a buffer; the same tree, so the same bits). The chunks' unnormalized states (sum of p V, running max,
  sum of p) are merged at the end;
- prefill (ragged: the new tokens among themselves; paged: the new tokens against the cached pages): one parallel
  task per (tile of QUERY_TILE query rows of one sequence, KV head), keys in blocks of 16 rows (a page for the
  paged kernel), causal mask as TVM's. The tile's query rows x the `group` query heads of the KV head lie along the
  vector lanes, so both products are GEMM micro-kernels with no horizontal sum: register tiles of FMAs of a
  broadcast K (or V) element and a vector of rows, sized to the target's vector registers; the online softmax per
  row is vertical (_prefill_tile_macro);
- decode: the `group` query heads that share a KV head are handled together, so each K and V row is loaded once for
  them; a page's scores are computed first (one vector dot product over head_dim per row and query head), then the
  online softmax is rescaled once per page with a vectorized exp2 (a polynomial, no libm call), then the V rows
  are accumulated;
- vectors are `lanes` float32 wide (16 on AVX-512, 8 on AVX2, 4 on NEON), built as explicit expressions (ramp
  loads) and stored only into small buffers: a vector value bound to a name would become a Let that the Relax
  build spills to a stack buffer and gathers back lane by lane.

What TVM 0.27's CPU lowering needs from such a kernel (each seen here): scalars that change go in 1-element
buffers and fixed ones in `T.let` (a plain `x = ...` in TVMScript becomes a 1-element buffer, and every
"local"-scope buffer becomes a TVMBackendAllocWorkspace call per task: small default-scope buffers are stack
allocas LLVM keeps in registers); no float Let inside a parallel loop (CSE makes one of a repeated product of
float scalars).

Scores are in log2 units (q.k * sm_scale * log2 e) as in TVM's kernels, and lse is written the same way
(m + log2(d)), so the runtime's merge of attention states is unchanged. A query row that sees no key (only
possible with fewer keys than causal queries) gets output 0 and lse -5e4, as a sequence with no KV rows does in
TVM's decode kernel (TVM's prefill kernels leave such rows undefined or uniform).

The kernels read K stored after RoPE: the models create their cache with RopeMode.NORMAL (RoPE applied as K is
appended, models/llama.py) or NONE (RoPE in the graph, models/rotary.py), which the runtime passes as rotary_mode 0.
They have no inline-RoPE path (RopeMode.INLINE, rotary_mode 1: RoPE applied to q and k inside attention): one
with TVM's `_rope` expression (a float Let, so serial loops only) cost every compile some 12 s of LLVM codegen for
the decode kernel alone, and no model used it. They fail on rotary_mode 1 (ROTARY_REFUSAL, an assertion) rather
than attend without RoPE, and ReplaceCPUAttention refuses a RopeMode.INLINE cache at compile time.

A quantized cache (AttentionShape.dtype "int8" or "int4", kv_cache_dtype.Carrier) keeps the same kernels: only the
KV layout changes (views of the declared float32 buffers; int8 codes loaded as floats, their row's scale applied to
the score and the V weight; int4 codes dequantized on load with their group's scale and min). Its RoPE is applied
when K is quantized (quantized_split_rotary, which replaces TVM's split + RoPE).
"""


from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from tvm import tirx
from tvm.script import tirx as T
from tvm.target import Target

from ..model_import.kv_cache_dtype import Carrier, carrier_for
from ..target.isa import cpu_isa
from . import paged_kv_signatures as signatures
from . import parse_cache
from .lane_sums import lane_sum, pairwise_sum

DECODE_SYMBOL = "batch_decode_paged_kv_cpu"  # TVM's global symbols of the CPU kernels replaced here
RAGGED_SYMBOL = "batch_prefill_ragged_kv"
PAGED_PREFILL_SYMBOL = "batch_prefill_paged_kv_cpu"
# the variants the cache calls for layers of attention kind "mha_sliding" (per-layer sliding window)
SLIDING_SUFFIX = "_sliding_window"
# module attr: the window of the "mha_sliding" layers, which TVM bakes into its sliding prefill kernel
LAYER_SLIDING_WINDOW_ATTR = "mobilec_layer_sliding_window"
# module attr: a window every layer has (Mistral, Phi-3), the cache keeping every key: a query at position i sees
# the keys at positions > i - window. Applied by the plain kernels (the layers stay "mha": TVM's runtime fails with
# every layer "mha_sliding")
SLIDING_WINDOW_ATTR = "mobilec_sliding_window"
# module attr: Gemma 2's attn_logit_softcapping, which TVM's kernels do not implement
ATTN_LOGIT_CAP_ATTR = "mobilec_attn_logit_softcapping"
SPLIT_ROTARY_SYMBOL = "fused_rope"  # a quantized cache replaces TVM's split + RoPE and merge of states too
MERGE_SYMBOL = "merge_state_inplace_cpu"
# The kernels read K stored after RoPE and have no inline-RoPE path; rather than attend without RoPE when asked for
# it (rotary_mode 1, which the runtime passes for a RopeMode.INLINE cache only), they fail
ROTARY_REFUSAL = ("mobilec's CPU attention kernels read K stored after RoPE (RopeMode.NORMAL or NONE): "
                  "rotary_mode 1 (RoPE inside attention, RopeMode.INLINE) is not supported")
LOG2E = math.log2(math.e)
CHUNK_PAGES = 8  # pages per parallel task of the decode kernel (128 tokens at page size 16)
# Decode tasks a sequence of up to MIN_DECODE_TASKS * CHUNK_PAGES pages is cut into: with one task per 8 pages, a
# 128-256 token context ran on one or two threads (SmolLM2 gguf decode, 2 threads, Zen 1: 12.0 -> 11.0 ms a step);
# 8 keeps 2, 4 and 8 cores busy, and the extra chunks' merge costs a few hundred vector adds.
MIN_DECODE_TASKS = 8
# Query rows of one sequence per task of the prefill kernels (times the group of query heads of one KV head): each
# key and V row is loaded once for them all
QUERY_TILE = 8
# Vector registers the prefill kernels' register tiles fit in (_register_tile) unless told the target's: the fewest
# of mobilec's CPUs (x86 AVX2; AVX-512 and NEON have 32)
MIN_VECTOR_REGISTERS = 16
NO_SCORE = -5e4  # TVM's initial running max (and the lse of a sequence with no KV rows)
MASKED = -3.0e38  # score of the rows past the end of the last page: below any real score
# 2^f on [-0.5, 0.5] = 1 + f P(f) (Cephes exp2f), relative error 1.7e-7
EXP2_POLY = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2,
             2.402264791363012e-1, 6.931472028550421e-1)


def vector_lanes(target: Target) -> int | None:
    """float32 lanes of the target's vector registers, or None for a target that is not an LLVM CPU."""
    isa = cpu_isa(target)
    return None if isa is None else isa.float_lanes


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """The shape parameters of the attention kernels (the model's real heads and head_dim), and the KV layout: how
    the cache stores K and V in the buffers the runtime passes. float32 / float16: the buffers are what they say.
    int8 / int4: they are declared as the float32 carrier of kv_cache_dtype.Carrier, and the kernels read them
    through views declared over the same memory: q and the output as (tokens, real heads, head_dim) float32 rows
    strided by the declared row, the K/V codes as rows of code_row elements of code_dtype (a declared row of `cell`
    floats is one real head's head_dim codes), and the parameters as floats of the declared buffer (`param`). The
    formats differ only in how a row loads as floats (`values`) and, for int8, in its scale applied to the score
    (_score) and to the V weight (`factored`)."""

    num_kv_heads: int
    num_qo_heads: int
    head_dim: int
    dtype: str
    page_size: int

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def carrier(self) -> Carrier | None:
        return carrier_for(self.dtype, self.num_qo_heads, self.num_kv_heads, self.head_dim)

    @property
    def factored(self) -> bool:
        """A row's one scale multiplies sums over its codes (int8: a score, a V weight) rather than each code: the
        same product, D times fewer multiplications. int4 rows (a scale and a min per group) dequantize on load."""
        c = self.carrier
        return c is not None and c.format.params == 1 and c.group(0) == c.group(1) == self.head_dim

    @property
    def float_dtype(self) -> str:
        """The dtype the buffers are declared with, and q's and the output's."""
        return "float32" if self.carrier is not None else self.dtype

    @property
    def code_dtype(self) -> str:
        """The element dtype of the K/V code views: the cache's own, or bytes of two codes (int4)."""
        return "uint8" if self.dtype == "int4" else self.dtype

    @property
    def code_row(self) -> int:
        """Elements of code_dtype per K/V head row."""
        return self.head_dim // 2 if self.dtype == "int4" else self.head_dim

    @property
    def declared(self) -> tuple[int, int, int]:
        """(query heads, KV heads, head_dim) of the buffers as the runtime allocates them."""
        c = self.carrier
        if c is None:
            return self.num_qo_heads, self.num_kv_heads, self.head_dim
        return c.declared_heads, c.declared_kv_heads, c.cell

    def values(self, load, param, c: int, lanes: int, kv: int):
        """Values [c * lanes, (c + 1) * lanes) of a K (kv 0) or V (kv 1) row as float32, `load(index)` reading the
        row of the code view at a ramp index and `param(group, i)` the row's parameters: a float cache's as loaded,
        int8 codes as they are (factored: the scale applies to sums), int4 codes dequantized with their group's
        scale and min (lanes / 2 bytes, code 2j in byte j's low nibble and 2j + 1 in its high one, interleaved
        back; a vector wider than a group takes each group's parameters in its lanes)."""
        if self.dtype != "int4":
            return _f32(load(T.ramp(c * lanes, 1, lanes)), self.dtype, lanes)
        half = lanes // 2
        raw = load(T.ramp(c * half, 1, half))
        low = T.bitwise_and(raw, T.broadcast(T.uint8(15), half))
        high = T.shift_right(raw, T.broadcast(T.uint8(4), half))
        codes = T.Cast(_vec("float32", lanes), T.Shuffle([low, high], [j // 2 + j % 2 * half for j in range(lanes)]))
        group = self.carrier.group(kv)
        if group >= lanes:
            first = c * lanes // group
            return codes * _bcast(param(first, 0), lanes) + _bcast(param(first, 1), lanes)
        groups = range(c * lanes // group, (c + 1) * lanes // group)
        scales, mins = ([_bcast(param(g, i), group) for g in groups] for i in (0, 1))
        return (codes * T.Shuffle(scales, list(range(lanes))) + T.Shuffle(mins, list(range(lanes))))

    def rows_view(self, buffer, n):
        """The real (n, heads, head_dim) query or output rows at the start of `buffer`'s declared rows."""
        heads_decl, _, cell = self.declared
        return T.decl_buffer((n, self.num_qo_heads, self.head_dim), self.float_dtype, data=buffer.data,
                             strides=(heads_decl * cell, self.head_dim, 1))

    def codes_view(self, buffer):
        """The K/V code view of declared K/V rows or pages (`buffer` itself for a float cache)."""
        return T.decl_buffer((*buffer.shape[:-1], self.code_row), self.code_dtype, data=buffer.data)

    def param(self, load, h, group, i: int, kv: int):
        """Parameter i (0: scale, 1: min) of channel group `group` of KV head h's K (kv 0) or V (kv 1) row,
        `load(declared head, cell)` reading the declared float32 buffer at its cell (param_cell's layout)."""
        cell = load(*self.carrier.param_position(h, group, kv))
        return cell if self.carrier.format.params == 1 else param_of_cell(cell, i)

    def supported(self, lanes: int) -> bool:
        c = self.carrier
        return (self.num_qo_heads % self.num_kv_heads == 0 and self.head_dim % lanes == 0
                and self.head_dim % 2 == 0 and self.page_size % lanes == 0
                and (self.dtype in ("float32", "float16") or c is not None
                     and self.head_dim % c.format.codes_per_cell == 0
                     and all(c.group(kv) % lanes == 0 or lanes % c.group(kv) == 0 for kv in (0, 1))))


def _bfloat16_bits(x):
    """The bfloat16 nearest float32 x (ties to even), as the high 16 bits of a uint32."""
    bits = T.reinterpret("uint32", x)
    rounded = bits + T.uint32(0x7FFF) + T.bitwise_and(T.shift_right(bits, T.uint32(16)), T.uint32(1))
    return T.bitwise_and(rounded, T.uint32(0xFFFF0000))


def param_cell(scale, low):
    """A float32 cell holding a group's scale (low half) and min (high half) as bfloat16: bit patterns only,
    moved whole by the runtime's copies."""
    return T.reinterpret("float32", T.bitwise_or(T.shift_right(_bfloat16_bits(scale), T.uint32(16)),
                                                 _bfloat16_bits(low)))


def param_of_cell(cell, i: int):
    """Parameter i (0: scale, 1: min) of a param_cell, as float32."""
    bits = T.reinterpret("uint32", cell)
    return T.reinterpret("float32", T.shift_left(bits, T.uint32(16)) if i == 0
                         else T.bitwise_and(bits, T.uint32(0xFFFF0000)))


def _vec(dtype: str, lanes: int) -> str:
    return f"{dtype}x{lanes}"


def _f32(expr, dtype: str, lanes: int):
    """A loaded `dtype` vector as float32 (float16 KV caches are widened on load)."""
    return expr if dtype == "float32" else T.Cast(_vec("float32", lanes), expr)


def _bcast(value, lanes: int):
    value = T.float32(value) if isinstance(value, float) else T.Cast("float32", value)
    return value if lanes == 1 else T.broadcast(value, lanes)


def _ibcast(value: int, lanes: int):
    return T.int32(value) if lanes == 1 else T.broadcast(T.int32(value), lanes)


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
    """2^x for float32 x <= 0 (a vector of `lanes`, or a scalar for lanes 1), clamped at -126 (2^-126 = 1.2e-38
    instead of ~0): 2^n * 2^f with n = floor(x + 1/2), f = x - n in [-1/2, 1/2], 2^f by a degree-6 polynomial;
    relative error ~2e-7. No libm call: a call would make LLVM spill every vector register around it.
    `x` is an expression of loads and arithmetic; it is repeated, and LLVM computes it once."""
    x = T.max(x, _bcast(-126.0, lanes))
    n = T.floor(x + _bcast(0.5, lanes))
    f = x - n
    poly = _bcast(EXP2_POLY[0], lanes)
    for coef in EXP2_POLY[1:]:
        poly = poly * f + _bcast(coef, lanes)
    bits = T.shift_left(T.Cast(_vec("int32", lanes) if lanes > 1 else "int32", n) + _ibcast(127, lanes),
                        _ibcast(23, lanes))
    return (poly * f + _bcast(1.0, lanes)) * T.reinterpret(_vec("float32", lanes) if lanes > 1 else "float32", bits)


def _sum(terms):
    return functools.reduce(lambda a, b: a + b, terms)


def _score(shape: AttentionShape, dot, param):
    """q . k from `dot` = q . (K row as loaded, AttentionShape.values): times the row's scale where it is factored
    out (int8); `param(group, i)`: the row's parameters."""
    return dot * param(0, 0) if shape.factored else dot


def _score_cap(cap: float, lanes: int = 1):
    """A T.macro capping `lanes` scores (scores[index], a ramp for a vector) in place as Gemma 2's
    attn_logit_softcapping does: cap * tanh(q.k * sm_scale / cap), in the kernels' log2 units (the score is
    q.k * sm_scale * log2 e), with tanh(x) = 1 - 2 / (1 + e^2x) and e^2x = 2^(2 score / cap) by _exp2 (clamped at
    2^126, where tanh is 1 in float32); the exponent goes through the `lanes`-element buffer `arg` (no float Let in a
    parallel loop). Nothing without a cap (0)."""

    capped = cap > 0
    at = T.ramp(0, 1, lanes) if lanes > 1 else 0

    @T.macro
    def cap_score(scores, index, arg):
        if capped:
            arg[at] = T.min(scores[index] * _bcast(2 / cap, lanes), _bcast(126.0, lanes))
            scores[index] = _bcast(cap * LOG2E, lanes) * (
                _bcast(1.0, lanes) - _bcast(2.0, lanes) / (_bcast(1.0, lanes) + _exp2(arg[at], lanes)))

    return cap_score


def _window_checks(sliding: bool):
    """A T.macro that fails a sliding-window kernel's call with what it does not implement: attention sinks (rows
    kept before the window, only from kv_state's sequence-wide sliding window, which mobilec never enables);
    nothing for the other kernels."""

    @T.macro
    def checks(length_info, batch):
        if sliding:
            for b in range(batch):
                assert length_info[2, b] == 0, "mobilec's sliding-window attention kernels have no attention sinks"

    return checks


# Parsed once (parse_cache): parsing a kernel's TVMScript takes ~0.5 s. The PrimFuncs are immutable IR, shared safely.
@parse_cache.cached
def attention_decode(shape: AttentionShape, lanes: int, *, chunk_pages: int = CHUNK_PAGES, sliding: bool = False,
                     window: int = 0, logit_cap: float = 0.0) -> tirx.PrimFunc:
    """The paged-KV decode kernel: TVM's `batch_decode_paged_kv_cpu` signature, or (`sliding`) its
    `_sliding_window` variant for "mha_sliding" layers: the cache passes the pages of the window only and length_info
    [3, b] (rows used in the last page, offset of the window's first row in the first page, attention-sink rows),
    and the keys are the rows from that offset on. Sinks (only from kv_state's sequence-wide sliding window, which
    mobilec never enables) fail an assert, as does rotary_mode 1 (ROTARY_REFUSAL). `window` (SLIDING_WINDOW_ATTR;
    not with `sliding`): every page is passed, and the query, the last key, sees the last `window` keys only.
    `logit_cap`: the scores capped (_score_cap)."""
    assert not (sliding and window), "a sliding layer's pages are its window's already"
    H_qo, H_kv, D, P, G = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.page_size, shape.group
    fdtype, VL, CH, MIN_TASKS = shape.float_dtype, lanes, chunk_pages, MIN_DECODE_TASKS
    H_qo_decl, H_kv_decl, D_decl = shape.declared
    DC, PC = D // VL, P // VL  # vectors per head row, per page of scores
    factored = shape.factored
    window_checks = _window_checks(sliding)
    cap_score = _score_cap(logit_cap)
    assert shape.supported(VL), shape

    def vec(base):
        return T.ramp(base, 1, VL)

    def page_param(pages_f, page, kv, h, r):
        """(group, i) -> parameter i of a group of the K (kv 0) or V (kv 1) row r of the page for KV head h."""
        return lambda group, i: shape.param(lambda row, cell: pages_f[page, kv, row, r, cell], h, group, i, kv)

    def page_k(pages, pages_f, page, h, r):
        return lambda c: shape.values(lambda index: pages[page, 0, h, r, index], page_param(pages_f, page, 0, h, r),
                                      c, VL, 0)

    def page_v(pages, pages_f, page, h, r, c):
        return shape.values(lambda index: pages[page, 1, h, r, index], page_param(pages_f, page, 1, h, r), c, VL, 1)

    def dot_terms(q_chunk, k_chunk):
        """sum_c q[chunk c] * k[chunk c]: VL partial sums of one score."""
        return _sum([q_chunk(c) * k_chunk(c) for c in range(DC)])

    def last_rows(length_info, b):
        return length_info[0, b] if sliding else length_info[b]

    def first_row(length_info, b, page_index, num_pages):
        """The first key row of the sequence's page `page_index`: the window's offset in its first page (sliding),
        the rows before the last `window` keys (window: P for a page before them), or 0."""
        if sliding:
            return T.if_then_else(page_index == 0, length_info[1, b], 0)
        if window:
            return T.min(T.max((num_pages - 1 - page_index) * P + last_rows(length_info, b) - window, 0), P)
        return 0

    def q_chunk(Q, b, hq, q_scale):
        """c -> chunk c of query head hq, times sm_scale * log2 e."""
        return lambda c: _f32(Q[b, hq, vec(c * VL)], fdtype, VL) * _bcast(q_scale[0], VL)

    @T.macro
    def chunk_task(task, n_chunks, per_chunk, Q, pages, pages_f, page_table_indptr, page_table_values, length_info,
                   part_acc, part_max, part_sum, sm_scale):
        # pages [c * per_chunk, (c + 1) * per_chunk) of sequence b, every head; the unnormalized state goes to
        # part_*[task]. Q, pages: the views of the KV layout (AttentionShape); pages_f: the pages as declared
        acc = T.alloc_buffer((G * D,), "float32")  # one KV head's query heads: sum of p * V at the running max
        scores = T.alloc_buffer((H_qo * P,), "float32")  # one page's scores, then their exp2
        part = T.alloc_buffer((VL,), "float32")
        new_max = T.alloc_buffer((1,), "float32")
        rescale = T.alloc_buffer((H_qo,), "float32")
        # through a buffer: a float Let (as CSE makes of a repeated product) breaks the CPU codegen
        q_scale = T.alloc_buffer((1,), "float32")
        cap_arg = T.alloc_buffer((1,), "float32")
        b: T.let[T.int32] = task // n_chunks
        page_begin: T.let[T.int32] = page_table_indptr[b]
        num_pages: T.let[T.int32] = page_table_indptr[b + 1] - page_begin
        first: T.let[T.int32] = task % n_chunks * per_chunk
        count: T.let[T.int32] = T.max(T.min(num_pages - first, per_chunk), 0)
        q_scale[0] = sm_scale * T.float32(LOG2E)
        for hq in range(H_qo):
            part_max[task * H_qo + hq] = T.float32(NO_SCORE)
            part_sum[task * H_qo + hq] = T.float32(0)
            for c in T.unroll(DC):
                part_acc[vec((task * H_qo + hq) * D + c * VL)] = _bcast(0.0, VL)
        for p in range(count):
            page: T.let[T.int32] = page_table_values[page_begin + first + p]
            rows: T.let[T.int32] = T.if_then_else(first + p == num_pages - 1, last_rows(length_info, b), P)
            start: T.let[T.int32] = first_row(length_info, b, first + p, num_pages)
            for h in range(H_kv):
                # scores of the page's rows [start, rows) for the G query heads of KV head h
                for r in range(start, rows):
                    for g in T.unroll(G):
                        # the lanes summed by shuffles of the dot product itself, not through a buffer
                        scores[(h * G + g) * P + r] = _score(shape, lane_sum(dot_terms(
                            q_chunk(Q, b, h * G + g, q_scale), page_k(pages, pages_f, page, h, r)), VL),
                            page_param(pages_f, page, 0, h, r))
                        cap_score(scores, (h * G + g) * P + r, cap_arg)
                for r in range(P - rows):
                    for g in T.unroll(G):
                        scores[(h * G + g) * P + rows + r] = T.float32(MASKED)
                for r in range(start):
                    for g in T.unroll(G):
                        scores[(h * G + g) * P + r] = T.float32(MASKED)
                # online softmax, rescaled once per page
                for g in T.unroll(G):
                    state: T.let[T.int32] = task * H_qo + h * G + g
                    row0: T.let[T.int32] = (h * G + g) * P
                    part[vec(0)] = scores[vec(row0)]
                    for c in T.unroll(PC - 1):
                        part[vec(0)] = T.max(part[vec(0)], scores[vec(row0 + (c + 1) * VL)])
                    new_max[0] = T.max(part_max[state], _hmax(part, 0, VL))
                    rescale[h * G + g] = _exp2(part_max[state] - new_max[0], 1)
                    for c in T.unroll(PC):
                        scores[vec(row0 + c * VL)] = T.Select(
                            T.ramp(c * VL, 1, VL) < T.broadcast(start, VL), _bcast(0.0, VL), T.Select(
                                T.ramp(c * VL, 1, VL) < T.broadcast(rows, VL),
                                _exp2(scores[vec(row0 + c * VL)] - _bcast(new_max[0], VL), VL), _bcast(0.0, VL)))
                    part[vec(0)] = scores[vec(row0)]
                    for c in T.unroll(PC - 1):
                        part[vec(0)] = part[vec(0)] + scores[vec(row0 + (c + 1) * VL)]
                    part_sum[state] = part_sum[state] * rescale[h * G + g] + _hsum(part, 0, VL)
                    part_max[state] = new_max[0]
            # the page's V rows, weighted: after all heads' scores, so K and V are each read in memory order
            for h in range(H_kv):
                for g in T.unroll(G):
                    for c in T.unroll(DC):
                        acc[vec(g * D + c * VL)] = part_acc[vec((task * H_qo + h * G + g) * D + c * VL)] * _bcast(
                            rescale[h * G + g], VL)
                for r in range(start, rows):
                    if factored:  # the V row's scale folded into its weights
                        for g in T.unroll(G):
                            scores[(h * G + g) * P + r] = scores[(h * G + g) * P + r] * page_param(
                                pages_f, page, 1, h, r)(0, 0)
                    for g in T.unroll(G):
                        for c in T.unroll(DC):
                            acc[vec(g * D + c * VL)] = (acc[vec(g * D + c * VL)] + _bcast(
                                scores[(h * G + g) * P + r], VL) * page_v(pages, pages_f, page, h, r, c))
                for g in T.unroll(G):
                    for c in T.unroll(DC):
                        part_acc[vec((task * H_qo + h * G + g) * D + c * VL)] = acc[vec(g * D + c * VL)]

    @T.macro
    def body(Q, pages, page_table_indptr, page_table_values, length_info, output, lse, rotary_mode, sm_scale, B,
             max_num_pages):
        with T.sblock("root"):
            assert rotary_mode == 0, ROTARY_REFUSAL
            window_checks(length_info, B)
            # the KV layout's views (AttentionShape): the buffers themselves for a float cache
            Q_rows = shape.rows_view(Q, B)
            output_rows = shape.rows_view(output, B)
            codes = shape.codes_view(pages)
            # each sequence's pages in chunks of at most CH (fewer pages each for a short sequence, so that there
            # are MIN_DECODE_TASKS of them): the chunks run in parallel, each keeps an unnormalized state (sum of
            # p * V, running max, sum of p) per query head, merged at the end
            most = T.alloc_buffer((1,), "int32")
            part_acc = T.alloc_buffer((B * ((max_num_pages + CH - 1) // CH + MIN_TASKS) * H_qo * D,), "float32")
            part_max = T.alloc_buffer((B * ((max_num_pages + CH - 1) // CH + MIN_TASKS) * H_qo,), "float32")
            part_sum = T.alloc_buffer((B * ((max_num_pages + CH - 1) // CH + MIN_TASKS) * H_qo,), "float32")
            merged = T.alloc_buffer((3,), "float32")  # max, sum, weight of a chunk
            out_row = T.alloc_buffer((D,), "float32")
            most[0] = 1
            for b in range(B):
                most[0] = T.max(most[0], page_table_indptr[b + 1] - page_table_indptr[b])
            per_chunk: T.let[T.int32] = T.min(CH, (most[0] + MIN_TASKS - 1) // MIN_TASKS)
            n_chunks: T.let[T.int32] = (most[0] + per_chunk - 1) // per_chunk
            for task in T.parallel(B * n_chunks):
                chunk_task(task, n_chunks, per_chunk, Q_rows, codes, pages, page_table_indptr, page_table_values,
                           length_info, part_acc, part_max, part_sum, sm_scale)
            for b in range(B):
                for hq in range(H_qo):
                    merged[0] = T.float32(NO_SCORE)
                    for c in range(n_chunks):
                        merged[0] = T.max(merged[0], part_max[(b * n_chunks + c) * H_qo + hq])
                    merged[1] = T.float32(0)
                    for c in range(n_chunks):
                        merged[1] = merged[1] + part_sum[(b * n_chunks + c) * H_qo + hq] * _exp2(
                            part_max[(b * n_chunks + c) * H_qo + hq] - merged[0], 1)
                    for d in T.unroll(DC):
                        out_row[vec(d * VL)] = _bcast(0.0, VL)
                    if merged[1] > T.float32(0):
                        for c in range(n_chunks):
                            merged[2] = _exp2(part_max[(b * n_chunks + c) * H_qo + hq] - merged[0], 1) / merged[1]
                            for d in T.unroll(DC):
                                out_row[vec(d * VL)] = out_row[vec(d * VL)] + part_acc[vec(
                                    ((b * n_chunks + c) * H_qo + hq) * D + d * VL)] * _bcast(merged[2], VL)
                        lse[b, hq] = merged[0] + T.log2(merged[1])
                    else:
                        lse[b, hq] = T.float32(NO_SCORE)
                    for d in T.unroll(DC):
                        output_rows[b, hq, vec(d * VL)] = T.Cast(_vec(fdtype, VL), out_row[vec(d * VL)])

    func = signatures.decode(body, heads=H_qo_decl, kv_heads=H_kv_decl, head_dim=D_decl, page_size=P,
                             dtype=fdtype, sliding=sliding)
    return func.with_attr("global_symbol", DECODE_SYMBOL + (SLIDING_SUFFIX if sliding else ""))


def _register_tile(vectors: int, extent: int, registers: int) -> int:
    """The largest divisor n of `extent` such that a register tile of n x `vectors` accumulators, the `vectors`
    operands it loads per step and one broadcast fit in `registers` vector registers (1 if none does)."""
    return max([n for n in range(1, extent + 1) if extent % n == 0 and (n + 1) * vectors + 1 <= registers] or [1])


def _prefill_tile_macro(shape: AttentionShape, lanes: int, paged: bool, block: int, sliding_window: int = 0,
                        window: int = 0, logit_cap: float = 0.0, registers: int = MIN_VECTOR_REGISTERS):
    """The work of one task of a prefill kernel, as a T.macro: up to QUERY_TILE consecutive query rows of one
    sequence and one KV head, its `group` query heads each, walking the keys that any of the rows sees (causal: up
    to a row's own position, aligned at the end of the keys) in blocks of `block` rows, as the decode kernel walks
    pages. Keys are the ragged k/v rows of the new tokens, or (`paged`) the sequence's pages, a block being a page.

    The tile's QUERY_TILE * group query heads are its rows (row i * group + g: query row i, head g), padded to whole
    vectors of `lanes`, and lie along the vector lanes: the queries are transposed once per tile (q^T: head_dim x
    rows), and each block's K and V rows widened once into float32 blocks. Then both products are GEMM micro-kernels
    with no horizontal sum: scores (keys x rows) = K q^T by register tiles of KT keys x the rows, one FMA of a
    broadcast K element and a vector of rows per key and vector; the online softmax per row is vertical (a block's
    max and sum over its keys, exp2 for a vector of rows); and the output, also transposed (head_dim x rows),
    accumulates P^T V by register tiles of DT head_dim columns x the rows, one FMA of a broadcast V element and a
    vector of the rows' weights. KT and DT fill the target's `registers` vector registers (_register_tile: 4 x 3
    vectors on AVX2, 8 x 2 on AVX-512, 4 x 6 on NEON). A row's keys outside its own range [lo, hi) get score MASKED
    and weight 0. SmolLM2's shape (9 query heads, 3 KV heads, float16 pages), a 301-token turn over 1328 cached
    tokens, one thread of a Zen 3 (CPU time, bench/prefill_attention_kernels.py): the paged kernel takes 13.4 ms a
    layer (~88% of the core's float32 FMA peak at 2.45 GHz; the product loops are bound by the FMA units, the rest
    is the softmax, the widening of K and V and the output tile's loads and stores), where each score as a dot
    product summed by shuffles took 21.1 ms.

    With a `sliding_window` (paged only: the "mha_sliding" layers' kernel) the pages are the window's, its keys start
    at length_info[1, b] in the first page, and with `causal` the query row i of a sequence sees only the last
    max(window - i - 1, 0) of them, as TVM's _causal_or_sliding_cross_mask (the cached keys before the new tokens,
    which the ragged kernel covers). `window` (SLIDING_WINDOW_ATTR; not with `sliding_window`): the keys are all the
    sequence's, and query row i, at position p (causal: the keys end with the new tokens, p = kv_len - qo_len + i;
    else they are all before them, p = kv_len + i), sees the keys at positions > p - window. `logit_cap`:
    _score_cap."""
    assert not (sliding_window and window), "a sliding layer's pages are its window's already"
    H_kv, D, G, QT = shape.num_kv_heads, shape.head_dim, shape.group, QUERY_TILE
    fdtype, VL, P = shape.float_dtype, lanes, block
    DC = D // VL
    R = -(-QT * G // VL) * VL  # the tile's rows, padded to whole vectors
    RV = R // VL
    KT, DT = _register_tile(RV, P, registers), _register_tile(RV, D, registers)
    factored = shape.factored
    cap_score = _score_cap(logit_cap, VL)

    def vec(base):
        return T.ramp(base, 1, VL)

    def key(k, v, page_values, kv_begin, blk, h, r, kv, index):
        """Element(s) `index` of key row r of block blk (kv 0: K, 1: V)."""
        if paged:
            return k[page_values[kv_begin + blk], kv, h, r, index]
        return (k if kv == 0 else v)[kv_begin + blk * P + r, h, index]

    def last_rows(length_info, b):
        return length_info[0, b] if sliding_window else length_info[b]

    def window_offset(length_info, b):
        """Rows of the first page before the keys (the sliding window's start)."""
        return length_info[1, b] if sliding_window else 0

    def first_visible(causal, kv_len, qo_len, row):
        """The first key the query row sees: past the window, or 0."""
        if sliding_window:
            return T.if_then_else(causal > 0, T.max(kv_len - T.max(sliding_window - row - 1, 0), 0), 0)
        if window:  # position + 1 - window
            return T.max(T.if_then_else(causal > 0, kv_len - qo_len, kv_len) + row + 1 - window, 0)
        return 0

    def key_param(k_f, v_f, page_values, kv_begin, blk, h, r, kv):
        """(group, i) -> parameter i of a group of key row r of block blk (a quantized cache), from the declared
        buffers."""
        if paged:
            return lambda group, i: shape.param(
                lambda row, cell: k_f[page_values[kv_begin + blk], kv, row, r, cell], h, group, i, kv)
        return lambda group, i: shape.param(
            lambda row, cell: (k_f if kv == 0 else v_f)[kv_begin + blk * P + r, row, cell], h, group, i, kv)

    def row_chunk(k, v, k_f, v_f, page_values, kv_begin, blk, h, r, c, kv):
        """Chunk c of K (kv 0) or V (kv 1) row r of block blk as float32 (AttentionShape.values), times the row's
        scale where that is factored out (int8)."""
        values = shape.values(lambda index: key(k, v, page_values, kv_begin, blk, h, r, kv, index),
                              key_param(k_f, v_f, page_values, kv_begin, blk, h, r, kv), c, VL, kv)
        if factored:
            return values * _bcast(key_param(k_f, v_f, page_values, kv_begin, blk, h, r, kv)(0, 0), VL)
        return values

    def seen(lo, hi, position, j, value, otherwise):
        """`value` in the lanes of vector j of rows that see the key at `position`, else `otherwise`."""
        at = T.broadcast(position, VL)
        return T.Select(at < lo[vec(j * VL)], otherwise, T.Select(at < hi[vec(j * VL)], value, otherwise))

    @T.macro
    def query_tile(tile, h, q, q_indptr, k, v, k_f, v_f, kv_indptr, page_values, length_info, output, lse,
                   batch_size, causal, sm_scale):
        # tile: the task's tile of query rows, counted over the sequences' tiles (a sequence's last one may be
        # short; `tile` past the last one does nothing). k, v: the ragged keys and values (paged: both the pages);
        # kv_indptr: ragged rows or (paged) pages. q, k, v, output: the views of the KV layout (AttentionShape);
        # k_f, v_f: k and v as declared
        qs = T.alloc_buffer((D * R,), "float32")  # q^T [d * R + row], times sm_scale * log2 e
        acc = T.alloc_buffer((D * R,), "float32")  # (sum of p * V at the running max)^T
        scores = T.alloc_buffer((P * R,), "float32")  # a block's scores [key * R + row], then their exp2
        keys = T.alloc_buffer((P * D,), "float32")  # the block's K rows [key * D + d], as float32
        values = T.alloc_buffer((P * D,), "float32")  # and its V rows
        tile_acc = T.alloc_buffer((max(KT, DT) * RV * VL,), "float32")  # a register tile's accumulators
        run_max = T.alloc_buffer((R,), "float32")
        run_sum = T.alloc_buffer((R,), "float32")
        new_max = T.alloc_buffer((R,), "float32")
        rescale = T.alloc_buffer((R,), "float32")
        q_scale = T.alloc_buffer((1,), "float32")  # a float Let (CSE of a repeated product) breaks the codegen
        norm = T.alloc_buffer((1,), "float32")
        cap_arg = T.alloc_buffer((VL,), "float32")
        # the tile's sequence, first row and rows; each row's visible keys [lo, hi) as rows of the blocks (paged:
        # of the pages, from the window's offset; an empty range past the tile's rows); the block's rows any row sees
        where = T.alloc_buffer((4,), "int32")
        lo = T.alloc_buffer((R,), "int32")
        hi = T.alloc_buffer((R,), "int32")
        span = T.alloc_buffer((2,), "int32")
        where[0] = -1
        where[3] = 0  # tiles of the sequences before
        for s in range(batch_size):
            if where[3] <= tile and tile < where[3] + (q_indptr[s + 1] - q_indptr[s] + QT - 1) // QT:
                where[0] = s
                where[1] = q_indptr[s] + (tile - where[3]) * QT
                where[2] = T.min(q_indptr[s + 1] - where[1], QT)
            where[3] = where[3] + (q_indptr[s + 1] - q_indptr[s] + QT - 1) // QT
        if where[0] >= 0:
            b: T.let[T.int32] = where[0]
            t0: T.let[T.int32] = where[1]
            n_rows: T.let[T.int32] = where[2]
            kv_begin: T.let[T.int32] = kv_indptr[b]
            kv_len: T.let[T.int32] = (
                T.if_then_else(kv_indptr[b + 1] > kv_begin, (kv_indptr[b + 1] - kv_begin - 1) * P
                               + last_rows(length_info, b) - window_offset(length_info, b), 0)
                if paged else kv_indptr[b + 1] - kv_begin)
            qo_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
            q_scale[0] = sm_scale * T.float32(LOG2E)
            for i in range(QT):
                for g in T.unroll(G):
                    if i < n_rows:
                        # causal: key j is visible to query row i of a sequence of qo_len rows if
                        # j < kv_len - qo_len + i + 1 (sliding window: the keys are cached ones, all before the row,
                        # and the window cuts the oldest)
                        lo[i * G + g] = first_visible(causal, kv_len, qo_len, t0 + i - q_indptr[b]) + window_offset(
                            length_info, b)
                        hi[i * G + g] = (T.if_then_else(
                            causal > 0, T.max(T.min(kv_len - qo_len + (t0 + i - q_indptr[b]) + 1, kv_len), 0), kv_len)
                            if not sliding_window else kv_len) + window_offset(length_info, b)
                    else:
                        lo[i * G + g] = T.int32(1 << 30)
                        hi[i * G + g] = 0
                    for d in range(D):
                        # rows past the tile's last repeat it (never seen: their range is empty)
                        qs[d * R + i * G + g] = T.Cast("float32", q[t0 + T.min(i, n_rows - 1), h * G + g, d]) * (
                            q_scale[0])
            for j in range(R - QT * G):  # the padding rows: no key, q 0
                lo[QT * G + j] = T.int32(1 << 30)
                hi[QT * G + j] = 0
                for d in range(D):
                    qs[d * R + QT * G + j] = T.float32(0)
            for j in T.unroll(RV):
                run_max[vec(j * VL)] = _bcast(NO_SCORE, VL)
                run_sum[vec(j * VL)] = _bcast(0.0, VL)
            for d in range(D):
                for j in T.unroll(RV):
                    acc[vec(d * R + j * VL)] = _bcast(0.0, VL)
            span[0] = lo[0]
            span[1] = hi[0]
            for j in range(R - 1):
                span[0] = T.min(span[0], lo[j + 1])
                span[1] = T.max(span[1], hi[j + 1])
            for blk in range(span[0] // P, (span[1] + P - 1) // P):
                # the block's rows any query row sees: [first, last); the others are never read (their scores
                # are masked, their weights 0 and their V rows not accumulated)
                first: T.let[T.int32] = T.max(span[0] - blk * P, 0)
                last: T.let[T.int32] = T.min(span[1] - blk * P, P)
                for r in range(first, last):
                    for c in T.unroll(DC):
                        keys[vec(r * D + c * VL)] = row_chunk(k, v, k_f, v_f, page_values, kv_begin, blk, h, r, c, 0)
                        values[vec(r * D + c * VL)] = row_chunk(k, v, k_f, v_f, page_values, kv_begin, blk, h, r, c,
                                                                1)
                # scores = K q^T by register tiles of KT keys x R rows
                for kt in range(P // KT):
                    for j in T.unroll(KT * RV):
                        tile_acc[vec(j * VL)] = _bcast(0.0, VL)
                    for d in range(D):
                        for kk in T.unroll(KT):
                            for j in T.unroll(RV):
                                tile_acc[vec((kk * RV + j) * VL)] = tile_acc[vec((kk * RV + j) * VL)] + _bcast(
                                    keys[(kt * KT + kk) * D + d], VL) * qs[vec(d * R + j * VL)]
                    for kk in T.unroll(KT):
                        for j in T.unroll(RV):
                            scores[vec((kt * KT + kk) * R + j * VL)] = tile_acc[vec((kk * RV + j) * VL)]
                            cap_score(scores, vec((kt * KT + kk) * R + j * VL), cap_arg)
                            scores[vec((kt * KT + kk) * R + j * VL)] = seen(
                                lo, hi, blk * P + kt * KT + kk, j, scores[vec((kt * KT + kk) * R + j * VL)],
                                _bcast(MASKED, VL))
                # online softmax per row, rescaled once per block
                for j in T.unroll(RV):
                    new_max[vec(j * VL)] = T.max(run_max[vec(j * VL)], pairwise_sum(
                        [scores[vec(r * R + j * VL)] for r in range(P)], T.max))
                    rescale[vec(j * VL)] = _exp2(run_max[vec(j * VL)] - new_max[vec(j * VL)], VL)
                    for r in T.unroll(P):
                        scores[vec(r * R + j * VL)] = seen(
                            lo, hi, blk * P + r, j, _exp2(scores[vec(r * R + j * VL)] - new_max[vec(j * VL)], VL),
                            _bcast(0.0, VL))
                    run_sum[vec(j * VL)] = run_sum[vec(j * VL)] * rescale[vec(j * VL)] + pairwise_sum(
                        [scores[vec(r * R + j * VL)] for r in range(P)])
                    run_max[vec(j * VL)] = new_max[vec(j * VL)]
                # acc^T = acc^T * rescale + V^T p by register tiles of DT head_dim columns x R rows
                for dt in range(D // DT):
                    for dd in T.unroll(DT):
                        for j in T.unroll(RV):
                            tile_acc[vec((dd * RV + j) * VL)] = acc[vec((dt * DT + dd) * R + j * VL)] * rescale[
                                vec(j * VL)]
                    for r in range(first, last):
                        for dd in T.unroll(DT):
                            for j in T.unroll(RV):
                                tile_acc[vec((dd * RV + j) * VL)] = tile_acc[vec((dd * RV + j) * VL)] + _bcast(
                                    values[r * D + dt * DT + dd], VL) * scores[vec(r * R + j * VL)]
                    for dd in T.unroll(DT):
                        for j in T.unroll(RV):
                            acc[vec((dt * DT + dd) * R + j * VL)] = tile_acc[vec((dd * RV + j) * VL)]
            for i in range(n_rows):
                for g in T.unroll(G):
                    norm[0] = T.if_then_else(run_sum[i * G + g] > T.float32(0), T.float32(1) / run_sum[i * G + g],
                                             T.float32(0))
                    for d in range(D):
                        output[t0 + i, h * G + g, d] = T.Cast(fdtype, acc[d * R + i * G + g] * norm[0])
                    lse[t0 + i, h * G + g] = T.if_then_else(run_sum[i * G + g] > T.float32(0),
                                                            run_max[i * G + g] + T.log2(run_sum[i * G + g]),
                                                            T.float32(NO_SCORE))

    return query_tile


@parse_cache.cached
def attention_prefill_ragged(shape: AttentionShape, lanes: int, *, registers: int = MIN_VECTOR_REGISTERS,
                             block: int = 16, window: int = 0, logit_cap: float = 0.0) -> tirx.PrimFunc:
    """Self-attention among the new tokens of a prefill: TVM's `batch_prefill_ragged_kv` signature (its CPU
    variant, `_attention_prefill_ragged_cpu`), head_dim the same for q/k and v. One parallel task per tile of query
    rows and KV head (_prefill_tile_macro), keys in blocks of `block` rows; shape.page_size is not used. `window`:
    every layer's (_prefill_tile_macro). rotary_mode 1 fails an assert (ROTARY_REFUSAL)."""
    fdtype, H_kv = shape.float_dtype, shape.num_kv_heads
    H_qo_decl, H_kv_decl, D_decl = shape.declared
    assert shape.supported(lanes) and block % lanes == 0, shape
    query_tile = _prefill_tile_macro(shape, lanes, paged=False, block=block, window=window, logit_cap=logit_cap,
                                     registers=registers)

    @T.macro
    def body(q, q_indptr, k, v, kv_indptr, output, lse, causal, rotary_mode, sm_scale, batch_size, qo_len, kv_len):
        with T.sblock("root"):
            assert rotary_mode == 0, ROTARY_REFUSAL
            # the KV layout's views (AttentionShape): the buffers themselves for a float cache
            q_rows = shape.rows_view(q, qo_len)
            output_rows = shape.rows_view(output, qo_len)
            k_codes = shape.codes_view(k)
            v_codes = shape.codes_view(v)
            for task in T.parallel(((qo_len + QUERY_TILE - 1) // QUERY_TILE + batch_size) * H_kv):
                query_tile(task // H_kv, task % H_kv, q_rows, q_indptr, k_codes, v_codes, k, v, kv_indptr, None,
                           None, output_rows, lse, batch_size, causal, sm_scale)

    func = signatures.ragged_prefill(body, heads=H_qo_decl, kv_heads=H_kv_decl, head_dim=D_decl, dtype=fdtype)
    return func.with_attr("global_symbol", RAGGED_SYMBOL)


@parse_cache.cached
def attention_prefill_paged(shape: AttentionShape, lanes: int, *, registers: int = MIN_VECTOR_REGISTERS,
                            sliding_window: int = 0, window: int = 0, logit_cap: float = 0.0) -> tirx.PrimFunc:
    """New tokens against the KV cache's pages (a prefill after earlier tokens, or a chunked one): TVM's
    `batch_prefill_paged_kv_cpu` signature, or (a `sliding_window`) its `_sliding_window` variant for the
    "mha_sliding" layers (_prefill_tile_macro; no sinks: _window_checks); `window`: every layer's, every page passed
    (_prefill_tile_macro). One parallel task per tile of query rows and KV head, one block per page. rotary_mode 1 fails an assert
    (ROTARY_REFUSAL)."""
    P, fdtype, H_kv = shape.page_size, shape.float_dtype, shape.num_kv_heads
    H_qo_decl, H_kv_decl, D_decl = shape.declared
    sliding = sliding_window > 0
    window_checks = _window_checks(sliding)
    assert shape.supported(lanes), shape
    query_tile = _prefill_tile_macro(shape, lanes, paged=True, block=P, sliding_window=sliding_window,
                                     window=window, logit_cap=logit_cap, registers=registers)

    @T.macro
    def body(q, q_indptr, pages, page_indptr, page_values, length_info, output, lse, causal, rotary_mode, sm_scale,
             batch_size, total_len, max_num_pages):
        with T.sblock("root"):
            assert rotary_mode == 0, ROTARY_REFUSAL
            window_checks(length_info, batch_size)
            # the KV layout's views (AttentionShape): the buffers themselves for a float cache
            q_rows = shape.rows_view(q, total_len)
            output_rows = shape.rows_view(output, total_len)
            codes = shape.codes_view(pages)
            for task in T.parallel(((total_len + QUERY_TILE - 1) // QUERY_TILE + batch_size) * H_kv):
                query_tile(task // H_kv, task % H_kv, q_rows, q_indptr, codes, codes, pages, pages, page_indptr,
                           page_values, length_info, output_rows, lse, batch_size, causal, sm_scale)

    func = signatures.paged_prefill(body, heads=H_qo_decl, kv_heads=H_kv_decl, head_dim=D_decl, page_size=P,
                                    dtype=fdtype, sliding=sliding)
    return func.with_attr("global_symbol",
                                                PAGED_PREFILL_SYMBOL + (SLIDING_SUFFIX if sliding else ""))


def rope_angle(head_dim: int, rope_theta: float, rope_scale: float, rope_scaling: dict[str, Any] | None):
    """A T.macro: freq[0] = the RoPE angle of pair i at `position` as TVM's llama_rope_with_position_map computes
    it (freq = position * rope_scale / theta^(2i / head_dim); with `rope_scaling` llama3, that inverse frequency
    smoothed as TVM's rope_freq_llama3 does); `freq`: 3 floats of scratch (a float Let inside a parallel loop breaks
    the CPU codegen)."""
    kind = (rope_scaling or {}).get("rope_type")
    if kind not in (None, "llama3"):
        raise ValueError(f"quantized_split_rotary: RoPE scaling {kind!r} is not implemented")
    llama3 = _llama3_constants(rope_scaling) if kind == "llama3" else None

    @T.macro
    def angle(freq, i, position):
        if llama3 is None:
            freq[0] = T.Cast("float32", position) * T.float32(rope_scale) / T.pow(
                T.float32(rope_theta), T.Cast("float32", i * 2) / T.float32(head_dim))
        else:  # freq[1]: the plain inverse frequency, freq[2]: its smoothing weight
            freq[1] = T.float32(1) / T.pow(T.float32(rope_theta), T.Cast("float32", i * 2) / T.float32(head_dim))
            freq[2] = T.max(T.float32(0), T.min(T.float32(1), T.float32(llama3[1]) * freq[1] - T.float32(llama3[2])))
            freq[0] = T.Cast("float32", position) * T.float32(rope_scale) * (
                (T.float32(1) - freq[2]) * freq[1] * T.float32(llama3[0]) + freq[2] * freq[1])

    return angle


def row_quantizer(shape: AttentionShape, kv: int):
    """A T.macro quantizing one K (kv 0) or V (kv 1) row (`row`: head_dim floats) of token s and KV head h in the
    cache's format (kv_cache_dtype.CODE_FORMATS): the codes into `codes` (the code view), the parameter cells into
    `params` (the declared float32 buffer); `stat`: 2 floats of scratch. int8 scale = max|x| / 127, codes
    round(x / scale); int4 per group of channels scale = (max - min) / 15 and min, stored as bfloat16
    (param_cell), codes round((x - min) / scale) with the stored two, in [0, 15], two to a byte."""
    c = shape.carrier
    assert c is not None, shape
    D, GS = shape.head_dim, c.group(kv)

    def prow(h, group):
        return c.param_position(h, group, kv)[0]

    def pcell(h, group):
        return c.param_position(h, group, kv)[1]

    def nibble(x, stat):
        """The int4 code of x, stat[0] the group's stored min and stat[1] 1 / its stored scale."""
        return T.Cast("uint8", T.max(T.min(T.round((x - stat[0]) * stat[1]), T.float32(15)), T.float32(0)))

    @T.macro
    def quantize_int8(row, codes, params, s, h, stat):
        stat[0] = T.float32(0)
        for d in range(D):
            stat[0] = T.max(stat[0], T.fabs(row[d]))
        params[s, prow(h, 0), pcell(h, 0)] = stat[0] / T.float32(127)
        stat[0] = T.if_then_else(stat[0] > T.float32(0), T.float32(127) / stat[0], T.float32(0))
        for d in range(D):
            codes[s, h, d] = T.Cast("int8", T.round(row[d] * stat[0]))

    @T.macro
    def quantize_int4(row, codes, params, s, h, stat):
        for group in range(D // GS):
            stat[0] = row[group * GS]  # min
            stat[1] = row[group * GS]  # max
            for d in range(GS):
                stat[0] = T.min(stat[0], row[group * GS + d])
                stat[1] = T.max(stat[1], row[group * GS + d])
            params[s, prow(h, group), pcell(h, group)] = param_cell((stat[1] - stat[0]) / T.float32(15), stat[0])
            # the codes are taken against the parameters as stored (bfloat16)
            stat[0] = param_of_cell(params[s, prow(h, group), pcell(h, group)], 1)
            stat[1] = param_of_cell(params[s, prow(h, group), pcell(h, group)], 0)
            stat[1] = T.if_then_else(stat[1] > T.float32(0), T.float32(1) / stat[1], T.float32(0))
            for j in range(GS // 2):
                codes[s, h, group * GS // 2 + j] = T.bitwise_or(
                    nibble(row[group * GS + 2 * j], stat), T.shift_left(nibble(row[group * GS + 2 * j + 1], stat),
                                                                       T.uint8(4)))

    return {"int8": quantize_int8, "int4": quantize_int4}[shape.dtype]


def param_padding_zeroer(shape: AttentionShape, kv: int):
    """A T.macro zeroing the cells of token s's K (kv 0) or V (kv 1) parameter rows that hold no parameter (the
    rows' cells after the last KV head's): no kernel reads them, but the cache's append copies whole declared rows
    into the pages, which would copy memory never written (Oclgrind's uninitialized-value check found it)."""
    c = shape.carrier
    assert c is not None, shape
    used = c.kv_heads * c.row_params(kv)

    @T.macro
    def zero_padding(params, s):
        for i in range(c.param_rows * c.cell - used):
            params[s, c.kv_heads + (used + i) // c.cell, (used + i) % c.cell] = T.float32(0)

    return zero_padding


@parse_cache.cached
def quantized_split_rotary(shape: AttentionShape, rope_theta: float, rope_scale: float = 1.0,
                           rope_scaling: dict[str, Any] | None = None) -> tirx.PrimFunc:
    """A quantized cache's `tir_split_rotary` (TVM's `fused_rope` signature: qkv, position_map, q, k, v, apply_rope),
    on the float32 carrier (kv_cache_dtype.Carrier): reads the fused projection output as the real (tokens,
    heads + 2 kv_heads, head_dim) floats, applies RoPE to q and k as TVM's llama_rope_with_position_map does
    (rotate-half, rope_angle, when apply_rope > 0), writes q to the start of its declared rows and quantizes k
    (after RoPE) and v per token and KV head (row_quantizer). One parallel task per token; cos and sin go through
    buffers (a float Let inside a parallel loop breaks the CPU codegen)."""
    c = shape.carrier
    assert c is not None, shape
    H_qo, H_kv, D = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim
    HALF = D // 2
    angle = rope_angle(D, rope_theta, rope_scale, rope_scaling)
    quantize_k, quantize_v = row_quantizer(shape, 0), row_quantizer(shape, 1)
    pad_k, pad_v = param_padding_zeroer(shape, 0), param_padding_zeroer(shape, 1)

    @T.macro
    def body(qkv_rows, position_map, q_rows, k_codes, v_codes, k, v, apply_rope, seq_len):
        for s in T.parallel(seq_len):
            cos = T.alloc_buffer((HALF,), "float32")
            sin = T.alloc_buffer((HALF,), "float32")
            freq = T.alloc_buffer((3,), "float32")
            row = T.alloc_buffer((D,), "float32")
            stat = T.alloc_buffer((2,), "float32")  # the row's statistics
            for i in range(HALF):
                angle(freq, i, position_map[s])
                cos[i] = T.cos(freq[0])
                sin[i] = T.sin(freq[0])
            for h in range(H_qo + H_kv):  # q and k heads: RoPE
                if apply_rope > 0:
                    for i in range(HALF):
                        row[i] = cos[i] * qkv_rows[s, h, i] - sin[i] * qkv_rows[s, h, i + HALF]
                        row[i + HALF] = cos[i] * qkv_rows[s, h, i + HALF] + sin[i] * qkv_rows[s, h, i]
                else:
                    for d in range(D):
                        row[d] = qkv_rows[s, h, d]
                if h < H_qo:
                    for d in range(D):
                        q_rows[s, h, d] = row[d]
                else:
                    quantize_k(row, k_codes, k, s, h - H_qo, stat)
            for h in range(H_kv):
                for d in range(D):
                    row[d] = qkv_rows[s, H_qo + H_kv + h, d]
                quantize_v(row, v_codes, v, s, h, stat)
            pad_k(k, s)
            pad_v(v, s)

    return split_rotary_signature(shape, body)


@parse_cache.cached
def float_split_rotary(num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: str, rope_theta: float,
                       rope_scale: float = 1.0, rope_scaling: dict[str, Any] | None = None) -> tirx.PrimFunc:
    """A float cache's `tir_split_rotary` (TVM's `fused_rope`: qkv, position_map, q, k, v, apply_rope): q, k and v
    split from the fused projection output, RoPE applied to q and k as TVM's llama_rope_with_position_map does
    (rotate-half, rope_angle, computed in float32, when apply_rope > 0). TVM's computes the angle, its cos and its
    sin for every element (pow, cos and sin for each of the 15 x 64 values of a SmolLM2 token: 9 us of a decode
    step per layer on Zen 3) and runs it in parallel even for one token; here each token's head_dim / 2 angles are
    computed once for all its heads, and one token (decode) is not handed to the thread pool."""
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    HALF = D // 2
    angle = rope_angle(D, rope_theta, rope_scale, rope_scaling)

    @T.macro
    def token(qkv, position_map, q, k, v, apply_rope, s):
        cos = T.alloc_buffer((HALF,), "float32")
        sin = T.alloc_buffer((HALF,), "float32")
        freq = T.alloc_buffer((3,), "float32")
        if apply_rope > 0:
            for i in range(HALF):
                angle(freq, i, position_map[s])
                cos[i] = T.cos(freq[0])
                sin[i] = T.sin(freq[0])
        for h in range(H_qo + H_kv):
            for i in range(HALF):
                if apply_rope > 0:  # TVM's expression: cos x[i] + sin (-x[i + half]), cos x[i + half] + sin x[i]
                    if h < H_qo:
                        q[s, h, i] = T.Cast(dtype, cos[i] * T.Cast("float32", qkv[s, h, i])
                                            + sin[i] * -T.Cast("float32", qkv[s, h, i + HALF]))
                        q[s, h, i + HALF] = T.Cast(dtype, cos[i] * T.Cast("float32", qkv[s, h, i + HALF])
                                                   + sin[i] * T.Cast("float32", qkv[s, h, i]))
                    else:
                        k[s, h - H_qo, i] = T.Cast(dtype, cos[i] * T.Cast("float32", qkv[s, h, i])
                                                   + sin[i] * -T.Cast("float32", qkv[s, h, i + HALF]))
                        k[s, h - H_qo, i + HALF] = T.Cast(dtype, cos[i] * T.Cast("float32", qkv[s, h, i + HALF])
                                                          + sin[i] * T.Cast("float32", qkv[s, h, i]))
                elif h < H_qo:
                    q[s, h, i] = qkv[s, h, i]
                    q[s, h, i + HALF] = qkv[s, h, i + HALF]
                else:
                    k[s, h - H_qo, i] = qkv[s, h, i]
                    k[s, h - H_qo, i + HALF] = qkv[s, h, i + HALF]
        for h in range(H_kv):
            for d in range(D):
                v[s, h, d] = qkv[s, H_qo + H_kv + h, d]

    # pylint: disable=too-many-locals
    @T.prim_func(private=True, s_tir=True)
    def fused_rope(var_qkv: T.handle, var_position_map: T.handle, var_q: T.handle, var_k: T.handle,
                   var_v: T.handle, apply_rope: T.int64):
        T.func_attr({"op_pattern": 8, "tirx.noalias": True, "tirx.is_scheduled": True})
        seq_len = T.int32()
        position_map_elem_offset = T.int32()
        qkv = T.match_buffer(var_qkv, (seq_len, H_qo + 2 * H_kv, D), dtype)
        q = T.match_buffer(var_q, (seq_len, H_qo, D), dtype)
        k = T.match_buffer(var_k, (seq_len, H_kv, D), dtype)
        v = T.match_buffer(var_v, (seq_len, H_kv, D), dtype)
        position_map = T.match_buffer(var_position_map, (seq_len,), "int32", elem_offset=position_map_elem_offset)
        with T.sblock("root"):
            if seq_len == 1:
                token(qkv, position_map, q, k, v, apply_rope, 0)
            else:
                for s in T.parallel(seq_len):
                    token(qkv, position_map, q, k, v, apply_rope, s)

    return fused_rope.with_attr("global_symbol", SPLIT_ROTARY_SYMBOL)


def split_rotary_signature(shape: AttentionShape, body) -> tirx.PrimFunc:
    """TVM's `fused_rope` signature (qkv, position_map, q, k, v, apply_rope) on a quantized cache's carrier, around
    `body(qkv_rows, position_map, q_rows, k_codes, v_codes, k, v, apply_rope, seq_len)`: the fused projection
    output as the real (tokens, heads + 2 kv_heads, head_dim) floats, q's real rows, the K/V code views and the
    declared K/V buffers (for the parameters)."""
    H_qo, H_kv, D = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim
    H_qo_decl, H_kv_decl, D_decl = shape.declared

    # pylint: disable=too-many-locals
    @T.prim_func(private=True, s_tir=True)
    def fused_rope(var_qkv: T.handle, var_position_map: T.handle, var_q: T.handle, var_k: T.handle,
                   var_v: T.handle, apply_rope: T.int64):
        T.func_attr({"op_pattern": 8, "tirx.noalias": True, "tirx.is_scheduled": True})
        seq_len = T.int32()
        position_map_elem_offset = T.int32()
        qkv = T.match_buffer(var_qkv, (seq_len, H_qo_decl + 2 * H_kv_decl, D_decl), "float32")
        q = T.match_buffer(var_q, (seq_len, H_qo_decl, D_decl), "float32")
        k = T.match_buffer(var_k, (seq_len, H_kv_decl, D_decl), "float32")
        v = T.match_buffer(var_v, (seq_len, H_kv_decl, D_decl), "float32")
        position_map = T.match_buffer(var_position_map, (seq_len,), "int32", elem_offset=position_map_elem_offset)
        with T.sblock("root"):
            qkv_rows = T.decl_buffer((seq_len, H_qo + 2 * H_kv, D), "float32", data=qkv.data)
            q_rows = shape.rows_view(q, seq_len)
            k_codes = shape.codes_view(k)
            v_codes = shape.codes_view(v)
            body(qkv_rows, position_map, q_rows, k_codes, v_codes, k, v, apply_rope, seq_len)

    return fused_rope.with_attr("global_symbol", SPLIT_ROTARY_SYMBOL)


def _llama3_constants(rope_scaling: dict[str, Any]) -> tuple[float, float, float]:
    """(1 / factor, alpha, beta) of TVM's rope_freq_llama3: the inverse frequency f is smoothed to
    (1 - w) f / factor + w f, w = clamp(alpha f - beta, 0, 1), as transformers' Llama 3 RoPE does."""
    factor, low, high = (float(rope_scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    original = float(rope_scaling["original_max_position_embeddings"])
    return 1.0 / factor, original / (2 * math.pi) / (high - low), low / (high - low)


@parse_cache.cached
def carrier_merge_state(shape: AttentionShape) -> tirx.PrimFunc:
    """A quantized cache's `tir_attention_merge_state_cpu` (carrier_merge_signature): one parallel task per row."""
    H_qo, D = shape.num_qo_heads, shape.head_dim

    @T.macro
    def body(V_rows, S, V_other_rows, S_other, N):
        for n in T.parallel(N):
            # s_max, then the two weights: through buffers (no float Let inside a parallel loop)
            state = T.alloc_buffer((3,), "float32")
            for h in range(H_qo):
                state[0] = T.max(S[n, h], S_other[n, h])
                state[1] = T.exp2(S[n, h] - state[0])
                state[2] = T.exp2(S_other[n, h] - state[0])
                for d in range(D):
                    V_rows[n, h, d] = (V_rows[n, h, d] * state[1] + V_other_rows[n, h, d] * state[2]) / (
                        state[1] + state[2])
                S[n, h] = T.log2(state[1] + state[2]) + state[0]

    return carrier_merge_signature(shape, body).with_attr("global_symbol", MERGE_SYMBOL)


def carrier_merge_signature(shape: AttentionShape, body) -> tirx.PrimFunc:
    """TVM's merge of attention states (v, s, v_other, s_other, merging into v and s) on a quantized cache's
    carrier, around `body(V_rows, S, V_other_rows, S_other, N)`: the states of the real query heads, whose output
    rows lie at the start of the declared rows (AttentionShape views) and whose lse the kernels write at [n, hq],
    hq < heads. TVM's merges every declared head as a (declared heads, cell) row, which pairs lse with the wrong
    floats."""
    assert shape.carrier is not None, shape
    H_qo_decl, _, D_decl = shape.declared

    @T.prim_func(private=True, s_tir=True)
    def merge_state_inplace(v: T.handle, s: T.handle, v_other: T.handle, s_other: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        N = T.int32()
        V = T.match_buffer(v, (N, H_qo_decl, D_decl), "float32")
        S = T.match_buffer(s, (N, H_qo_decl), "float32")
        V_other = T.match_buffer(v_other, (N, H_qo_decl, D_decl), "float32")
        S_other = T.match_buffer(s_other, (N, H_qo_decl), "float32")
        with T.sblock("root"):
            V_rows = shape.rows_view(V, N)
            V_other_rows = shape.rows_view(V_other, N)
            body(V_rows, S, V_other_rows, S_other, N)

    return merge_state_inplace
