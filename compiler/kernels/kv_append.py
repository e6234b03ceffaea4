"""The paged KV cache's append of new K/V rows into their pages (TVM's `tir_kv_cache_transpose_append` signature),
with each token's position read only by the threads of that token."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from . import parse_cache

KV_APPEND_SYMBOL = "tir_kv_cache_transpose_append"


@parse_cache.cached
def kv_append(kv_heads: int, head_dim: int, page_size: int, dtype: str) -> tirx.PrimFunc:
    """pages[position // page_size, 0 / 1, h, position % page_size, :] = K / V of each token whose position is not
    -1. The position test sits inside each block: a GPU schedule binds the token loop to padded thread groups and
    guards the block, so a thread past the last token reads no position (TVM's kernel tests it outside the blocks,
    reading position_map past its end: Oclgrind's "depends on uninitialized value")."""

    @T.macro(hygienic=False)  # reads pages and position_map of the kernel it is expanded in
    def append(slot: int, data, token, h, f):
        vt, vh, vf = T.axis.remap("SSS", [token, h, f])
        T.reads(position_map[vt], data[vt, vh, vf])
        T.writes(pages[position_map[vt] // page_size, slot, vh, position_map[vt] % page_size, vf])
        if position_map[vt] != -1:
            pages[position_map[vt] // page_size, slot, vh, position_map[vt] % page_size, vf] = data[vt, vh, vf]

    # pylint: disable=too-many-locals,unused-variable
    @T.prim_func(private=True, s_tir=True)
    def kv_transpose_append(var_pages: T.handle, var_k_data: T.handle, var_v_data: T.handle,
                            var_position_map: T.handle):
        T.func_attr({"tirx.noalias": True})
        ntoken = T.int64()
        num_pages = T.int64()
        pages_elem_offset = T.int64()
        position_map_elem_offset = T.int32()
        pages = T.match_buffer(var_pages, (num_pages, 2, kv_heads, page_size, head_dim), dtype,
                               elem_offset=pages_elem_offset)
        k_data = T.match_buffer(var_k_data, (ntoken, kv_heads, head_dim), dtype)
        v_data = T.match_buffer(var_v_data, (ntoken, kv_heads, head_dim), dtype)
        position_map = T.match_buffer(var_position_map, (ntoken,), "int32", elem_offset=position_map_elem_offset)
        for token, h, f in T.grid(ntoken, kv_heads, head_dim):
            with T.sblock("k_append"):
                append(0, k_data, token, h, f)
            with T.sblock("v_append"):
                append(1, v_data, token, h, f)

    return kv_transpose_append
