"""ReplaceGPUAttention: swap TVM's GPU kernels of the paged KV cache for those of compiler/kernels/gpu_attention.py:
the merge of attention states always (TVM's races: gpu_merge_state), and the attention kernels in a model whose
attention TVM's kernels do not implement: a window on every layer (SLIDING_WINDOW_ATTR: Mistral, Phi-3), the
"mha_sliding" layers' window (LAYER_SLIDING_WINDOW_ATTR: Gemma) or capped scores (ATTN_LOGIT_CAP_ATTR: Gemma 2).
A quantized KV cache (KV_FORMAT_ATTR: int8, int4 on the float32 carrier) gets all five kernels that read or write
its packed cells, as on the CPU (replace_cpu_attention.quantized_replacements), with the windows and cap above.

As in passes/replace_cpu_attention.py: the runtime calls the kernels by position, so each PrimFunc bound to the
GlobalVar of TVM's kernel (found by its global symbol) is replaced by ours of the same signature and symbol, its
shape read from TVM's parameters. Every attention kernel of such a model is ours, or the build fails; a model
without the attrs keeps TVM's (faster) attention kernels. Ours read K stored after RoPE: a RopeMode.INLINE cache
with the attrs is refused.
"""

from __future__ import annotations

import functools

import tvm
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode

from ..errors import MobilecError
from ..kernels.cpu_attention import SLIDING_SUFFIX, SPLIT_ROTARY_SYMBOL
from ..kernels.gpu_attention import (
    GPU_DECODE_SYMBOL,
    GPU_MERGE_SYMBOL,
    GPU_PAGED_PREFILL_SYMBOL,
    GPU_RAGGED_SYMBOL,
    gpu_attention_decode,
    gpu_attention_prefill_paged,
    gpu_attention_prefill_ragged,
    gpu_carrier_merge_state,
    gpu_merge_state,
    gpu_quantized_split_rotary,
)
from ..model_import.kv_cache_dtype import KV_FORMAT_ATTR
from .replace_cpu_attention import (
    attention_settings,
    cache_rope_modes,
    decode_shape,
    global_symbol,
    in_place_of,
    quantized_replacements,
    ragged_shape,
    with_functions,
)


def _builders(layer_window: int, window: int, cap: float) -> dict:
    """global symbol -> (its shape from TVM's PrimFunc, our kernel for that shape); the sliding variants with a
    layer window only (without one the cache never calls them)."""
    kernels = {
        GPU_DECODE_SYMBOL: (decode_shape, lambda s: gpu_attention_decode(s, window=window, logit_cap=cap)),
        GPU_RAGGED_SYMBOL: (ragged_shape, lambda s: gpu_attention_prefill_ragged(s, window=window, logit_cap=cap)),
        GPU_PAGED_PREFILL_SYMBOL: (lambda f: decode_shape(f, pages_param=2),
                                   lambda s: gpu_attention_prefill_paged(s, window=window, logit_cap=cap)),
    }
    if layer_window:  # every page passed (gpu_attention: GemmaConfig.sliding_pages_all), the window by position
        kernels[GPU_DECODE_SYMBOL + SLIDING_SUFFIX] = (
            decode_shape, lambda s: gpu_attention_decode(s, sliding=True, window=layer_window, logit_cap=cap))
        kernels[GPU_PAGED_PREFILL_SYMBOL + SLIDING_SUFFIX] = (
            lambda f: decode_shape(f, pages_param=2),
            lambda s: gpu_attention_prefill_paged(s, sliding=True, window=layer_window, logit_cap=cap))
    return kernels


def _quantized_kernels(builders: dict):
    """quantized_replacements' kernels(): the attention kernels of `builders` (_builders: with the module's windows
    and cap) for the quantized cache's geometry, its split + RoPE + quantize and its carrier's merge."""

    def kernels(shape, rope_theta: float, rope_scale: float, rope_scaling: dict) -> dict:
        return {
            **{symbol: functools.partial(build, shape) for symbol, (_, build) in builders.items()},
            SPLIT_ROTARY_SYMBOL: lambda: gpu_quantized_split_rotary(shape, rope_theta, rope_scale, rope_scaling),
            GPU_MERGE_SYMBOL: lambda: gpu_carrier_merge_state(shape),
        }

    return kernels


@tvm.transform.module_pass(opt_level=0, name="ReplaceGPUAttention")
class ReplaceGPUAttention:  # pylint: disable=too-few-public-methods
    """TVM's GPU merge of attention states -> ours; its attention kernels too in a module with a window or a logit
    cap (the pipeline adds this step for GPU targets). Anywhere before the build (every kernel here is marked
    scheduled, so dlight leaves it)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        kv_format = mod.attrs.get(KV_FORMAT_ATTR) if mod.attrs is not None else None
        layer_window, window, cap = attention_settings(mod)
        builders = _builders(layer_window, window, cap) if layer_window or window or cap else {}
        if (kv_format is not None or builders) and RopeMode.INLINE in cache_rope_modes(mod):
            raise MobilecError("a paged KV cache with RopeMode.INLINE (RoPE inside attention) is not supported by "
                               "mobilec's GPU attention kernels; create it with RopeMode.NORMAL or NONE")
        if kv_format is not None:
            return with_functions(mod, quantized_replacements(mod, kv_format, GPU_DECODE_SYMBOL, _quantized_kernels(
                _builders(layer_window, window, cap))))
        replaced = {}
        for gv, func in mod.functions_items():
            symbol = global_symbol(func)
            if symbol == GPU_MERGE_SYMBOL:
                replaced[gv] = in_place_of(func, gpu_merge_state(str(func.params[0].dtype)))  # V's dtype
            if symbol not in builders:
                continue
            read_shape, build = builders[symbol]
            shape = read_shape(func)
            if shape is None:
                raise MobilecError(f"{symbol}: a sliding window or capped scores need mobilec's GPU attention "
                                   f"kernels, which cannot read this kernel's shape (TVM's kernels would be wrong)")
            replaced[gv] = in_place_of(func, build(shape))
        missing = sorted(set(builders) - {global_symbol(f) for f in replaced.values()})
        if missing:
            raise MobilecError(f"a sliding window or capped scores on a GPU: the module lacks TVM's kernels {missing} "
                               f"to replace")
        return with_functions(mod, replaced)
