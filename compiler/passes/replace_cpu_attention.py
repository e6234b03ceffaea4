"""ReplaceCPUAttention: swap TVM's scalar CPU attention kernels of the paged KV cache for the vectorized ones in
compiler/kernels/cpu_attention.py.

TVMPagedKVCache (relax/frontend/nn/llm/kv_cache.py) adds its kernels to the module with `bb.add_func` and passes
their GlobalVars to `vm.builtin.paged_attention_kv_cache_create`; the runtime calls them by position. So the swap
is a plain replacement of the PrimFunc bound to that GlobalVar by one with the same signature and global symbol.
The kernel is recognised by its global symbol, and its shape (heads, head_dim, page size, dtype) is read from
its parameters. The pipeline runs it for LLVM CPU targets only (GPU targets keep TVM's GPU kernels); it leaves
the sliding-window variants and any shape the vectorized kernel does not take.

A quantized KV cache (int8, int4: kv_cache_dtype.Carrier) is declared to TVM as a float32 cache of another
geometry, whose cells TVM's kernels would read as floats: the importer records the real geometry and format as the
module attr KV_FORMAT_ATTR, and then all five kernels that read or write the packed cells (split + RoPE, decode,
ragged and paged prefill, merge of states) are replaced, by our variants built from that geometry, or the build
fails.
TVM's copy kernels (transpose_append, copy_single_page, compact_kv_copy, debug_get_kv) move whole cells and stay.
"""

from __future__ import annotations

import tvm
from tvm import tirx

from ..errors import MobilecError
from ..kernels.cpu_attention import (
    DECODE_SYMBOL,
    MERGE_SYMBOL,
    PAGED_PREFILL_SYMBOL,
    RAGGED_SYMBOL,
    SPLIT_ROTARY_SYMBOL,
    AttentionShape,
    attention_decode,
    attention_prefill_paged,
    attention_prefill_ragged,
    carrier_merge_state,
    quantized_split_rotary,
)
from ..kv_cache_dtype import CODE_FORMATS, KV_FORMAT_ATTR


def _global_symbol(func) -> str | None:
    if not isinstance(func, tirx.PrimFunc) or func.attrs is None:
        return None
    symbol = func.attrs.get("global_symbol")
    return str(symbol) if symbol is not None else None


def decode_shape(func: tirx.PrimFunc, pages_param: int = 1) -> AttentionShape | None:
    """The shape TVM built its decode (or paged prefill) kernel with: Q [B, H_qo, D] and pages
    [pages, 2, H_kv, page_size, D]."""
    q, pages = func.params[0], func.params[pages_param]
    try:
        h_qo, d = (int(x) for x in q.shape[1:])
        two, h_kv, page_size, d_kv = (int(x) for x in pages.shape[1:])
    except (TypeError, ValueError, AttributeError):  # a symbolic dimension, or not the layout expected
        return None
    if two != 2 or d_kv != d or str(q.dtype) != str(pages.dtype):
        return None
    return AttentionShape(num_kv_heads=h_kv, num_qo_heads=h_qo, head_dim=d, dtype=str(q.dtype), page_size=page_size)


def ragged_shape(func: tirx.PrimFunc) -> AttentionShape | None:
    """The shape TVM built its ragged prefill kernel with: q [n, H_qo, D], k and v [m, H_kv, D] (same head_dim)."""
    q, k, v = func.params[0], func.params[2], func.params[3]
    try:
        h_qo, d = (int(x) for x in q.shape[1:])
        h_kv, d_k = (int(x) for x in k.shape[1:])
        h_v, d_v = (int(x) for x in v.shape[1:])
    except (TypeError, ValueError, AttributeError):
        return None
    if (h_v, d_k, d_v) != (h_kv, d, d) or not str(q.dtype) == str(k.dtype) == str(v.dtype):
        return None
    return AttentionShape(num_kv_heads=h_kv, num_qo_heads=h_qo, head_dim=d, dtype=str(q.dtype), page_size=16)


# global symbol -> (its shape from TVM's PrimFunc, our kernel for that shape)
KERNELS = {
    DECODE_SYMBOL: (decode_shape, attention_decode),
    RAGGED_SYMBOL: (ragged_shape, attention_prefill_ragged),
    PAGED_PREFILL_SYMBOL: (lambda func: decode_shape(func, pages_param=2), attention_prefill_paged),
}


@tvm.transform.module_pass(opt_level=0, name="ReplaceCPUAttention")
class ReplaceCPUAttention:  # pylint: disable=too-few-public-methods
    """The paged KV cache's attention kernels (TVM's scalar `batch_decode_paged_kv_cpu`, `batch_prefill_ragged_kv`
    and `batch_prefill_paged_kv_cpu`) -> the vectorized ones of compiler/kernels/cpu_attention.py, at `lanes` float32
    lanes (the pipeline adds this step for LLVM CPU targets). Anywhere before the build (TVM's kernels are marked
    scheduled, so dlight leaves them, as it leaves these)."""

    def __init__(self, lanes: int):
        self.lanes = lanes

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        kv_format = mod.attrs.get(KV_FORMAT_ATTR) if mod.attrs is not None else None
        replaced = self._quantized(mod, kv_format) if kv_format is not None else self._float(mod)
        if not replaced:
            return mod
        mod = mod.clone()
        for gv, func in replaced.items():
            mod.update_func(gv, func)
        return mod

    def _float(self, mod: tvm.IRModule) -> dict:
        replaced = {}
        for gv, func in mod.functions_items():
            symbol = _global_symbol(func)
            if symbol not in KERNELS:
                continue
            read_shape, build = KERNELS[symbol]
            shape = read_shape(func)
            if shape is None or not shape.supported(self.lanes):
                continue
            replaced[gv] = build(shape, self.lanes).with_attrs({**dict(func.attrs), "tirx.noalias": True})
        return replaced

    def _quantized(self, mod: tvm.IRModule, kv_format) -> dict:
        """The five kernels of a quantized cache, for the real geometry in `kv_format` (Carrier.module_attr); TVM's
        would misread the carrier, so a kernel missing or a geometry the vectorized kernels do not take fails."""
        funcs = {_global_symbol(func): (gv, func) for gv, func in mod.functions_items()}
        name = str(kv_format["format"])
        if name not in CODE_FORMATS or DECODE_SYMBOL not in funcs:
            raise MobilecError(f"{KV_FORMAT_ATTR} {dict(kv_format)}: not a quantized cache with TVM's CPU kernels")
        page_size = int(funcs[DECODE_SYMBOL][1].params[1].shape[3])
        shape = AttentionShape(num_kv_heads=int(kv_format["kv_heads"]), num_qo_heads=int(kv_format["heads"]),
                               head_dim=int(kv_format["head_dim"]), dtype=name, page_size=page_size)
        if not shape.supported(self.lanes):
            raise MobilecError(f"--kv-dtype {name}: {shape.num_qo_heads} query heads, {shape.num_kv_heads} KV heads "
                               f"of head_dim {shape.head_dim} are not taken by the {self.lanes}-lane CPU kernels")
        declared = decode_shape(funcs[DECODE_SYMBOL][1])
        assert declared is not None and (declared.num_qo_heads, declared.num_kv_heads, declared.head_dim,
                                         declared.dtype) == (*shape.declared, "float32"), (declared, shape)
        builds = {
            DECODE_SYMBOL: lambda: attention_decode(shape, self.lanes),
            RAGGED_SYMBOL: lambda: attention_prefill_ragged(shape, self.lanes),
            PAGED_PREFILL_SYMBOL: lambda: attention_prefill_paged(shape, self.lanes),
            SPLIT_ROTARY_SYMBOL: lambda: quantized_split_rotary(shape, float(kv_format["rope_theta"])),
            MERGE_SYMBOL: lambda: carrier_merge_state(shape),
        }
        missing = [symbol for symbol in builds if symbol not in funcs]
        if missing:
            raise MobilecError(f"--kv-dtype {name}: the module lacks TVM's kernels {missing} to replace")
        return {funcs[symbol][0]: build().with_attrs({**dict(funcs[symbol][1].attrs), "tirx.noalias": True})
                for symbol, build in builds.items()}
