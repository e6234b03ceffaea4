"""InlineLetExpressions: IR in/IR out, numerics, and the Llama-3-8B-shaped GPU build it makes possible."""

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from compiler.codegen import pipeline
from compiler.model_import.importer import import_model, open_model
from compiler.passes.inline_let_expressions import InlineLetExpressions
from compiler.target.build_plan import resolve_plan
from tests.helpers.real_shapes import write_config


@T.prim_func(private=True)
def _before(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
    for i in range(8):
        if i < 6:
            x = T.float32()
            y = T.float32()
            b[i] = T.Let(T.Let(y * x + y, where={y: x * T.float32(2)}), where={x: a[i] + T.float32(1)})


@T.prim_func(private=True)
def _expected(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
    for i in range(8):
        if i < 6:
            b[i] = (a[i] + T.float32(1)) * T.float32(2) * (a[i] + T.float32(1)) + (a[i] + T.float32(1)) * T.float32(2)


def test_lets_become_their_values():
    before = tvm.IRModule({"f": _before})
    after = InlineLetExpressions()(before)
    tvm.ir.assert_structural_equal(after["f"], _expected)
    assert "T.Let" in before.script()  # the input module is left as it was


def test_same_numbers():
    a = np.arange(8, dtype="float32") - 3
    outs = []
    for func in (_before, InlineLetExpressions()(tvm.IRModule({"f": _before}))["f"]):
        lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
        b = tvm.runtime.tensor(np.zeros(8, "float32"))
        lib["main"](tvm.runtime.tensor(a), b)
        outs.append(b.numpy())
    x = a[:6] + 1
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0][:6], 2 * x * x + 2 * x, rtol=1e-6)


@pytest.mark.parametrize("inline", [True, False])
def test_llama3_8b_shape_builds_for_adreno_only_with_it(tmp_path, monkeypatch, inline):
    """TVM's tree-attention kernel with Llama 3 RoPE (32 query heads over 8 KV heads) failed in CSE; without the
    step the build fails again, and the error is one line naming the kernel and the target."""
    if not inline:
        steps = pipeline.steps
        monkeypatch.setattr(pipeline, "steps", lambda *a, **k: [s for s in steps(*a, **k)
                                                                 if s[0] != "inline-let-expressions"])
    plan = resolve_plan("android-adreno")
    with open_model(str(write_config("llama-3-8b", tmp_path / "m")), weights_required=False) as ckpt:
        mod = import_model(ckpt, plan, None).mod
    if inline:
        pipeline.build(mod, plan)
        return
    with pytest.raises(pipeline.InternalCompilerError) as err:
        pipeline.build(mod, plan)
    message = str(err.value)
    assert "\n" not in message and "kernel batch_tree_attn" in message and "target android-adreno" in message
    assert "used before definition" in message
