"""ir_walk.relax_nodes finds what relax.analysis.post_order_visit finds (the calls, the Ifs), in its order: in a
function with a branch and a call nested in another's arguments, and in a tiny Llama's functions after every step
of its host and android-adreno pipelines."""

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from compiler.codegen import pipeline
from compiler.loaders import open_checkpoint
from compiler.model_import.importer import import_model
from compiler.passes.ir_walk import relax_nodes
from compiler.target.build_plan import resolve_plan
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint


def _post_order(expr, node_type) -> list:
    seen = []
    relax.analysis.post_order_visit(expr, lambda e: seen.append(e) if isinstance(e, node_type) else None)
    return seen


def _same(found: list, expected: list) -> bool:
    return len(found) == len(expected) and all(a.same_as(b) for a, b in zip(found, expected))


@I.ir_module(check_well_formed=False)
class _Branching:
    @R.function(pure=False)
    def main(x: R.Tensor((4,), "float32"), flag: R.Tensor((), "bool")):
        y = R.add(R.multiply(x, x), x)  # a call in another's arguments (not the normal form)
        if flag:
            z = R.exp(y)
            w = R.add(z, z)
        else:
            w = R.negative(y)
        return R.add(w, R.sqrt(y))


def test_a_branch_and_a_nested_call_in_post_order():
    func = _Branching["main"]
    calls = relax_nodes(func)
    assert [call.op.name for call in calls] == ["relax.multiply", "relax.add", "relax.exp", "relax.add",
                                                "relax.negative", "relax.sqrt", "relax.add"]
    assert _same(calls, _post_order(func, relax.Call))
    assert len(relax_nodes(func, relax.If)) == 1 and _same(relax_nodes(func, relax.If), _post_order(func, relax.If))


@pytest.mark.parametrize("target", ["host", "android-adreno"])
def test_every_step_of_a_tiny_llamas_pipeline(tmp_path, target):
    checkpoint = save_compilable_checkpoint(build_model("llama_gqa"), tmp_path / "hf")
    plan = resolve_plan(target, host_target="host" if target != "host" else None)
    with open_checkpoint(checkpoint) as ckpt:
        mod = import_model(ckpt, plan, 64).mod
    compared = []

    def compare(_index: int, step: str, stepped: tvm.IRModule) -> None:
        for gv, func in stepped.functions_items():
            if isinstance(func, relax.Function):
                for node_type in (relax.Call, relax.If):
                    assert _same(relax_nodes(func, node_type), _post_order(func, node_type)), (step, gv.name_hint)
                compared.append(len(relax_nodes(func)))

    pipeline.run_steps(mod, plan, compare)
    assert len(compared) > 20 and sum(compared) > 1000
