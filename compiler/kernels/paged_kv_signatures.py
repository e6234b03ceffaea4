"""The signatures of TVM 0.27's paged-KV attention kernels, as PrimFunc factories around a body.

TVM's paged KV cache (relax/frontend/nn/llm/kv_cache.py) calls its decode, ragged prefill and paged prefill kernels
by position with these arguments; mobilec's CPU kernels (cpu_attention.py) and GPU kernels (gpu_attention.py) take
them alike and differ only in the body, a T.macro called with the matched buffers, the scalars and the symbolic
sizes. The buffers are matched at the geometry the runtime allocates (`heads`, `kv_heads`, `head_dim`: for a
quantized cache, its float32 carrier's declared one). The RoPE arguments are matched as TVM's kernels match them
(the runtime checks them) and not passed on: the kernels read K stored after RoPE.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T


def length_info_shape(batch, sliding: bool):
    """length_info's shape: [b] rows used in each sequence's last page, or (a "mha_sliding" layer's kernel) [3, b]:
    those rows, the window's first row in its first page, the attention-sink rows."""
    return (3, batch) if sliding else (batch,)


def decode(body, *, heads: int, kv_heads: int, head_dim: int, page_size: int, dtype: str,
           sliding: bool) -> tirx.PrimFunc:
    """`batch_decode_paged_kv`: body(Q, pages, page_table_indptr, page_table_values, length_info, output, lse,
    rotary_mode, sm_scale, B, max_num_pages)."""

    # pylint: disable=too-many-locals,unused-variable
    @T.prim_func(private=True, s_tir=True)
    def batch_decode_paged_kv(
        Q_handle: T.handle,
        pages_handle: T.handle,
        page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle,
        var_length_info: T.handle,  # length_info_shape
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

        Q = T.match_buffer(Q_handle, (B, heads, head_dim), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, kv_heads, page_size, head_dim), dtype)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32",
                                           elem_offset=page_indptr_elem_offset)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32",
                                           elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (B, heads, head_dim), dtype)
        lse = T.match_buffer(lse_handle, (B, heads), "float32")
        length_info = T.match_buffer(var_length_info, length_info_shape(B, sliding), "int32",
                                     elem_offset=length_info_elem_offset)
        body(Q, pages, page_table_indptr, page_table_values, length_info, output, lse, rotary_mode, sm_scale, B,
             max_num_pages)

    return batch_decode_paged_kv


def ragged_prefill(body, *, heads: int, kv_heads: int, head_dim: int, dtype: str) -> tirx.PrimFunc:
    """`batch_prefill_ragged_kv` (head_dim the same for q/k and v): body(q, q_indptr, k, v, kv_indptr, output, lse,
    causal, rotary_mode, sm_scale, batch_size, qo_len, kv_len)."""

    # pylint: disable=too-many-locals,unused-variable
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

        q = T.match_buffer(var_q, (qo_len, heads, head_dim), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (kv_len, kv_heads, head_dim), dtype)
        v = T.match_buffer(var_v, (kv_len, kv_heads, head_dim), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        output = T.match_buffer(var_output, (qo_len, heads, head_dim), dtype)
        lse = T.match_buffer(var_lse, (qo_len, heads), "float32")
        body(q, q_indptr, k, v, kv_indptr, output, lse, causal, rotary_mode, sm_scale, batch_size, qo_len, kv_len)

    return batch_prefill_ragged_kv


def paged_prefill(body, *, heads: int, kv_heads: int, head_dim: int, page_size: int, dtype: str,
                  sliding: bool) -> tirx.PrimFunc:
    """`batch_prefill_paged_kv`: body(q, q_indptr, pages, page_indptr, page_values, length_info, output, lse,
    causal, rotary_mode, sm_scale, batch_size, total_len, max_num_pages)."""

    # pylint: disable=too-many-locals,unused-variable
    @T.prim_func(private=True, s_tir=True)
    def batch_prefill_paged_kv(
        var_q: T.handle,  # [total_len, h_q, d]
        var_q_indptr: T.handle,  # [batch_size + 1]
        var_pages: T.handle,  # [max_num_pages, 2, h_kv, page_size, d]
        var_page_indptr: T.handle,  # [batch_size + 1]
        var_page_values: T.handle,  # [nnz_pages]
        var_length_info: T.handle,  # length_info_shape
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
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()

        q = T.match_buffer(var_q, (total_len, heads, head_dim), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, kv_heads, page_size, head_dim), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(var_output, (total_len, heads, head_dim), dtype)
        lse = T.match_buffer(var_lse, (total_len, heads), "float32")
        length_info = T.match_buffer(var_length_info, length_info_shape(batch_size, sliding), "int32",
                                     elem_offset=length_info_elem_offset)
        body(q, q_indptr, pages, page_indptr, page_values, length_info, output, lse, causal, rotary_mode, sm_scale,
             batch_size, total_len, max_num_pages)

    return batch_prefill_paged_kv
