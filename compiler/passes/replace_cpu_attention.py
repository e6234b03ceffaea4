"""ReplaceCPUAttention: swap TVM's scalar CPU attention kernels of the paged KV cache for the vectorized ones in
compiler/kernels/cpu_attention.py.

TVMPagedKVCache (relax/frontend/nn/llm/kv_cache.py) adds its kernels to the module with `bb.add_func` and passes
their GlobalVars to `vm.builtin.paged_attention_kv_cache_create`; the runtime calls them by position. So the swap
is a plain replacement of the PrimFunc bound to that GlobalVar by one with the same signature and global symbol.
The kernel is recognised by its global symbol, and its shape (heads, head_dim, page size, dtype) is read from
its parameters. The pipeline runs it for LLVM CPU targets only, Hexagon's ARM host included, where the KV cache
runs them (GPU targets keep TVM's GPU kernels); it leaves
any shape the vectorized kernel does not take.

The cache also holds `_sliding_window` variants of the decode and paged prefill kernels, called for the layers of
attention kind "mha_sliding" only. A model with such layers says their window in the module attr
LAYER_SLIDING_WINDOW_ATTR (TVM bakes it into its prefill kernel, whose CPU version also misreads its softmax
state): then both are replaced by ours, or the build fails; without the attr they are never called and stay. A
model whose attention scores are capped (Gemma 2) says so in ATTN_LOGIT_CAP_ATTR, and one whose every layer has a
window shorter than the context (Mistral, Phi-3) in SLIDING_WINDOW_ATTR (its layers stay "mha", every key kept):
every kernel is then ours, with the cap or the window, or the build fails.

A quantized KV cache (int8, int4: kv_cache_dtype.Carrier) is declared to TVM as a float32 cache of another
geometry, whose cells TVM's kernels would read as floats: the importer records the real geometry and format as the
module attr KV_FORMAT_ATTR, and then all five kernels that read or write the packed cells (split + RoPE, decode,
ragged and paged prefill, merge of states) are replaced, by our variants built from that geometry, or the build
fails; with a window or a cap as above (the attention kernels take them for every KV layout), and with
"mha_sliding" layers their two sliding variants too. A model that applies RoPE itself (Gemma, Phi-3) creates the
cache with RopeMode.NONE: the runtime then calls the split kernel with apply_rope 0 and it only splits and quantizes.
TVM's copy kernels (transpose_append, copy_single_page, compact_kv_copy, debug_get_kv) move whole cells and stay.

Our attention kernels read K stored after RoPE (RopeMode.NORMAL or NONE) and fail on rotary_mode 1
(cpu_attention.ROTARY_REFUSAL): a module whose cache is created with RopeMode.INLINE is refused here, at compile
time (the create call's rope_mode argument). RoPE scaling (Llama 3's, or linear): the importer records the model's
as the module attr ROPE_ATTR, and a quantized cache's split + RoPE, which applies RoPE to every q and k, gets it as
TVM's split + RoPE got it from TIRPagedKVCache. A module without the attr (built by hand) has plain RoPE. A float
cache's split + RoPE is ours too where the attr gives rope_theta and a scaling rope_angle computes (float_split_rotary:
TVM's computes pow, cos and sin for every element, ~10% of a SmolLM2 decode step's attention).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import tvm
from tvm import relax, tirx
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode

from ..errors import MobilecError
from ..kernels.cpu_attention import (
    ATTN_LOGIT_CAP_ATTR,
    DECODE_SYMBOL,
    LAYER_SLIDING_WINDOW_ATTR,
    MERGE_SYMBOL,
    MIN_VECTOR_REGISTERS,
    PAGED_PREFILL_SYMBOL,
    RAGGED_SYMBOL,
    SLIDING_SUFFIX,
    SLIDING_WINDOW_ATTR,
    SPLIT_ROTARY_SYMBOL,
    AttentionShape,
    attention_decode,
    attention_prefill_paged,
    attention_prefill_ragged,
    carrier_merge_state,
    float_split_rotary,
    quantized_split_rotary,
)
from ..model_import.kv_cache_dtype import CODE_FORMATS, KV_FORMAT_ATTR, ROPE_ATTR
from .ir_walk import relax_nodes


def rope_of(mod: tvm.IRModule) -> tuple[float, dict[str, Any]]:
    """(rope_scale, TVM's rope_scaling dict) the importer recorded on `mod` (ROPE_ATTR); plain RoPE without it."""
    attr = mod.attrs.get(ROPE_ATTR) if mod.attrs is not None else None
    if attr is None:
        return 1.0, {}
    rope = json.loads(str(attr))
    return float(rope["rope_scale"]), dict(rope["rope_scaling"])


def float_split_rotary_for(mod: tvm.IRModule, func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """Our split + RoPE in place of TVM's `fused_rope` of a float cache, for the geometry of TVM's kernel and the
    RoPE the importer recorded (ROPE_ATTR, with rope_theta); None (TVM's stays) for a module without it, a RoPE
    scaling rope_angle does not compute, or a kernel not of the layout expected."""
    attr = mod.attrs.get(ROPE_ATTR) if mod.attrs is not None else None
    rope = json.loads(str(attr)) if attr is not None else {}
    kind = (rope.get("rope_scaling") or {}).get("rope_type")
    if "rope_theta" not in rope or kind not in (None, "llama3"):
        return None
    qkv, q, k, v = (func.params[i] for i in (0, 2, 3, 4))
    try:
        (fused, d), (h_qo, d_q), (h_kv, d_k), (h_v, d_v) = ((int(x) for x in b.shape[1:]) for b in (qkv, q, k, v))
    except (TypeError, ValueError, AttributeError):  # a symbolic dimension, or not the layout expected
        return None
    if (fused, h_v, d_q, d_k, d_v) != (h_qo + 2 * h_kv, h_kv, d, d, d) or d % 2 or len(
            {str(b.dtype) for b in (qkv, q, k, v)}) != 1:
        return None
    return float_split_rotary(h_qo, h_kv, d, str(qkv.dtype), float(rope["rope_theta"]), float(rope["rope_scale"]),
                              rope["rope_scaling"])


def in_place_of(old: tirx.PrimFunc, new: tirx.PrimFunc) -> tirx.PrimFunc:
    """`new` with the attributes of TVM's kernel `old` (its global symbol: the name the runtime calls), and
    noalias."""
    return new.with_attrs({**dict(old.attrs), "tirx.noalias": True})


def with_functions(mod: tvm.IRModule, replaced: dict) -> tvm.IRModule:
    """`mod` with the PrimFuncs of `replaced` (GlobalVar -> PrimFunc) bound to their GlobalVars; `mod` itself when
    there are none."""
    if not replaced:
        return mod
    mod = mod.clone()
    for gv, func in replaced.items():
        mod.update_func(gv, func)
    return mod


# TVM's call that creates the paged KV cache (TIRPagedKVCache, FlashInferPagedKVCache), and the position of its
# rope_mode among the arguments after the function's name
CACHE_CREATE = "vm.builtin.paged_attention_kv_cache_create"
CREATE_ROPE_MODE_ARG = 8


def cache_rope_modes(mod: tvm.IRModule) -> set[int]:
    """The RopeMode of each paged KV cache the module's Relax functions create."""
    return {int(call.args[1 + CREATE_ROPE_MODE_ARG].value)
            for func in mod.functions.values() if isinstance(func, relax.Function) for call in relax_nodes(func)
            if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_pure_packed"
            and isinstance(call.args[0], relax.ExternFunc) and call.args[0].global_symbol == CACHE_CREATE}


def global_symbol(func) -> str | None:
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


def attention_settings(mod: tvm.IRModule) -> tuple[int, int, float]:
    """(the "mha_sliding" layers' window, every layer's window, the logit cap) the model recorded on `mod`
    (LAYER_SLIDING_WINDOW_ATTR, SLIDING_WINDOW_ATTR, ATTN_LOGIT_CAP_ATTR); 0 for each it did not."""
    attrs = mod.attrs if mod.attrs is not None else {}
    return (int(attrs.get(LAYER_SLIDING_WINDOW_ATTR, 0)), int(attrs.get(SLIDING_WINDOW_ATTR, 0)),
            float(attrs.get(ATTN_LOGIT_CAP_ATTR, 0.0)))


# global symbol -> (its shape from TVM's PrimFunc, our kernel for that shape, lanes, vector registers, the
# "mha_sliding" layers' window, every layer's window and the logit cap)
KERNELS = {
    DECODE_SYMBOL: (decode_shape, lambda shape, lanes, _, __, window, cap: attention_decode(
        shape, lanes, window=window, logit_cap=cap)),
    RAGGED_SYMBOL: (ragged_shape, lambda shape, lanes, registers, _, window, cap: attention_prefill_ragged(
        shape, lanes, registers=registers, window=window, logit_cap=cap)),
    PAGED_PREFILL_SYMBOL: (lambda func: decode_shape(func, pages_param=2),
                           lambda shape, lanes, registers, _, window, cap: attention_prefill_paged(
                               shape, lanes, registers=registers, window=window, logit_cap=cap)),
}
# the same for the "mha_sliding" layers
SLIDING_KERNELS = {
    DECODE_SYMBOL + SLIDING_SUFFIX: (decode_shape, lambda shape, lanes, _, __, ___, cap: attention_decode(
        shape, lanes, sliding=True, logit_cap=cap)),
    PAGED_PREFILL_SYMBOL + SLIDING_SUFFIX: (
        lambda func: decode_shape(func, pages_param=2),
        lambda shape, lanes, registers, layer_window, _, cap: attention_prefill_paged(
            shape, lanes, registers=registers, sliding_window=layer_window, logit_cap=cap)),
}


@tvm.transform.module_pass(opt_level=0, name="ReplaceCPUAttention")
class ReplaceCPUAttention:  # pylint: disable=too-few-public-methods
    """The paged KV cache's attention kernels (TVM's scalar `batch_decode_paged_kv_cpu`, `batch_prefill_ragged_kv`
    and `batch_prefill_paged_kv_cpu`) -> the vectorized ones of compiler/kernels/cpu_attention.py, at `lanes` float32
    lanes, the prefill kernels' register tiles sized for `registers` vector registers (the pipeline adds this step
    for LLVM CPU targets, with the plan's). Anywhere before the build (TVM's kernels are marked scheduled, so dlight
    leaves them, as it leaves these)."""

    def __init__(self, lanes: int, registers: int = MIN_VECTOR_REGISTERS):
        self.lanes = lanes
        self.registers = registers

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if RopeMode.INLINE in cache_rope_modes(mod):
            raise MobilecError("a paged KV cache with RopeMode.INLINE (RoPE inside attention) is not supported by "
                               "mobilec's CPU attention kernels; create it with RopeMode.NORMAL or NONE")
        kv_format = mod.attrs.get(KV_FORMAT_ATTR) if mod.attrs is not None else None
        return with_functions(mod, self._quantized(mod, kv_format) if kv_format is not None else self._float(mod))

    def _float(self, mod: tvm.IRModule) -> dict:
        """TVM's kernels that ours take (and its split + RoPE: float_split_rotary_for); with a sliding window (LAYER_SLIDING_WINDOW_ATTR) the sliding variants too,
        and with a window on every layer (SLIDING_WINDOW_ATTR) or a logit cap (ATTN_LOGIT_CAP_ATTR) every kernel, or
        the build fails: TVM's have none of them."""
        _, window, cap = attention_settings(mod)
        kernels = self._attention_kernels(mod)
        replaced = {}
        for gv, func in mod.functions_items():
            symbol = global_symbol(func)
            if symbol == SPLIT_ROTARY_SYMBOL:
                ours = float_split_rotary_for(mod, func)
                if ours is not None:
                    replaced[gv] = in_place_of(func, ours)
                continue
            if symbol not in kernels:
                continue
            read_shape, build = kernels[symbol]
            shape = read_shape(func)
            if shape is None or not shape.supported(self.lanes):
                if cap or window or symbol in SLIDING_KERNELS:
                    needs = "capped attention scores" if cap else "a sliding window"
                    raise MobilecError(f"{symbol}: {needs} needs mobilec's CPU attention kernels, which do not take "
                                       f"{shape} at {self.lanes} lanes (TVM's kernels would be wrong)")
                continue
            replaced[gv] = in_place_of(func, build(shape))
        return replaced

    def _attention_kernels(self, mod: tvm.IRModule) -> dict:
        """global symbol -> (its shape from TVM's PrimFunc, shape -> our kernel at the target's lanes with the
        module's windows and cap): KERNELS, and SLIDING_KERNELS with "mha_sliding" layers."""
        layer_window, window, cap = attention_settings(mod)
        kernels = {**KERNELS, **(SLIDING_KERNELS if layer_window else {})}
        return {symbol: (read_shape, lambda shape, build=build: build(shape, self.lanes, self.registers, layer_window,
                                                                     window, cap))
                for symbol, (read_shape, build) in kernels.items()}

    def _quantized(self, mod: tvm.IRModule, kv_format) -> dict:
        """The five kernels of a quantized cache (quantized_replacements) at the target's lanes, with the module's
        windows and logit cap as in _float; with "mha_sliding" layers their two sliding variants too."""
        attention = self._attention_kernels(mod)

        def kernels(shape: AttentionShape, rope_theta: float, rope_scale: float, rope_scaling: dict) -> dict:
            if not shape.supported(self.lanes):
                raise MobilecError(f"--kv-dtype {shape.dtype}: {shape.num_qo_heads} query heads, {shape.num_kv_heads} "
                                   f"KV heads of head_dim {shape.head_dim} are not taken by the {self.lanes}-lane "
                                   f"CPU kernels")
            return {
                **{symbol: functools.partial(build, shape) for symbol, (_, build) in attention.items()},
                SPLIT_ROTARY_SYMBOL: lambda: quantized_split_rotary(shape, rope_theta, rope_scale, rope_scaling),
                MERGE_SYMBOL: lambda: carrier_merge_state(shape),
            }

        return quantized_replacements(mod, kv_format, DECODE_SYMBOL, kernels)


def quantized_replacements(mod: tvm.IRModule, kv_format, decode_symbol: str, kernels) -> dict:
    """GlobalVar -> our kernel, for every kernel that reads or writes a quantized cache's packed cells, for the real
    geometry in `kv_format` (Carrier.module_attr); TVM's would misread the carrier, so a kernel missing fails.
    `kernels(shape, rope_theta, rope_scale, rope_scaling)` -> {TVM's global symbol: build()}; `decode_symbol`: TVM's
    decode kernel, whose pages give the page size."""
    funcs = {global_symbol(func): (gv, func) for gv, func in mod.functions_items()}
    name = str(kv_format["format"])
    if name not in CODE_FORMATS or decode_symbol not in funcs:
        raise MobilecError(f"{KV_FORMAT_ATTR} {dict(kv_format)}: not a quantized cache with TVM's kernels")
    page_size = int(funcs[decode_symbol][1].params[1].shape[3])
    shape = AttentionShape(num_kv_heads=int(kv_format["kv_heads"]), num_qo_heads=int(kv_format["heads"]),
                           head_dim=int(kv_format["head_dim"]), dtype=name, page_size=page_size)
    declared = decode_shape(funcs[decode_symbol][1])
    assert declared is not None and (declared.num_qo_heads, declared.num_kv_heads, declared.head_dim,
                                     declared.dtype) == (*shape.declared, "float32"), (declared, shape)
    rope_scale, rope_scaling = rope_of(mod)
    builds = kernels(shape, float(kv_format["rope_theta"]), rope_scale, rope_scaling)
    missing = [symbol for symbol in builds if symbol not in funcs]
    if missing:
        raise MobilecError(f"--kv-dtype {name}: the module lacks TVM's kernels {missing} to replace")
    return {funcs[symbol][0]: in_place_of(funcs[symbol][1], build()) for symbol, build in builds.items()}
