"""Paged-KV attention kernels for GPUs with what TVM 0.27's GPU kernels lack: a window on every layer (Mistral,
Phi-3), the "mha_sliding" layers' window (Gemma 2/3), capped scores (Gemma 2) and quantized caches (int8, int4 on
kv_cache_dtype.Carrier, with their split + RoPE + quantize kernel); and the merge of attention states without the
race of TVM's (gpu_merge_state).

They have the signatures of TVM's GPU kernels (`batch_decode_paged_kv`, `batch_prefill_ragged_kv`,
`batch_prefill_paged_kv` and the `_sliding_window` variants; the paged KV cache calls them by position) and compute
what the CPU kernels of kernels/cpu_attention.py compute, masks included, in the same log2 units (lse = m +
log2(d), the runtime's merge of attention states unchanged).

One work-group of THREADS work-items per (query row, KV head), for the GQA group of query heads that share it (each K
and V element read once for the group): q is scaled into local memory; the visible keys [lo, hi) are walked in
blocks of THREADS, each work-item scoring one key for every head of the group (dot products over head_dim), the
block's scores shared; then every work-item rescales the online softmax by the block's maximum and accumulates the
V rows for its own channels (tx, tx + THREADS, ...), reading V rows coalesced. Simple rather than fast (no K tiles
in local memory, K rows read by one work-item each), so these kernels are used only for the models and caches that
need them (passes/replace_gpu_attention.py); every other model keeps TVM's.

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

from tvm import tirx
from tvm.script import tirx as T

from . import paged_kv_signatures as signatures
from . import parse_cache
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
    carrier_merge_signature,
    param_padding_zeroer,
    rope_angle,
    row_quantizer,
    split_rotary_signature,
)

# TVM's global symbols of the GPU kernels (the ragged kernel has one symbol on both)
GPU_DECODE_SYMBOL = DECODE_SYMBOL.removesuffix("_cpu")
GPU_PAGED_PREFILL_SYMBOL = PAGED_PREFILL_SYMBOL.removesuffix("_cpu")
GPU_RAGGED_SYMBOL = RAGGED_SYMBOL
GPU_MERGE_SYMBOL = "tir_attention_merge_state"
THREADS = 64  # work-items per work-group: within every GPU's limit, two Adreno waves or one warp pair


def _attend(shape: AttentionShape, logit_cap: float):
    """A T.macro: one work-group's attention of one query row's `group` query heads, which share a KV head, over the
    keys [lo, hi) (indices into the sequence's keys): each K and V element is read once for the group.
    `query(g, c)`: channel c of the group's query head g; `key(i, c)`, `value(i, c)`: of key i; `store(g, c, x)`:
    output channel c of head g; `store_lse(g, x)`."""
    D, G, fdtype = shape.head_dim, shape.group, shape.float_dtype
    per_item = -(-D // THREADS)  # output channels per work-item
    cap = logit_cap

    def f32(x):
        return x if fdtype == "float32" else T.Cast("float32", x)

    @T.macro
    def attend(tx, lo, hi, query, key, value, store, store_lse, sm_scale):
        q_s = T.sblock_alloc_buffer((G, per_item * THREADS), "float32", scope="shared")
        s_s = T.sblock_alloc_buffer((G, THREADS), "float32", scope="shared")
        acc = T.sblock_alloc_buffer((G, per_item), "float32", scope="local")
        # per head: running max, running sum, the block's max, sum of its weights, score scratch
        st = T.sblock_alloc_buffer((G, 5), "float32", scope="local")
        kv = T.sblock_alloc_buffer((1,), "float32", scope="local")  # a K or V element, read once for the group
        for g in T.unroll(G):
            for c in T.unroll(per_item):
                if c * THREADS + tx < D:
                    q_s[g, c * THREADS + tx] = f32(query(g, c * THREADS + tx)) * sm_scale * T.float32(LOG2E)
                acc[g, c] = T.float32(0)
            st[g, 0] = T.float32(NO_SCORE)
            st[g, 1] = T.float32(0)
        T.tvm_storage_sync("shared")
        for blk in T.serial(T.ceildiv(T.max(hi - lo, 0), THREADS)):
            for g in T.unroll(G):
                st[g, 4] = T.float32(MASKED)
            if lo + blk * THREADS + tx < hi:
                for g in T.unroll(G):
                    st[g, 4] = T.float32(0)
                for c in T.serial(D):
                    kv[0] = f32(key(lo + blk * THREADS + tx, c))
                    for g in T.unroll(G):
                        st[g, 4] = st[g, 4] + q_s[g, c] * kv[0]
                if cap > 0:  # Gemma 2: cap * tanh(s / cap) in natural units, the score in log2 units
                    for g in T.unroll(G):
                        st[g, 4] = T.float32(cap * LOG2E) * T.tanh(st[g, 4] / T.float32(cap * LOG2E))
            for g in T.unroll(G):
                s_s[g, tx] = st[g, 4]
            T.tvm_storage_sync("shared")
            for g in T.unroll(G):
                st[g, 2] = st[g, 0]
                for j in T.serial(THREADS):
                    st[g, 2] = T.max(st[g, 2], s_s[g, j])
                st[g, 3] = T.float32(0)
                for c in T.unroll(per_item):
                    acc[g, c] = acc[g, c] * T.exp2(st[g, 0] - st[g, 2])
            for j in T.serial(T.min(hi - lo - blk * THREADS, THREADS)):
                for g in T.unroll(G):  # key j's weight for each head
                    st[g, 4] = T.exp2(s_s[g, j] - st[g, 2])
                    st[g, 3] = st[g, 3] + st[g, 4]
                for c in T.unroll(per_item):
                    if c * THREADS + tx < D:
                        kv[0] = f32(value(lo + blk * THREADS + j, c * THREADS + tx))
                        for g in T.unroll(G):
                            acc[g, c] = acc[g, c] + st[g, 4] * kv[0]
            for g in T.unroll(G):
                st[g, 1] = st[g, 1] * T.exp2(st[g, 0] - st[g, 2]) + st[g, 3]
                st[g, 0] = st[g, 2]
            T.tvm_storage_sync("shared")  # every work-item has read s_s before the next block writes it
        for g in T.unroll(G):
            for c in T.unroll(per_item):
                if c * THREADS + tx < D:
                    store(g, c * THREADS + tx,
                          T.if_then_else(st[g, 1] > T.float32(0), acc[g, c] / st[g, 1], T.float32(0)))
            if tx == 0:
                store_lse(g, T.if_then_else(st[g, 1] > T.float32(0), st[g, 0] + T.log2(st[g, 1]),
                                            T.float32(NO_SCORE)))

    return attend


def _value(shape: AttentionShape, load, param, c, kv: int):
    """Channel c of a K (kv 0) or V (kv 1) row as the cache stores it (float32 for a quantized cache): `load(index)`
    reads the row's code view (AttentionShape), `param(group, i)` its parameters. int8: the code times the row's
    scale; int4: the nibble (code 2j low, 2j + 1 high in byte j) times its group's scale, plus its min."""
    if shape.carrier is None:
        return load(c)
    if shape.dtype == "int8":
        return T.Cast("float32", load(c)) * param(0, 0)
    nibble = T.bitwise_and(T.shift_right(load(T.floordiv(c, 2)), T.Cast("uint8", T.floormod(c, 2) * 4)), T.uint8(15))
    group = T.floordiv(c, shape.carrier.group(kv))
    return T.Cast("float32", nibble) * param(group, 0) + param(group, 1)


def _paged_key(shape: AttentionShape, codes, pages, page_values, length_info, b, begin, h, kv, sliding: bool):
    """(i, c) -> channel c of the K (kv 0) or V (kv 1) of key i of sequence b, whose pages start at `begin` in the
    page table (sliding: key i is sink row i, or row i - sinks + the window's offset); `codes`: the pages' code
    view, `pages` as declared (a quantized cache's parameters)."""
    P = shape.page_size

    def load(i, c):
        row = T.if_then_else(i < length_info[2, b], i, i - length_info[2, b] + length_info[1, b]) if sliding else i
        page, r = page_values[begin + T.floordiv(row, P)], T.floormod(row, P)
        return _value(shape, lambda index: codes[page, kv, h, r, index],
                      lambda group, j: shape.param(lambda prow, cell: pages[page, kv, prow, r, cell], h, group, j,
                                                   kv), c, kv)
    return load


def _ragged_key(shape: AttentionShape, codes, rows, begin, h, kv: int):
    """(i, c) -> channel c of K (kv 0) or V (kv 1) of key i of a sequence whose rows start at `begin`; `codes`: its
    code view, `rows` its buffer as declared (a quantized cache's parameters)."""
    return lambda i, c: _value(shape, lambda index: codes[begin + i, h, index],
                               lambda group, j: shape.param(lambda prow, cell: rows[begin + i, prow, cell], h, group,
                                                            j, kv), c, kv)


def _paged_keys(length_info, b, begin, end, sliding: bool, page_size: int):
    """Keys of sequence b whose pages are [begin, end) of the page table (sliding: the window's and sinks')."""
    last = length_info[0, b] if sliding else length_info[b]
    extra = length_info[2, b] - length_info[1, b] if sliding else 0
    return T.if_then_else(end > begin, (end - begin - 1) * page_size + last + extra, 0)


@parse_cache.cached
def gpu_attention_decode(shape: AttentionShape, *, sliding: bool = False, window: int = 0,
                         logit_cap: float = 0.0) -> tirx.PrimFunc:
    """TVM's GPU `batch_decode_paged_kv` (or, `sliding`, its `_sliding_window` variant for the "mha_sliding"
    layers) with a `window` (the query sees the last `window` keys) and `logit_cap` (Gemma 2's)."""
    H_kv, G, P, fdtype = shape.num_kv_heads, shape.group, shape.page_size, shape.float_dtype
    attend = _attend(shape, logit_cap)

    @T.macro
    def body(Q, pages, page_table_indptr, page_table_values, length_info, output, lse, rotary_mode, sm_scale, B,
             max_num_pages):
        assert rotary_mode == 0, ROTARY_REFUSAL
        q_rows = shape.rows_view(Q, B)
        out_rows = shape.rows_view(output, B)
        codes = shape.codes_view(pages)
        for b in T.thread_binding(B, thread="blockIdx.x"):
            for h in T.thread_binding(H_kv, thread="blockIdx.y"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("attn"):
                        T.reads()
                        T.writes()
                        begin: T.let[T.int32] = page_table_indptr[b]
                        n_keys: T.let[T.int32] = _paged_keys(length_info, b, begin, page_table_indptr[b + 1],
                                                             sliding, P)
                        attend(tx, _first_key(True, n_keys, 1, 0, window), n_keys,  # the query is the last key
                               lambda g, c: q_rows[b, h * G + g, c],
                               _paged_key(shape, codes, pages, page_table_values, length_info, b, begin, h, 0,
                                          sliding),
                               _paged_key(shape, codes, pages, page_table_values, length_info, b, begin, h, 1,
                                          sliding),
                               lambda g, c, x: T.buffer_store(out_rows, T.Cast(fdtype, x), [b, h * G + g, c]),
                               lambda g, x: T.buffer_store(lse, x, [b, h * G + g]), sm_scale)

    heads, kv_heads, head_dim = shape.declared
    func = signatures.decode(body, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=P, dtype=fdtype,
                             sliding=sliding)
    return func.with_attr("global_symbol", GPU_DECODE_SYMBOL + (SLIDING_SUFFIX if sliding else ""))


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


def _prefill_rows(shape: AttentionShape, logit_cap: float, window: int):
    """A T.macro: a prefill kernel's work, one work-group per query row t < total and KV head (_attend: its query
    heads together), the row's sequence found in q_indptr. Per sequence b, `first(b)`: where its keys start in
    their buffer (ragged rows or page-table entries), `n_keys(b, first)`, `key(b, first, h, kv)` -> (i, c) ->
    channel c of key i's K (kv 0) or V (kv 1) of KV head h; `end_aligned`: whether the keys end with the new rows
    (_keys_end_with_rows)."""
    H_kv, G, fdtype = shape.num_kv_heads, shape.group, shape.float_dtype
    attend = _attend(shape, logit_cap)

    @T.macro
    def rows(total, q, q_indptr, output, lse, batch_size, sm_scale, first, n_keys, key, end_aligned):
        for t in T.thread_binding(total, thread="blockIdx.x"):
            for h in T.thread_binding(H_kv, thread="blockIdx.y"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("attn"):
                        T.reads()
                        T.writes()
                        seq = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        _find_sequence(q_indptr, batch_size, t, seq)
                        b: T.let[T.int32] = seq[0]
                        begin: T.let[T.int32] = first(b)
                        keys: T.let[T.int32] = n_keys(b, begin)
                        new_rows: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                        attend(tx, _first_key(end_aligned, keys, new_rows, t - q_indptr[b], window),
                               _last_key(end_aligned, keys, new_rows, t - q_indptr[b]),
                               lambda g, c: q[t, h * G + g, c], key(b, begin, h, 0), key(b, begin, h, 1),
                               lambda g, c, x: T.buffer_store(output, T.Cast(fdtype, x), [t, h * G + g, c]),
                               lambda g, x: T.buffer_store(lse, x, [t, h * G + g]), sm_scale)

    return rows


@parse_cache.cached
def gpu_attention_prefill_ragged(shape: AttentionShape, *, window: int = 0,
                                 logit_cap: float = 0.0) -> tirx.PrimFunc:
    """TVM's GPU `batch_prefill_ragged_kv` (the new tokens among themselves; head_dim the same for q/k and v) with
    every layer's `window` and `logit_cap`. shape.page_size is not used."""
    rows = _prefill_rows(shape, logit_cap, window)

    @T.macro
    def body(q, q_indptr, k, v, kv_indptr, output, lse, causal, rotary_mode, sm_scale, batch_size, qo_len, kv_len):
        assert rotary_mode == 0, ROTARY_REFUSAL
        q_rows = shape.rows_view(q, qo_len)
        out_rows = shape.rows_view(output, qo_len)
        k_codes = shape.codes_view(k)
        v_codes = shape.codes_view(v)
        rows(qo_len, q_rows, q_indptr, out_rows, lse, batch_size, sm_scale, lambda b: kv_indptr[b],
             lambda b, begin: kv_indptr[b + 1] - begin,
             lambda b, begin, h, kv: _ragged_key(shape, k_codes, k, begin, h, 0) if kv == 0 else _ragged_key(
                 shape, v_codes, v, begin, h, 1), causal > 0)

    heads, kv_heads, head_dim = shape.declared
    func = signatures.ragged_prefill(body, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                     dtype=shape.float_dtype)
    return func.with_attr("global_symbol", GPU_RAGGED_SYMBOL)


@parse_cache.cached
def gpu_attention_prefill_paged(shape: AttentionShape, *, sliding: bool = False, window: int = 0,
                                logit_cap: float = 0.0) -> tirx.PrimFunc:
    """TVM's GPU `batch_prefill_paged_kv` (new tokens against the cached pages) or (`sliding`) its `_sliding_window`
    variant for the "mha_sliding" layers, with a `window` (_first_key) and `logit_cap` (Gemma 2's)."""
    P = shape.page_size
    rows = _prefill_rows(shape, logit_cap, window)

    @T.macro
    def body(q, q_indptr, pages, page_indptr, page_values, length_info, output, lse, causal, rotary_mode, sm_scale,
             batch_size, total_len, max_num_pages):
        assert rotary_mode == 0, ROTARY_REFUSAL
        q_rows = shape.rows_view(q, total_len)
        out_rows = shape.rows_view(output, total_len)
        codes = shape.codes_view(pages)
        rows(total_len, q_rows, q_indptr, out_rows, lse, batch_size, sm_scale, lambda b: page_indptr[b],
             lambda b, begin: _paged_keys(length_info, b, begin, page_indptr[b + 1], sliding, P),
             lambda b, begin, h, kv: _paged_key(shape, codes, pages, page_values, length_info, b, begin, h, kv,
                                                sliding),
             _keys_end_with_rows(causal, sliding))

    heads, kv_heads, head_dim = shape.declared
    func = signatures.paged_prefill(body, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=P,
                                    dtype=shape.float_dtype, sliding=sliding)
    return func.with_attr("global_symbol", GPU_PAGED_PREFILL_SYMBOL + (SLIDING_SUFFIX if sliding else ""))


@T.macro
def _merge(V, S, V_other, S_other, N, H, D):
    """V, S <- the merge of the attention states (V, S) and (V_other, S_other) of N rows of H heads of D channels, one
    work-group per row and head: work-item 0 reads S and S_other, shares the weights in local memory and (after
    the barrier) writes S, so no other work-item touches S (a barrier with a local fence orders no global one)."""
    for n in T.thread_binding(N, thread="blockIdx.x"):
        for h in T.thread_binding(H, thread="blockIdx.y"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("merge"):
                    T.reads()
                    T.writes()
                    w = T.sblock_alloc_buffer((3,), "float32", scope="shared")  # max, then the two weights
                    st = T.sblock_alloc_buffer((3,), "float32", scope="local")  # w computed, then each one's copy
                    if tx == 0:
                        st[0] = T.max(S[n, h], S_other[n, h])
                        st[1] = T.exp2(S[n, h] - st[0])
                        st[2] = T.exp2(S_other[n, h] - st[0])
                        for i in T.unroll(3):
                            w[i] = st[i]
                    T.tvm_storage_sync("shared")
                    for i in T.unroll(3):
                        st[i] = w[i]
                    for c in T.serial(T.ceildiv(D, THREADS)):
                        if c * THREADS + tx < D:
                            V[n, h, c * THREADS + tx] = T.Cast(V.dtype, (
                                T.Cast("float32", V[n, h, c * THREADS + tx]) * st[1]
                                + T.Cast("float32", V_other[n, h, c * THREADS + tx]) * st[2]) / (st[1] + st[2]))
                    if tx == 0:
                        S[n, h] = T.log2(st[1] + st[2]) + st[0]


@parse_cache.cached
def gpu_merge_state(dtype: str) -> tirx.PrimFunc:
    """TVM's GPU `merge_state_inplace` (V, S <- the merge of attention states (V, S) and (V_other, S_other), S in log2
    units), without its race: there every work-item of a head reads S and then writes the merged S back, so one
    that reads after another's write merges twice. That is harmless only where a head's work-items run in lockstep
    (a GPU wave), and it broke every chunked prefill on PoCL (a tiny Llama's logits off by 1.2 relative from the
    second chunk on). Here one work-item reads and writes S (_merge)."""

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
        _merge(V, S, V_other, S_other, N, H, D)

    return merge_state_inplace.with_attr("global_symbol", GPU_MERGE_SYMBOL)


@parse_cache.cached
def gpu_carrier_merge_state(shape: AttentionShape) -> tirx.PrimFunc:
    """gpu_merge_state for a quantized cache's carrier (cpu_attention.carrier_merge_signature: the real query heads'
    states only)."""

    @T.macro
    def body(V_rows, S, V_other_rows, S_other, N):
        _merge(V_rows, S, V_other_rows, S_other, N, shape.num_qo_heads, shape.head_dim)

    return carrier_merge_signature(shape, body).with_attr("global_symbol", GPU_MERGE_SYMBOL)


@parse_cache.cached
def gpu_quantized_split_rotary(shape: AttentionShape, rope_theta: float, rope_scale: float = 1.0,
                               rope_scaling: dict | None = None) -> tirx.PrimFunc:
    """A quantized cache's split + RoPE + quantize (cpu_attention.quantized_split_rotary's work, TVM's `fused_rope`
    signature) for a GPU: one work-group per token, one work-item per q, k and v head, which ropes (q, k) and stores
    (q) or quantizes (k, v: cpu_attention.row_quantizer) its row."""
    H_qo, H_kv, D = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim
    HALF = D // 2
    angle = rope_angle(D, rope_theta, rope_scale, rope_scaling)
    quantize_k, quantize_v = row_quantizer(shape, 0), row_quantizer(shape, 1)
    pad_k, pad_v = param_padding_zeroer(shape, 0), param_padding_zeroer(shape, 1)

    @T.macro
    def body(qkv_rows, position_map, q_rows, k_codes, v_codes, k, v, apply_rope, seq_len):
        for s in T.thread_binding(seq_len, thread="blockIdx.x"):
            for h in T.thread_binding(H_qo + 2 * H_kv, thread="threadIdx.x"):
                with T.sblock("split"):
                    T.reads()
                    T.writes()
                    freq = T.sblock_alloc_buffer((3,), "float32", scope="local")
                    row = T.sblock_alloc_buffer((D,), "float32", scope="local")
                    stat = T.sblock_alloc_buffer((2,), "float32", scope="local")  # cos and sin, then the row's
                    if h < H_qo + H_kv and apply_rope > 0:
                        for i in T.serial(HALF):
                            angle(freq, i, position_map[s])
                            stat[0] = T.cos(freq[0])
                            stat[1] = T.sin(freq[0])
                            row[i] = stat[0] * qkv_rows[s, h, i] - stat[1] * qkv_rows[s, h, i + HALF]
                            row[i + HALF] = stat[0] * qkv_rows[s, h, i + HALF] + stat[1] * qkv_rows[s, h, i]
                    else:
                        for d in T.serial(D):
                            row[d] = qkv_rows[s, h, d]
                    if h < H_qo:
                        for d in T.serial(D):
                            q_rows[s, h, d] = row[d]
                    elif h < H_qo + H_kv:
                        quantize_k(row, k_codes, k, s, h - H_qo, stat)
                    else:
                        quantize_v(row, v_codes, v, s, h - H_qo - H_kv, stat)
                    if h == H_qo:  # one work-item per plane writes its parameter rows' padding
                        pad_k(k, s)
                    elif h == H_qo + H_kv:
                        pad_v(v, s)

    return split_rotary_signature(shape, body)
