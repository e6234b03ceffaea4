"""FuseAddRMSNorm: IR in/IR out, numerics against numpy, and a broadcasting add left alone."""

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from compiler.codegen import pipeline
from compiler.kernels import hvx_norms
from compiler.passes.fuse_add_rmsnorm import FuseAddRMSNorm
from compiler.target.build_plan import resolve_plan

H, EPS = 48, 1e-5


def _module(sum_used_again=True, broadcast=False):
    """main(a, b, w) = rms_norm(a + b, w) (and a + b + a, the next residual, when sum_used_again)."""
    bb = relax.BlockBuilder()
    seq = tirx.Var("seq_len", "int64")
    a = relax.Var("a", relax.TensorType([1, seq, H], "float32"))
    b = relax.Var("b", relax.TensorType([H] if broadcast else [1, seq, H], "float32"))
    w = relax.Var("w", relax.TensorType([H], "float32"))
    with bb.function("main", [a, b, w]):
        with bb.dataflow():
            s = bb.emit(relax.op.add(a, b))
            y = bb.emit(relax.op.nn.rms_norm(s, w, axes=[-1], epsilon=EPS))
            out = bb.emit_output(relax.Tuple([y, bb.emit(relax.op.add(s, a))]) if sum_used_again else y)
        bb.emit_func_output(out)
    return bb.get()


def _ops(func):
    ops = []
    relax.analysis.post_order_visit(func, lambda e: ops.append(e) if isinstance(e, relax.Call) else None)
    return ops


def _reference(a, b, w):
    s = a + b
    return s / np.sqrt((s * s).mean(-1, keepdims=True) + EPS) * w, s


def test_one_kernel_writes_sum_and_norm():
    mod = FuseAddRMSNorm()(_module())
    calls = _ops(mod["main"])
    names = [c.op.name for c in calls if isinstance(c.op, tvm.ir.Op)]
    assert "relax.nn.rms_norm" not in names and names.count("relax.add") == 1  # only the next residual add is left
    (kernel,) = [c for c in calls if c.op.name == "relax.call_tir"]
    assert kernel.args[0].name_hint.startswith("add_rms_norm") and len(kernel.ty.fields) == 2  # sum, norm
    func = mod[kernel.args[0]]
    assert func.attrs["tirx.is_scheduled"] and int(func.attrs["op_pattern"]) == 8


def test_without_other_readers_only_the_norm_is_written():
    mod = FuseAddRMSNorm()(_module(sum_used_again=False))
    (kernel,) = [c for c in _ops(mod["main"]) if c.op.name == "relax.call_tir"]
    assert isinstance(kernel.ty, relax.TensorType)
    assert not [c for c in _ops(mod["main"]) if c.op.name == "relax.add"]


def test_numerics_match_numpy():
    vm = relax.VirtualMachine(pipeline.build(_module(), resolve_plan("host")), tvm.cpu())
    rng = np.random.default_rng(0)
    w = rng.standard_normal(H).astype("float32")
    for seq in (1, 6):
        a, b = (rng.standard_normal((1, seq, H)).astype("float32") for _ in range(2))
        y, nxt = vm["main"](*(tvm.runtime.tensor(v) for v in (a, b, w)))
        want_y, want_s = _reference(a, b, w)
        np.testing.assert_allclose(y.numpy(), want_y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(nxt.numpy(), want_s + a, rtol=1e-6, atol=1e-6)


def test_broadcasting_add_is_left_alone():
    mod = FuseAddRMSNorm()(_module(broadcast=True))
    names = [c.op.name for c in _ops(mod["main"]) if isinstance(c.op, tvm.ir.Op)]
    assert "relax.nn.rms_norm" in names and "relax.call_tir" not in names


@I.ir_module(check_well_formed=False)
class _ExpectedMain:
    """One add_rms_norm call returns (a + b, rms_norm(a + b)): the sum feeds the next residual add. The kernel is a
    stand-in (its numerics are tested above)."""

    @T.prim_func(private=True)
    def add_rms_norm(a: T.handle):
        T.evaluate(0)

    @R.function
    def main(a: R.Tensor((1, "seq_len", 48), dtype="float32"), b: R.Tensor((1, "seq_len", 48), dtype="float32"),
             w: R.Tensor((48,), dtype="float32")) -> R.Tuple(R.Tensor((1, "seq_len", 48), dtype="float32"),
                                                           R.Tensor((1, "seq_len", 48), dtype="float32")):
        seq_len = T.int64()
        cls = _ExpectedMain
        with R.dataflow():
            fused = R.call_tir(cls.add_rms_norm, (a, b, w), out_ty=[R.Tensor((1, seq_len, 48), dtype="float32"),
                                                                     R.Tensor((1, seq_len, 48), dtype="float32")])
            total: R.Tensor((1, seq_len, 48), dtype="float32") = fused[0]
            normed: R.Tensor((1, seq_len, 48), dtype="float32") = fused[1]
            residual: R.Tensor((1, seq_len, 48), dtype="float32") = R.add(total, a)
            gv: R.Tuple(R.Tensor((1, seq_len, 48), dtype="float32"),
                        R.Tensor((1, seq_len, 48), dtype="float32")) = normed, residual
            R.output(gv)
        return gv


def test_ir_in_ir_out():
    mod = FuseAddRMSNorm()(_module())
    # map_free_vars: the callee's GlobalVar is matched by position; its name is checked on its own
    tvm.ir.assert_structural_equal(mod["main"], _ExpectedMain["main"], map_free_vars=True)
    assert sorted(gv.name_hint for gv in mod.get_global_vars()) == ["add_rms_norm", "main"]
    # negative control: a broadcasting add is left as it was
    tvm.ir.assert_structural_equal(FuseAddRMSNorm()(_module(broadcast=True)), _module(broadcast=True))


def test_hvx_calls_the_c_kernel():
    """hexagon, float32 (BuildPlan.hvx_norms): the same rewrite, its kernel the call into hvx_norms.c that
    kernels/hvx_norms.py builds, with both outputs listed as written; without other readers of the sum, the
    one-output form."""
    for sum_used_again in (True, False):
        mod = FuseAddRMSNorm(hvx=True)(_module(sum_used_again=sum_used_again))
        (kernel,) = [c for c in _ops(mod["main"]) if c.op.name == "relax.call_tir"]
        func = mod[kernel.args[0]]
        expected = hvx_norms.tir_add_rms_norm((1, tirx.Var("seq_len", "int64"), H), EPS, sum_used_again)
        tvm.ir.assert_structural_equal(func.without_attr("op_pattern").without_attr("global_symbol"),
                                       expected.without_attr("global_symbol"), map_free_vars=True)
        assert kernel.args[0].name_hint.startswith("hvx_add_rms_norm") and int(func.attrs["op_pattern"]) == 8
        assert not [c for c in _ops(mod["main"]) if c.op.name == "relax.nn.rms_norm"]
