"""Paged-KV attention kernels for GPUs with what TVM 0.27's GPU kernels lack: a window on every layer (Mistral,
Phi-3), the "mha_sliding" layers' window (Gemma 2/3) and capped scores (Gemma 2).

They have the signatures of TVM's GPU kernels (`batch_decode_paged_kv`, `batch_prefill_ragged_kv`,
`batch_prefill_paged_kv` and the `_sliding_window` variants; the paged KV cache calls them by position) and compute
what the CPU kernels of kernels/cpu_attention.py compute, masks included, in the same log2 units (lse = m +
log2(d), the runtime's merge of attention states unchanged).

One work-group of THREADS work-items per (query row, query head): q is scaled into local memory; the visible keys
[lo, hi) are walked in blocks of THREADS, each work-item scoring one key (a dot product over head_dim), the block's
scores shared; then every work-item rescales the online softmax by the block's maximum and accumulates the V rows
for its own channels (tx, tx + THREADS, ...), reading V rows coalesced. Simple rather than fast: each query head
reads its KV head's keys itself (no sharing across a GQA group, no K tiles in local memory), so these kernels are
used only for the models that need them (passes/replace_gpu_attention.py); every other model keeps TVM's.

The "mha_sliding" layers' kernels (`sliding`) take the pages and length_info [3, b] TVM's runtime passes them
((rows used in the last page, the window's first row in the first page, attention-sink rows); key i the sink row i
for i < sinks, else row i - sinks + offset, as TVM's kernels map them), and apply the layer's window by position
(`window`), as for every layer's window: on OpenCL TVM 0.27's runtime copies the sliding layers' page tables into
the buffers of the other layers' (PlainPagedKVCacheAuxDataManager: one device array per depth, written by both
copies; CPU and CUDA get separate ones), so the global layers of a model with a binding window saw the window's
pages only (a tiny Gemma 3 on PoCL drifted from transformers by 12-14% once the first page left the window). Gemma
on a GPU therefore declares its sliding layers' window as the whole context (GemmaConfig.sliding_pages_all): both
tables are then every page, and these kernels mask. rotary_mode 1 (RoPE inside attention) fails an assert on the
host: the models store K after RoPE (cpu_attention.ROTARY_REFUSAL).
"""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from .cpu_attention import (
    DECODE_SYMBOL,
    LOG2E,
    MASKED,
    NO_SCORE,
    PAGED_PREFILL_SYMBOL,
    RAGGED_SYMBOL,
    ROTARY_REFUSAL,
    SLIDING_SUFFIX,
    AttentionShape,
)

# TVM's global symbols of the GPU kernels (the ragged kernel has one symbol on both)
GPU_DECODE_SYMBOL = DECODE_SYMBOL.removesuffix("_cpu")
GPU_PAGED_PREFILL_SYMBOL = PAGED_PREFILL_SYMBOL.removesuffix("_cpu")
GPU_RAGGED_SYMBOL = RAGGED_SYMBOL
GPU_MERGE_SYMBOL = "tir_attention_merge_state"
THREADS = 64  # work-items per work-group: within every GPU's limit, two Adreno waves or one warp pair


def _length_info_shape(batch, sliding: bool):
    return (3, batch) if sliding else (batch,)


def _attend(shape: AttentionShape, logit_cap: float):
    """A T.macro: one work-group's attention of one query row and head over the keys [lo, hi) (indices into the
    sequence's keys). `query(c)`: channel c of q; `key(i, c)`, `value(i, c)`: of key i; `store(c, x)`: output
    channel c; `store_lse(x)`."""
    D, fdtype = shape.head_dim, shape.dtype
    per_item = -(-D // THREADS)  # output channels per work-item
    cap = logit_cap

    def f32(x):
        return x if fdtype == "float32" else T.Cast("float32", x)

    @T.macro
    def attend(tx, lo, hi, query, key, value, store, store_lse, sm_scale):
        q_s = T.sblock_alloc_buffer((per_item * THREADS,), "float32", scope="shared")
        s_s = T.sblock_alloc_buffer((THREADS,), "float32", scope="shared")
        acc = T.sblock_alloc_buffer((per_item,), "float32", scope="local")
        # running max, running sum, the block's max, sum of its weights, score / dot product scratch
        st = T.sblock_alloc_buffer((5,), "float32", scope="local")
        for c in T.unroll(per_item):
            if c * THREADS + tx < D:
                q_s[c * THREADS + tx] = f32(query(c * THREADS + tx)) * sm_scale * T.float32(LOG2E)
            acc[c] = T.float32(0)
        st[0] = T.float32(NO_SCORE)
        st[1] = T.float32(0)
        T.tvm_storage_sync("shared")
        for blk in T.serial(T.ceildiv(T.max(hi - lo, 0), THREADS)):
            st[4] = T.float32(MASKED)
            if lo + blk * THREADS + tx < hi:
                st[4] = T.float32(0)
                for c in T.serial(D):
                    st[4] = st[4] + q_s[c] * f32(key(lo + blk * THREADS + tx, c))
                if cap > 0:  # Gemma 2: cap * tanh(s / cap) in natural units, the score in log2 units
                    st[4] = T.float32(cap * LOG2E) * T.tanh(st[4] / T.float32(cap * LOG2E))
            s_s[tx] = st[4]
            T.tvm_storage_sync("shared")
            st[2] = st[0]
            for j in T.serial(THREADS):
                st[2] = T.max(st[2], s_s[j])
            st[3] = T.float32(0)
            for c in T.unroll(per_item):
                acc[c] = acc[c] * T.exp2(st[0] - st[2])
            for j in T.serial(T.min(hi - lo - blk * THREADS, THREADS)):
                st[4] = T.exp2(s_s[j] - st[2])
                st[3] = st[3] + st[4]
                for c in T.unroll(per_item):
                    if c * THREADS + tx < D:
                        acc[c] = acc[c] + st[4] * f32(value(lo + blk * THREADS + j, c * THREADS + tx))
            st[1] = st[1] * T.exp2(st[0] - st[2]) + st[3]
            st[0] = st[2]
            T.tvm_storage_sync("shared")  # every work-item has read s_s before the next block writes it
        for c in T.unroll(per_item):
            if c * THREADS + tx < D:
                store(c * THREADS + tx, T.if_then_else(st[1] > T.float32(0), acc[c] / st[1], T.float32(0)))
        if tx == 0:
            store_lse(T.if_then_else(st[1] > T.float32(0), st[0] + T.log2(st[1]), T.float32(NO_SCORE)))

    return attend


def _paged_key(pages, page_values, length_info, b, begin, h, kv, sliding: bool, page_size: int):
    """(i, c) -> channel c of the K (kv 0) or V (kv 1) of key i of sequence b, whose pages start at `begin` in the
    page table (sliding: key i is sink row i, or row i - sinks + the window's offset)."""
    def load(i, c):
        row = T.if_then_else(i < length_info[2, b], i, i - length_info[2, b] + length_info[1, b]) if sliding else i
        return pages[page_values[begin + T.floordiv(row, page_size)], kv, h, T.floormod(row, page_size), c]
    return load


def _paged_keys(length_info, b, begin, end, sliding: bool, page_size: int):
    """Keys of sequence b whose pages are [begin, end) of the page table (sliding: the window's and sinks')."""
    last = length_info[0, b] if sliding else length_info[b]
    extra = length_info[2, b] - length_info[1, b] if sliding else 0
    return T.if_then_else(end > begin, (end - begin - 1) * page_size + last + extra, 0)


@functools.cache
def gpu_attention_decode(shape: AttentionShape, *, sliding: bool = False, window: int = 0,
                         logit_cap: float = 0.0) -> tirx.PrimFunc:
    """TVM's GPU `batch_decode_paged_kv` (or, `sliding`, its `_sliding_window` variant for the "mha_sliding"
    layers) with a `window` (the query sees the last `window` keys) and `logit_cap` (Gemma 2's)."""
    H_qo, H_kv, D, P, fdtype = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.page_size, shape.dtype
    G = H_qo // H_kv
    attend = _attend(shape, logit_cap)

    @T.prim_func(private=True, s_tir=True)
    def batch_decode_paged_kv(
        Q_handle: T.handle,
        pages_handle: T.handle,
        page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle,
        var_length_info: T.handle,  # [b], or (sliding) [3, b]
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
        pages_elem_offset = T.int64()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()

        Q = T.match_buffer(Q_handle, (B, H_qo, D), fdtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, H_kv, P, D), fdtype, elem_offset=pages_elem_offset)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32",
                                           elem_offset=page_indptr_elem_offset)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32",
                                           elem_offset=page_values_elem_offset)
        # matched as TVM's kernel does (the runtime checks the arguments), unused: K is stored after RoPE
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (B, H_qo, D), fdtype)
        lse = T.match_buffer(lse_handle, (B, H_qo), "float32")
        length_info = T.match_buffer(var_length_info, _length_info_shape(B, sliding), "int32",
                                     elem_offset=length_info_elem_offset)

        assert rotary_mode == 0, ROTARY_REFUSAL
        for b in T.thread_binding(B, thread="blockIdx.x"):
            for hq in T.thread_binding(H_qo, thread="blockIdx.y"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("attn"):
                        T.reads()
                        T.writes()
                        begin: T.let[T.int32] = page_table_indptr[b]
                        n_keys: T.let[T.int32] = _paged_keys(length_info, b, begin, page_table_indptr[b + 1],
                                                             sliding, P)
                        attend(tx, _first_key(True, n_keys, 1, 0, window), n_keys,  # the query is the last key
                               lambda c: Q[b, hq, c],
                               _paged_key(pages, page_table_values, length_info, b, begin, hq // G, 0, sliding, P),
                               _paged_key(pages, page_table_values, length_info, b, begin, hq // G, 1, sliding, P),
                               lambda c, x: T.buffer_store(output, T.Cast(fdtype, x), [b, hq, c]),
                               lambda x: T.buffer_store(lse, x, [b, hq]), sm_scale)

    return batch_decode_paged_kv.with_attr("global_symbol", GPU_DECODE_SYMBOL + (SLIDING_SUFFIX if sliding else ""))


@T.macro
def _find_sequence(q_indptr, batch_size, t, seq):
    """seq[0] = the sequence of query row t (the number of sequences that end at or before it)."""
    seq[0] = 0
    for s in T.serial(batch_size):
        if q_indptr[s + 1] <= t:
            seq[0] = seq[0] + 1


def _keys_end_with_rows(causal, sliding: bool):
    """Whether a paged prefill's keys end with its new rows (the runtime appended them first) rather than all come
    before them. TVM's runtime says so with `causal`, but inverted for the "mha_sliding" layers: their cross
    attention over the cached keys gets causal 1 (for TVM's sliding mask), and 0 when it appended first."""
    return causal < 1 if sliding else causal > 0


def _first_key(end_aligned, n_keys, qo_len, row, window: int):
    """The first key query `row` (of qo_len new rows) sees: with a window, the keys at positions > the row's -
    window, the row's position being n_keys - qo_len + row (`end_aligned`: the keys end with the new rows) or
    n_keys + row (all before them); else 0."""
    if window:
        return T.max(T.if_then_else(end_aligned, n_keys - qo_len, n_keys) + row + 1 - window, 0)
    return 0


def _last_key(end_aligned, n_keys, qo_len, row):
    """One past the last key query `row` sees: with the keys ending with the new rows, those up to its own."""
    return T.if_then_else(end_aligned, T.max(T.min(n_keys - qo_len + row + 1, n_keys), 0), n_keys)


@functools.cache
def gpu_attention_prefill_ragged(shape: AttentionShape, *, window: int = 0,
                                 logit_cap: float = 0.0) -> tirx.PrimFunc:
    """TVM's GPU `batch_prefill_ragged_kv` (the new tokens among themselves; head_dim the same for q/k and v) with
    every layer's `window` and `logit_cap`. shape.page_size is not used."""
    H_qo, H_kv, D, fdtype = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.dtype
    G = H_qo // H_kv
    attend = _attend(shape, logit_cap)

    @T.prim_func(private=True, s_tir=True)
    def batch_prefill_ragged_kv(
        var_q: T.handle,  # [total_len, h_q, d_qk]
        var_q_indptr: T.handle,  # [batch_size + 1]
        var_k: T.handle,  # [total_len, h_kv, d_qk]
        var_v: T.handle,  # [total_len, h_kv, d_v]
        var_kv_indptr: T.handle,  # [batch_size + 1]
        var_q_rope_position: T.handle,  # [total_q_len]
        var_k_rope_pos_offset: T.handle,  # [b]
        var_output: T.handle,  # [total_len, h_q, d_v]
        var_lse: T.handle,  # [total_len, h_q]
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()

        q = T.match_buffer(var_q, (qo_len, H_qo, D), fdtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (kv_len, H_kv, D), fdtype)
        v = T.match_buffer(var_v, (kv_len, H_kv, D), fdtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset)
        # matched as TVM's kernel does (the runtime checks the arguments), unused: K is stored after RoPE
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        output = T.match_buffer(var_output, (qo_len, H_qo, D), fdtype)
        lse = T.match_buffer(var_lse, (qo_len, H_qo), "float32")

        assert rotary_mode == 0, ROTARY_REFUSAL
        for t in T.thread_binding(qo_len, thread="blockIdx.x"):
            for hq in T.thread_binding(H_qo, thread="blockIdx.y"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("attn"):
                        T.reads()
                        T.writes()
                        seq = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        _find_sequence(q_indptr, batch_size, t, seq)
                        b: T.let[T.int32] = seq[0]
                        begin: T.let[T.int32] = kv_indptr[b]
                        n_keys: T.let[T.int32] = kv_indptr[b + 1] - begin
                        rows: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                        attend(tx, _first_key(causal > 0, n_keys, rows, t - q_indptr[b], window),
                               _last_key(causal > 0, n_keys, rows, t - q_indptr[b]),
                               lambda c: q[t, hq, c],
                               lambda i, c: k[begin + i, hq // G, c],
                               lambda i, c: v[begin + i, hq // G, c],
                               lambda c, x: T.buffer_store(output, T.Cast(fdtype, x), [t, hq, c]),
                               lambda x: T.buffer_store(lse, x, [t, hq]), sm_scale)

    return batch_prefill_ragged_kv.with_attr("global_symbol", GPU_RAGGED_SYMBOL)


@functools.cache
def gpu_attention_prefill_paged(shape: AttentionShape, *, sliding: bool = False, window: int = 0,
                                logit_cap: float = 0.0) -> tirx.PrimFunc:
    """TVM's GPU `batch_prefill_paged_kv` (new tokens against the cached pages) or (`sliding`) its `_sliding_window`
    variant for the "mha_sliding" layers, with a `window` (_first_key) and `logit_cap` (Gemma 2's)."""
    H_qo, H_kv, D, P, fdtype = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.page_size, shape.dtype
    G = H_qo // H_kv
    attend = _attend(shape, logit_cap)

    @T.prim_func(private=True, s_tir=True)
    def batch_prefill_paged_kv(
        var_q: T.handle,  # [total_len, h_q, d]
        var_q_indptr: T.handle,  # [batch_size + 1]
        var_pages: T.handle,  # [max_num_pages, 2, h_kv, page_size, d]
        var_page_indptr: T.handle,  # [batch_size + 1]
        var_page_values: T.handle,  # [nnz_pages]
        var_length_info: T.handle,  # [b], or (sliding) [3, b]
        var_k_rope_pos_offset: T.handle,  # [b]
        var_q_rope_position: T.handle,  # [total_len]
        var_output: T.handle,  # [total_len, h_q, d]
        var_lse: T.handle,  # [total_len, h_q]
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        pages_elem_offset = T.int64()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()

        q = T.match_buffer(var_q, (total_len, H_qo, D), fdtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, H_kv, P, D), fdtype, elem_offset=pages_elem_offset)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        # matched as TVM's kernel does (the runtime checks the arguments), unused: K is stored after RoPE
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(var_output, (total_len, H_qo, D), fdtype)
        lse = T.match_buffer(var_lse, (total_len, H_qo), "float32")
        length_info = T.match_buffer(var_length_info, _length_info_shape(batch_size, sliding), "int32",
                                     elem_offset=length_info_elem_offset)

        assert rotary_mode == 0, ROTARY_REFUSAL
        for t in T.thread_binding(total_len, thread="blockIdx.x"):
            for hq in T.thread_binding(H_qo, thread="blockIdx.y"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("attn"):
                        T.reads()
                        T.writes()
                        seq = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        _find_sequence(q_indptr, batch_size, t, seq)
                        b: T.let[T.int32] = seq[0]
                        begin: T.let[T.int32] = page_indptr[b]
                        n_keys: T.let[T.int32] = _paged_keys(length_info, b, begin, page_indptr[b + 1], sliding, P)
                        rows: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                        end_aligned: T.let[T.bool] = _keys_end_with_rows(causal, sliding)
                        attend(tx, _first_key(end_aligned, n_keys, rows, t - q_indptr[b], window),
                               _last_key(end_aligned, n_keys, rows, t - q_indptr[b]),
                               lambda c: q[t, hq, c],
                               _paged_key(pages, page_values, length_info, b, begin, hq // G, 0, sliding, P),
                               _paged_key(pages, page_values, length_info, b, begin, hq // G, 1, sliding, P),
                               lambda c, x: T.buffer_store(output, T.Cast(fdtype, x), [t, hq, c]),
                               lambda x: T.buffer_store(lse, x, [t, hq]), sm_scale)

    return batch_prefill_paged_kv.with_attr("global_symbol",
                                            GPU_PAGED_PREFILL_SYMBOL + (SLIDING_SUFFIX if sliding else ""))


@functools.cache
def gpu_merge_state(dtype: str) -> tirx.PrimFunc:
    """TVM's GPU `merge_state_inplace` (V, S <- the merge of attention states (V, S) and (V_other, S_other), S in log2
    units), without its race: there every work-item of a head reads S and then writes the merged S back, so one
    that reads after another's write merges twice. That is harmless only where a head's work-items run in lockstep
    (a GPU wave), and it broke every chunked prefill on PoCL (a tiny Llama's logits off by 1.2 relative from the
    second chunk on). Here S is read by all, then (after a barrier) written by one."""

    @T.prim_func(private=True, s_tir=True)
    def merge_state_inplace(v: T.handle, s: T.handle, v_other: T.handle, s_other: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        N = T.int32()
        H = T.int32()
        D = T.int32()
        V = T.match_buffer(v, (N, H, D), dtype)
        S = T.match_buffer(s, (N, H), "float32")
        V_other = T.match_buffer(v_other, (N, H, D), dtype)
        S_other = T.match_buffer(s_other, (N, H), "float32")
        for n in T.thread_binding(N, thread="blockIdx.x"):
            for h in T.thread_binding(H, thread="blockIdx.y"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("merge"):
                        T.reads()
                        T.writes()
                        st = T.sblock_alloc_buffer((3,), "float32", scope="local")  # max, then the two weights
                        st[0] = T.max(S[n, h], S_other[n, h])
                        st[1] = T.exp2(S[n, h] - st[0])
                        st[2] = T.exp2(S_other[n, h] - st[0])
                        T.tvm_storage_sync("shared")  # every work-item has read S
                        for c in T.serial(T.ceildiv(D, THREADS)):
                            if c * THREADS + tx < D:
                                V[n, h, c * THREADS + tx] = T.Cast(dtype, (
                                    T.Cast("float32", V[n, h, c * THREADS + tx]) * st[1]
                                    + T.Cast("float32", V_other[n, h, c * THREADS + tx]) * st[2]) / (st[1] + st[2]))
                        if tx == 0:
                            S[n, h] = T.log2(st[1] + st[2]) + st[0]

    return merge_state_inplace.with_attr("global_symbol", GPU_MERGE_SYMBOL)
