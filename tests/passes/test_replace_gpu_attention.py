"""ReplaceGPUAttention on TVM's own GPU paged KV cache (TIRPagedKVCache built for android-adreno): IR in, IR out.
The merge of attention states always becomes ours; the attention kernels only in a model with a window or a logit
cap (every layer's window in the plain kernels, the "mha_sliding" layers' in their variants), with TVM's signatures
and symbols; an inline-RoPE cache is refused then; a quantized cache gets all five kernels that touch its cells;
the pipeline runs the step on GPU targets only."""

import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache

from compiler.codegen import pipeline
from compiler.errors import MobilecError
from compiler.kernels.cpu_attention import ATTN_LOGIT_CAP_ATTR, LAYER_SLIDING_WINDOW_ATTR, SLIDING_WINDOW_ATTR
from compiler.kernels.cpu_attention import AttentionShape
from compiler.kernels.gpu_attention import (
    gpu_attention_decode,
    gpu_attention_prefill_paged,
    gpu_attention_prefill_ragged,
    gpu_carrier_merge_state,
    gpu_merge_state,
    gpu_quantized_split_rotary,
)
from compiler.model_import.kv_cache_dtype import KV_FORMAT_ATTR, carrier_for
from compiler.passes.replace_cpu_attention import decode_shape, ragged_shape
from compiler.passes.replace_gpu_attention import ReplaceGPUAttention
from compiler.target.build_plan import resolve_plan
from compiler.target.targets import load_target

TARGET = load_target("android-adreno").tvm_target()
DECODE, RAGGED, PAGED = "tir_attention_decode", "tir_attention_prefill_ragged", "tir_attention_prefill"
MERGE = "tir_attention_merge_state"


def _cache_module(rope_mode: RopeMode = RopeMode.NORMAL, dtype: str = "float16",
                  geometry: tuple[int, int, int] = (8, 2, 64)) -> tvm.IRModule:
    """A module creating TVM's paged KV cache for the GPU target, as models/llama.py does, with (query heads, KV
    heads, head_dim) `geometry`."""
    heads, kv_heads, head_dim = geometry
    bb = relax.BlockBuilder()
    with bb.function("create", []):
        cache = TIRPagedKVCache(
            attn_kind="mha", max_batch_size=1, max_total_seq_len=64, prefill_chunk_size=64, page_size=16,
            support_sliding_window=0, layer_partition=relax.ShapeExpr([0, 1]), num_hidden_layers=1,
            num_attention_heads=heads, num_key_value_heads=kv_heads, qk_head_dim=head_dim, v_head_dim=head_dim,
            mla_original_qk_head_dim=0, mla_original_v_head_dim=0, rope_mode=rope_mode, rope_scale=1,
            rope_theta=10000, rope_scaling={}, rope_ext_factors=relax.prim_value(0), rotary_dim=head_dim,
            enable_disaggregation=False, dtype=dtype, target=TARGET)
        bb.emit_func_output(cache._expr)  # pylint: disable=protected-access
    return bb.get()


def _ours(func, old):
    return func.with_attrs({**dict(old.attrs), "tirx.noalias": True})


def test_without_a_window_or_cap_only_the_merge_is_replaced():
    mod = _cache_module()
    swapped = ReplaceGPUAttention()(mod)
    tvm.ir.assert_structural_equal(swapped[MERGE], _ours(gpu_merge_state("float16"), mod[MERGE]))
    assert not swapped[MERGE].same_as(mod[MERGE])
    for name in (DECODE, RAGGED, PAGED, DECODE + "_sliding_window", PAGED + "_sliding_window"):
        assert swapped[name].same_as(mod[name]), name


def test_every_layer_window_goes_to_the_plain_kernels():
    mod = _cache_module().with_attr(SLIDING_WINDOW_ATTR, 24)
    swapped = ReplaceGPUAttention()(mod)
    for name, read_shape, build in (
            (DECODE, decode_shape, lambda s: gpu_attention_decode(s, window=24)),
            (RAGGED, ragged_shape, lambda s: gpu_attention_prefill_ragged(s, window=24)),
            (PAGED, lambda f: decode_shape(f, pages_param=2), lambda s: gpu_attention_prefill_paged(s, window=24))):
        old = mod[name]
        tvm.ir.assert_structural_equal(swapped[name], _ours(build(read_shape(old)), old))
        assert swapped[name].attrs["global_symbol"] == old.attrs["global_symbol"]
        assert [p.name for p in swapped[name].params] == [p.name for p in old.params]
    assert swapped[DECODE + "_sliding_window"].same_as(mod[DECODE + "_sliding_window"])  # never called


def test_layer_window_and_cap_go_to_every_kernel():
    """Gemma: the sliding variants with the layers' window by position, every kernel with the cap."""
    mod = _cache_module().with_attr(LAYER_SLIDING_WINDOW_ATTR, 8).with_attr(ATTN_LOGIT_CAP_ATTR, 50.0)
    swapped = ReplaceGPUAttention()(mod)
    for name, build in (
            (DECODE, lambda s: gpu_attention_decode(s, logit_cap=50.0)),
            (DECODE + "_sliding_window", lambda s: gpu_attention_decode(s, sliding=True, window=8, logit_cap=50.0)),
            (PAGED + "_sliding_window",
             lambda s: gpu_attention_prefill_paged(s, sliding=True, window=8, logit_cap=50.0))):
        old = mod[name]
        tvm.ir.assert_structural_equal(swapped[name], _ours(build(decode_shape(old, 2 if "prefill" in name else 1)),
                                                            old))
    assert swapped[PAGED + "_sliding_window"].attrs["global_symbol"] == "batch_prefill_paged_kv_sliding_window"


def test_inline_rope_is_refused_only_where_our_attention_kernels_go():
    with pytest.raises(MobilecError, match="RopeMode.INLINE"):
        ReplaceGPUAttention()(_cache_module(RopeMode.INLINE).with_attr(SLIDING_WINDOW_ATTR, 24))
    mod = _cache_module(RopeMode.INLINE)
    assert ReplaceGPUAttention()(mod)[DECODE].same_as(mod[DECODE])


def test_pipeline_runs_it_on_gpu_targets_only():
    for name, has_step in (("host", False), ("android-arm64", False), ("hexagon-npu", False),
                           ("android-adreno", True), ("android-mali", True)):
        assert ("gpu-attention" in [step for step, _ in pipeline.steps(resolve_plan(name))]) == has_step, name


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_quantized_cache_gets_all_five_kernels(name):
    """KV_FORMAT_ATTR (SmolLM2's geometry on its float32 carrier): split + RoPE + quantize, decode, ragged and paged
    prefill and the carrier's merge are ours; with a logit cap and a window, built with them."""
    shape = AttentionShape(3, 9, 64, name, 16)
    mod = _cache_module(dtype="float32", geometry=shape.declared).with_attr(KV_FORMAT_ATTR, {
        **carrier_for(name, 9, 3, 64).module_attr(), "rope_theta": 10000.0})
    swapped = ReplaceGPUAttention()(mod)
    for gv_name, build in ((DECODE, gpu_attention_decode), (RAGGED, gpu_attention_prefill_ragged),
                           (PAGED, gpu_attention_prefill_paged), (MERGE, gpu_carrier_merge_state),
                           ("tir_split_rotary", lambda s: gpu_quantized_split_rotary(s, 10000.0, 1.0, {}))):
        tvm.ir.assert_structural_equal(swapped[gv_name], _ours(build(shape), mod[gv_name]))
    # with a cap (and a window), the three attention kernels take them, as a float cache's do
    capped = ReplaceGPUAttention()(mod.with_attr(ATTN_LOGIT_CAP_ATTR, 50.0).with_attr(SLIDING_WINDOW_ATTR, 24))
    for gv_name, build in ((DECODE, gpu_attention_decode), (RAGGED, gpu_attention_prefill_ragged),
                           (PAGED, gpu_attention_prefill_paged)):
        tvm.ir.assert_structural_equal(capped[gv_name], _ours(build(shape, window=24, logit_cap=50.0), mod[gv_name]))
        assert not tvm_ffi.structural_equal(capped[gv_name], swapped[gv_name])
