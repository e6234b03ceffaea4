"""kv_cache_kernels.parsed_once: TVM's KV-cache kernel factories answer a repeated shape from the memo, another
shape or target with its own kernel, and are TVM's own again once the block closes; a model imported twice in one
process is the same module."""

import tvm
from tvm.relax.frontend.nn.llm import kv_cache

from compiler.model_import.importer import import_model, open_model
from compiler.models import kv_cache_kernels
from compiler.target.build_plan import resolve_plan
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def test_a_repeated_shape_is_parsed_once_and_the_factories_are_restored():
    original = kv_cache._attention_decode  # pylint: disable=protected-access
    adreno = tvm.target.Target({"kind": "opencl", "device": "adreno"}, host="llvm")
    mali = tvm.target.Target({"kind": "opencl", "device": "mali"}, host="llvm")
    with kv_cache_kernels.parsed_once():
        build = kv_cache._attention_decode  # pylint: disable=protected-access
        assert build is not original
        first = build(2, 4, 16, "float16", False, {}, adreno)
        assert build(2, 4, 16, "float16", False, {}, adreno).same_as(first)
        assert not build(2, 4, 32, "float16", False, {}, adreno).same_as(first)  # another head_dim
        assert not build(2, 4, 16, "float16", False, {}, mali).same_as(first)  # another target
        assert not build(2, 4, 16, "float16", False, _LLAMA3_ROPE, adreno).same_as(first)
    assert kv_cache._attention_decode is original  # pylint: disable=protected-access


def test_a_model_imported_twice_is_the_same_module(tmp_path):
    checkpoint = save_compilable_checkpoint(build_model("llama_gqa", num_hidden_layers=1), tmp_path / "hf")
    plan = resolve_plan("host", "q0f32")
    modules = []
    for _ in range(2):
        with open_model(str(checkpoint)) as ckpt, plan.spec.tvm_target():
            modules.append(import_model(ckpt, plan, context_window=64).mod)
    tvm.ir.assert_structural_equal(modules[0], modules[1])
