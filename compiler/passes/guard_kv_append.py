"""GuardKVAppend: TVM's GPU append of K/V rows into the paged cache -> ours (kernels/kv_append.py), which reads a
token's position only within the token count."""

from __future__ import annotations

import tvm

from ..kernels.kv_append import KV_APPEND_SYMBOL, kv_append
from .replace_cpu_attention import global_symbol, in_place_of, with_functions


@tvm.transform.module_pass(opt_level=0, name="GuardKVAppend")
class GuardKVAppend:  # pylint: disable=too-few-public-methods
    """Once the GPU schedule pads the token loop into thread groups, TVM's kernel reads position_map past its
    `ntoken` entries in the last group (its `if` stands outside the guarded blocks). The runtime calls the kernel by
    position, so ours takes its GlobalVar, symbol and signature, its geometry read from the pages parameter (a
    quantized cache's float32 carrier included: the append moves whole cells). Before the schedule step."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        replaced = {}
        for gv, func in mod.functions_items():
            if global_symbol(func) == KV_APPEND_SYMBOL:
                pages = func.params[0]
                _, _, kv_heads, page_size, head_dim = pages.shape
                replaced[gv] = in_place_of(func, kv_append(int(kv_heads), int(head_dim), int(page_size),
                                                           str(pages.dtype)))
        return with_functions(mod, replaced)
