"""FuseSwiGLU: FuseOps alone already makes one kernel but copies both halves into scratch buffers; the pass
leaves one block with no scratch. IR in/IR out, numerics against numpy, and a split read elsewhere left alone."""

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from compiler.codegen import pipeline
from compiler.kernels import hvx_norms
from compiler.passes.fuse_swiglu import FuseSwiGLU
from compiler.target.build_plan import resolve_plan
from compiler.target.targets import load_target

INTER = 40


def _module(up_used_again=False):
    """main(x[1, seq, 2I]) = silu(x[..., :I]) * x[..., I:], as LlamaMLP emits it."""
    bb = relax.BlockBuilder()
    seq = tirx.Var("seq_len", "int64")
    x = relax.Var("x", relax.TensorType([1, seq, 2 * INTER], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(x, 2, axis=-1))
            gate, up = bb.emit(relax.TupleGetItem(parts, 0)), bb.emit(relax.TupleGetItem(parts, 1))
            y = bb.emit(relax.op.multiply(bb.emit(relax.op.nn.silu(gate)), up))
            out = bb.emit_output(relax.Tuple([y, up]) if up_used_again else y)
        bb.emit_func_output(out)
    return bb.get()


def _fuse_ops(mod):
    with load_target("host").tvm_target():
        return tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                         relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)


def _kernel(mod):
    (gv,) = [gv for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert mod["main"].script().count("R.call_tir(") == 1
    return mod[gv]


def _scratch_buffers(func):
    """alloc_buffers of the root block: intermediate tensors the kernel materializes."""
    return list(func.body.block.alloc_buffers)


def test_fuse_ops_alone_materializes_the_split():
    assert len(_scratch_buffers(_kernel(_fuse_ops(_module())))) >= 2


def test_one_kernel_no_split_copies():
    mod = FuseSwiGLU()(_module())
    text = mod["main"].script()
    assert "R.split" not in text and "R.nn.silu" not in text and "R.multiply" not in text
    kernel = _kernel(_fuse_ops(mod))
    assert _scratch_buffers(kernel) == []


def test_numerics_match_numpy():
    vm = relax.VirtualMachine(pipeline.build(_module(), resolve_plan("host")), tvm.cpu())
    rng = np.random.default_rng(0)
    for seq in (1, 5):
        x = rng.standard_normal((1, seq, 2 * INTER)).astype("float32")
        g, u = x[..., :INTER], x[..., INTER:]
        got = vm["main"](tvm.runtime.tensor(x)).numpy()
        np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)


def test_half_read_elsewhere_is_left_alone():
    mod = FuseSwiGLU()(_module(up_used_again=True))
    assert "R.split" in mod["main"].script() and "swiglu" not in mod.script()


@I.ir_module
class _Expected:
    """silu(x[..., :40]) * x[..., 40:] as one injective kernel reading x twice, no split."""

    @T.prim_func(private=True, s_tir=True)
    def swiglu(var_x: T.handle, var_out: T.handle):
        T.func_attr({"op_pattern": 2, "tirx.noalias": True})
        seq_len = T.int64()
        x = T.match_buffer(var_x, (T.int64(1), seq_len, T.int64(80)))
        out = T.match_buffer(var_out, (T.int64(1), seq_len, T.int64(40)))
        for i0, i1, i2 in T.grid(T.int64(1), seq_len, T.int64(40)):
            with T.sblock("swiglu"):
                v_i0, v_i1, v_i2 = T.axis.remap("SSS", [i0, i1, i2])
                T.reads(x[v_i0, v_i1, v_i2:v_i2 + T.int64(41)])
                T.writes(out[v_i0, v_i1, v_i2])
                out[v_i0, v_i1, v_i2] = (x[v_i0, v_i1, v_i2] * T.sigmoid(x[v_i0, v_i1, v_i2])
                                         * x[v_i0, v_i1, v_i2 + T.int64(40)])

    @R.function
    def main(x: R.Tensor((1, "seq_len", 80), dtype="float32")) -> R.Tensor((1, "seq_len", 40), dtype="float32"):
        seq_len = T.int64()
        cls = _Expected
        with R.dataflow():
            lv = R.call_tir(cls.swiglu, (x,), out_ty=R.Tensor((1, seq_len, 40), dtype="float32"))
            gv: R.Tensor((1, seq_len, 40), dtype="float32") = lv
            R.output(gv)
        return gv


def test_ir_in_ir_out():
    tvm.ir.assert_structural_equal(FuseSwiGLU()(_module()), _Expected)
    # negative control: with the up half read elsewhere the chain stays as it was
    tvm.ir.assert_structural_equal(FuseSwiGLU()(_module(up_used_again=True)), _module(up_used_again=True))


def test_hvx_calls_the_c_kernel():
    """hexagon, float32 (BuildPlan.hvx_norms): the chain becomes the call into hvx_norms.c that kernels/hvx_norms.py
    builds (x [1, seq, 2I] -> [1, seq, I])."""
    mod = FuseSwiGLU(hvx=True)(_module())
    text = mod["main"].script()
    assert "R.split" not in text and "R.nn.silu" not in text and "R.multiply" not in text
    func = _kernel(mod)
    expected = hvx_norms.tir_swiglu((1, tirx.Var("seq_len", "int64"), 2 * INTER))
    tvm.ir.assert_structural_equal(func.without_attr("op_pattern").without_attr("global_symbol"),
                                   expected.without_attr("global_symbol"), map_free_vars=True)


def test_cpu_sigmoid_is_arithmetic():
    """CPU targets (arithmetic_sigmoid): no sigmoid intrinsic, whose vector exp LLVM's CPU code turns into a libm
    expf call per lane; GPU targets keep it (negative control)."""
    assert "T.sigmoid" not in FuseSwiGLU(arithmetic_sigmoid=True)(_module()).script()
    assert "T.sigmoid" in FuseSwiGLU()(_module()).script()


def test_arithmetic_sigmoid_numerics_over_its_range():
    """The host build (arithmetic sigmoid) against numpy from where e^-x overflows to where it underflows."""
    vm = relax.VirtualMachine(pipeline.build(_module(), resolve_plan("host")), tvm.cpu())
    g = np.concatenate([np.linspace(-100, 100, INTER // 2), np.linspace(-4, 4, INTER // 2)]).astype("float32")
    x = np.concatenate([g, np.full(INTER, 1.5, "float32")]).reshape(1, 1, 2 * INTER)
    got = vm["main"](tvm.runtime.tensor(x)).numpy().reshape(-1)
    expected = (g.astype("float64") / (1 + np.exp(-g.astype("float64"))) * 1.5).astype("float32")
    np.testing.assert_allclose(got, expected, rtol=2e-7 * 8, atol=1e-30)
