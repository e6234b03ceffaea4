"""CPU dlight rules: each applies to its kernel (and only to it), and the scheduled kernels match numpy."""

import numpy as np
import pytest
import tvm
from tvm import relax, s_tir, tirx
from tvm.relax.backend.cpu_generic import pipeline as cp
from tvm.s_tir import dlight as dl

from compiler.passes import FuseTransposeMatmul
from compiler.schedules import cpu

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
K, N = 64, 48


def _fused_kernel(build_body, *var_types):
    """Legalize + fuse a one-kernel Relax function; return the fused PrimFunc."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"p{i}", relax.TensorType(shape, dtype)) for i, (shape, dtype) in enumerate(var_types)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(build_body(*params))
        bb.emit_func_output(out)
    with TARGET:
        mod = tvm.transform.Sequential([FuseTransposeMatmul()] + cp.legalize_passes(TARGET))(bb.get())
    (func,) = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    return func


def _linear_residual(m):
    """out = x @ w.T + r: the o_proj/down_proj kernel with its fused residual add."""
    return _fused_kernel(
        lambda x, w, r: relax.op.add(relax.op.matmul(x, relax.op.permute_dims(w)), r),
        ([1, m, K], "float32"), ([N, K], "float32"), ([1, m, N], "float32"),
    )


def _seq():
    return tirx.Var("seq_len", "int64")


def _schedule(func):
    with TARGET:
        mod = dl.ApplyDefaultSchedule(*cpu.rules())(tvm.IRModule({"main": func}))
    return mod["main"]


def _run(func, *arrays, out_shape):
    lib = tvm.tirx.build(func.with_attr("global_symbol", "main"), target=TARGET)
    out = tvm.runtime.tensor(np.zeros(out_shape, "float32"))
    lib["main"](*[tvm.runtime.tensor(a) for a in arrays], out)
    return out.numpy()


def _assert_parallel_and_vectorized(func):
    assert func.attrs["tirx.is_scheduled"]
    text = func.script()
    assert "T.parallel(" in text and "T.vectorized(" in text


def test_decode_gemv_with_residual_epilogue():
    func = _linear_residual(1)
    assert cpu.DecodeGEMV().apply(func, TARGET, False) is not None
    assert cpu.PrefillMatmul().apply(func, TARGET, False) is None
    scheduled = _schedule(func)
    _assert_parallel_and_vectorized(scheduled)
    rng = np.random.default_rng(0)
    x, w, r = (rng.standard_normal(s, dtype="float32") for s in ((1, 1, K), (N, K), (1, 1, N)))
    np.testing.assert_allclose(_run(scheduled, x, w, r, out_shape=(1, 1, N)), x @ w.T + r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [1, 7, 33])
def test_prefill_matmul_dynamic_m_with_residual_epilogue(m):
    func = _linear_residual(_seq())
    assert cpu.PrefillMatmul().apply(func, TARGET, False) is not None
    assert cpu.DecodeGEMV().apply(func, TARGET, False) is None
    scheduled = _schedule(func)
    _assert_parallel_and_vectorized(scheduled)
    rng = np.random.default_rng(m)
    x, w, r = (rng.standard_normal(s, dtype="float32") for s in ((1, m, K), (N, K), (1, m, N)))
    np.testing.assert_allclose(_run(scheduled, x, w, r, out_shape=(1, m, N)), x @ w.T + r, rtol=1e-4, atol=1e-4)


def test_matmul_rules_reject_non_nt_layout():
    """x @ w with w [K, N]: the reduction axis of w is strided, which these rules do not handle."""
    func = _fused_kernel(lambda x, w: relax.op.matmul(x, w), ([1, 1, K], "float32"), ([K, N], "float32"))
    assert cpu.DecodeGEMV().apply(func, TARGET, False) is None
    assert cpu.PrefillMatmul().apply(func, TARGET, False) is None


def test_elementwise_silu_mul_dynamic_seq():
    def body(x):
        gate, up = relax.op.split(x, 2, axis=-1)[0], relax.op.split(x, 2, axis=-1)[1]
        return relax.op.multiply(relax.op.nn.silu(gate), up)

    func = _fused_kernel(body, ([1, _seq(), 2 * K], "float32"))
    for rule in (cpu.DecodeGEMV(), cpu.PrefillMatmul()):
        assert rule.apply(func, TARGET, False) is None
    assert cpu.Elementwise().apply(func, TARGET, False) is not None
    scheduled = _schedule(func)
    _assert_parallel_and_vectorized(scheduled)
    x = np.random.default_rng(3).standard_normal((1, 5, 2 * K), dtype="float32")
    gate, up = x[..., :K], x[..., K:]
    np.testing.assert_allclose(_run(scheduled, x, out_shape=(1, 5, K)), gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-5)


def test_rms_norm_gets_a_parallel_schedule():
    func = _fused_kernel(
        lambda x, g: relax.op.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5),
        ([1, _seq(), K], "float32"), ([K], "float32"),
    )
    for rule in (cpu.DecodeGEMV(), cpu.PrefillMatmul(), cpu.Elementwise()):
        assert rule.apply(func, TARGET, False) is None
    scheduled = _schedule(func)
    _assert_parallel_and_vectorized(scheduled)
    rng = np.random.default_rng(4)
    x, g = rng.standard_normal((1, 6, K), dtype="float32"), rng.standard_normal(K, dtype="float32")
    ref = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g
    np.testing.assert_allclose(_run(scheduled, x, g, out_shape=(1, 6, K)), ref, rtol=1e-4, atol=1e-4)


def test_small_static_elementwise_stays_single_threaded():
    """A decode-sized kernel is cheaper than a parallel launch: vectorized, not parallel."""
    func = _fused_kernel(lambda a, b: relax.op.add(a, b), ([1, 1, K], "float32"), ([1, 1, K], "float32"))
    text = _schedule(func).script()
    assert "T.vectorized(" in text and "T.parallel(" not in text


def test_decode_gemv_inlines_a_dequantize_prologue():
    """Room for quantized weights: an injective producer of W (here int8 * per-group scale) is inlined."""
    group = 16
    x = tvm.te.placeholder((1, 1, K), "float32", name="x")
    wq = tvm.te.placeholder((N, K), "int8", name="wq")
    scale = tvm.te.placeholder((N, K // group), "float32", name="scale")
    w = tvm.te.compute((N, K), lambda n, k: wq[n, k].astype("float32") * scale[n, k // group], name="dequantize")
    k = tvm.te.reduce_axis((0, K), name="k")
    y = tvm.te.compute((1, 1, N), lambda b, s, n: tvm.te.sum(x[b, s, k] * w[n, k], axis=k), name="NT_matmul")
    func = tvm.te.create_prim_func([x, wq, scale, y])
    assert cpu.DecodeGEMV().apply(func, TARGET, False) is not None
    scheduled = _schedule(func)
    _assert_parallel_and_vectorized(scheduled)
    assert 'T.sblock("dequantize")' not in scheduled.script()
    rng = np.random.default_rng(5)
    xs = rng.standard_normal((1, 1, K), dtype="float32")
    qs = rng.integers(-8, 8, (N, K), dtype="int8")
    ss = rng.random((N, K // group), dtype="float32")
    ref = xs @ (qs.astype("float32") * np.repeat(ss, group, axis=1)).T
    np.testing.assert_allclose(_run(scheduled, xs, qs, ss, out_shape=(1, 1, N)), ref, rtol=1e-4, atol=1e-4)


def test_single_row_rms_norm_is_not_threaded_over_hidden():
    """Decode's rms_norm has one row: threading over the hidden axis would redo the reduction per element."""
    func = _fused_kernel(
        lambda x, g: relax.op.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5), ([1, 1, K], "float32"), ([K], "float32")
    )
    assert cpu.RowReduction().apply(func, TARGET, False) is None
    scheduled = _schedule(func)
    assert "T.parallel(" not in scheduled.script()
    rng = np.random.default_rng(6)
    x, g = rng.standard_normal((1, 1, K), dtype="float32"), rng.standard_normal(K, dtype="float32")
    ref = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g
    np.testing.assert_allclose(_run(scheduled, x, g, out_shape=(1, 1, K)), ref, rtol=1e-4, atol=1e-4)
