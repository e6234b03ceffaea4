"""FuseTransposeMatmul: IR in/IR out and numerics against numpy."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.backend.cpu_generic import pipeline as cp
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from compiler.passes.fuse_transpose_matmul import FuseTransposeMatmul

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})


def _linear_module(k=16, n=8, bias=True):
    """main(x[1, seq_len, k], w[n, k], b[n]) = x @ w.T (+ b), written the way nn.Linear emits it."""
    bb = relax.BlockBuilder()
    seq = tirx.Var("seq_len", "int64")
    x = relax.Var("x", relax.TensorType([1, seq, k], "float32"))
    w = relax.Var("w", relax.TensorType([n, k], "float32"))
    b = relax.Var("b", relax.TensorType([n], "float32"))
    with bb.function("main", [x, w, b] if bias else [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
            if bias:
                y = bb.emit(relax.op.add(y, b))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _prim_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def _build(mod):
    with TARGET:
        mod = tvm.transform.Sequential(cp.legalize_passes(TARGET) + cp.dataflow_lower_passes(TARGET) + cp.finalize_passes(TARGET))(mod)
    return relax.VirtualMachine(tvm.compile(mod, target=TARGET, relax_pipeline=None), tvm.cpu())


def test_rewrites_to_one_nt_matmul_call():
    mod = FuseTransposeMatmul()(_linear_module())
    text = mod.script()
    assert "permute_dims" not in text and "R.matmul" not in text
    assert text.count("R.call_tir(cls.NT_matmul,") == 1
    nt = _prim_funcs(mod)["NT_matmul"]
    assert int(nt.attrs["op_pattern"]) == 4  # kOutEWiseFusable: FuseOps may fuse epilogues into it
    assert len(nt.params) == 3  # x, w, out: no transposed copy of w


def test_bias_epilogue_fuses_and_matches_numpy():
    mod = FuseTransposeMatmul()(_linear_module())
    with TARGET:
        fused = tvm.transform.Sequential(cp.legalize_passes(TARGET))(mod)
    assert fused["main"].script().count("R.call_tir(") == 1
    assert any("NT_matmul" in name and "add" in name for name in _prim_funcs(fused))
    vm = _build(mod)
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((8, 16), "float32"), rng.standard_normal(8, dtype="float32")
    for seq in (1, 5):  # dynamic seq_len: decode and prefill shapes from one function
        x = rng.standard_normal((1, seq, 16), "float32")
        out = vm["main"](*[tvm.runtime.tensor(a) for a in (x, w, b)]).numpy()
        np.testing.assert_allclose(out, x @ w.T + b, rtol=1e-5, atol=1e-5)


def test_without_bias_matches_numpy():
    vm = _build(FuseTransposeMatmul()(_linear_module(k=24, n=40, bias=False)))
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((1, 3, 24), "float32"), rng.standard_normal((40, 24), "float32")
    out = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "x_shape, w_shape, axes",
    [([2, 3, 8], [2, 6, 8], [0, 2, 1]),  # batched 3-D weight
     ([3, 8], [8, 6], [0, 1])],  # identity permutation: not a transpose
)
def test_other_permutations_are_left_alone(x_shape, w_shape, axes):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    w = relax.Var("w", relax.TensorType(w_shape, "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w, axes)))
        bb.emit_func_output(out)
    before = bb.get()
    after = FuseTransposeMatmul()(before)
    tvm.ir.assert_structural_equal(after, before)


@I.ir_module
class _ExpectedNoBias:
    """x @ permute_dims(w) as one NT_matmul: W read row-major along k, no transposed copy."""

    @T.prim_func(private=True, s_tir=True)
    def NT_matmul(var_x: T.handle, w: T.Buffer((T.int64(8), T.int64(16)), "float32"), var_out: T.handle):
        T.func_attr({"op_pattern": 4, "tirx.noalias": True})
        seq_len = T.int64()
        x = T.match_buffer(var_x, (T.int64(1), seq_len, T.int64(16)))
        out = T.match_buffer(var_out, (T.int64(1), seq_len, T.int64(8)))
        for i0, i1, i2, k in T.grid(T.int64(1), seq_len, T.int64(8), T.int64(16)):
            with T.sblock("NT_matmul"):
                v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
                T.reads(x[v_i0, v_i1, v_k], w[v_i2, v_k])
                T.writes(out[v_i0, v_i1, v_i2])
                with T.init():
                    out[v_i0, v_i1, v_i2] = T.float32(0.0)
                out[v_i0, v_i1, v_i2] = out[v_i0, v_i1, v_i2] + x[v_i0, v_i1, v_k] * w[v_i2, v_k]

    @R.function
    def main(x: R.Tensor((1, "seq_len", 16), dtype="float32"),
             w: R.Tensor((8, 16), dtype="float32")) -> R.Tensor((1, "seq_len", 8), dtype="float32"):
        seq_len = T.int64()
        cls = _ExpectedNoBias
        with R.dataflow():
            lv = R.call_tir(cls.NT_matmul, (x, w), out_ty=R.Tensor((1, seq_len, 8), dtype="float32"))
            gv: R.Tensor((1, seq_len, 8), dtype="float32") = lv
            R.output(gv)
        return gv


def test_ir_in_ir_out():
    tvm.ir.assert_structural_equal(FuseTransposeMatmul()(_linear_module(bias=False)), _ExpectedNoBias)
    # negative control: the module before the pass is not the expected one
    assert not tvm_ffi.structural_equal(_linear_module(bias=False), _ExpectedNoBias)


def _half_module(logits: bool):
    """main(x[1, 1, 16], w[8, 16]) = x @ w.T in float16 (cast to float32 after, as the logits are, with `logits`)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 1, 16], "float16"))
    w = relax.Var("w", relax.TensorType([8, 16], "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
            if logits:
                y = bb.emit(relax.op.astype(y, "float32"))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _bound_calls(mod):
    calls = []
    relax.analysis.post_order_visit(mod["main"], lambda e: calls.append(e) if isinstance(e, relax.Call) else None)
    return [(c.op.name, str(c.ty.dtype)) for c in calls if isinstance(c.op, tvm.ir.Op)]


@pytest.mark.parametrize("logits", [False, True])
def test_float16_products_are_summed_in_float32(logits):
    """The NT_matmul sums in float32 and is cast to float16 for its readers; a cast straight back to float32 (the
    logits) reads the float32 sum instead (no rounding to float16 in between)."""
    mod = FuseTransposeMatmul()(_half_module(logits))
    (nt,) = _prim_funcs(mod).values()
    assert [str(p.dtype) for p in nt.params] == ["float16", "float16", "float32"]
    calls = _bound_calls(mod)
    assert ("relax.astype", "float32") not in calls
    assert (("relax.astype", "float16") in calls) != logits
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, 16)).astype("float16")
    w = rng.standard_normal((8, 16)).astype("float16")
    got = _build(mod)["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    assert got.dtype == (np.float32 if logits else np.float16)
    # float32 sums of exact float16 products: the float32 result is that sum to float32's precision
    np.testing.assert_allclose(got, want, rtol=1e-6 if logits else 2 ** -11, atol=1e-6)
