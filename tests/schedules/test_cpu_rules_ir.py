"""CPU dlight rules, IR in / IR out: the decode GEMV and elementwise schedules for a fixed AVX2 target (8 float
lanes), structurally equal to the TIR written here; the numerics of scheduled kernels are in test_cpu_rules.py."""

import tvm
import tvm_ffi
from tvm.script import tirx as T

from compiler.schedules.cpu import DecodeGEMV, Elementwise, PrefillMatmul, RowReduction
from compiler.target.isa import cpu_isa

AVX2 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu", "mcpu": "x86-64-v3", "num-cores": 2})
ISA = cpu_isa(AVX2)


@T.prim_func(private=True, s_tir=True)
def gemv_before(x: T.Buffer((T.int64(1), T.int64(1), T.int64(64)), "float32"),
                w: T.Buffer((T.int64(32), T.int64(64)), "float32"),
                y: T.Buffer((T.int64(1), T.int64(1), T.int64(32)), "float32")):
    T.func_attr({"op_pattern": 4, "tirx.noalias": True})
    for i0, i1, i2, k in T.grid(T.int64(1), T.int64(1), T.int64(32), T.int64(64)):
        with T.sblock("NT_matmul"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            T.reads(x[v_i0, v_i1, v_k], w[v_i2, v_k])
            T.writes(y[v_i0, v_i1, v_i2])
            with T.init():
                y[v_i0, v_i1, v_i2] = T.float32(0.0)
            y[v_i0, v_i1, v_i2] = y[v_i0, v_i1, v_i2] + x[v_i0, v_i1, v_k] * w[v_i2, v_k]


@T.prim_func(private=True, s_tir=True)
def gemv_expected(x: T.Buffer((T.int64(1), T.int64(1), T.int64(64)), "float32"),
                  w: T.Buffer((T.int64(32), T.int64(64)), "float32"),
                  y: T.Buffer((T.int64(1), T.int64(1), T.int64(32)), "float32")):
    """Tasks of 16 rows over threads; per row a register vector of 8 partial sums along k (rfactor), then its
    horizontal sum inside the task."""
    T.func_attr({"op_pattern": 4, "tirx.noalias": True})
    y_rf_local = T.sblock_alloc_buffer((T.int64(1), T.int64(1), T.int64(32), T.int64(8)), scope="local")
    for ax0_0 in T.parallel(T.int64(2)):
        for ax0_1 in range(T.int64(16)):
            for ax1_1_0_init in T.unroll(T.int64(1)):
                for ax1_1_1_init in T.vectorized(T.int64(8)):
                    with T.sblock("NT_matmul_rf_init"):
                        vax1_1 = T.axis.spatial(T.int64(8), ax1_1_0_init * T.int64(8) + ax1_1_1_init)
                        v0 = T.axis.spatial(T.int64(32), ax0_0 * T.int64(16) + ax0_1)
                        T.reads()
                        T.writes(y_rf_local[T.int64(0), T.int64(0), v0, vax1_1])
                        y_rf_local[T.int64(0), T.int64(0), v0, vax1_1] = T.float32(0.0)
            for ax1_0 in range(T.int64(8)):
                for ax1_1_0 in T.unroll(T.int64(1)):
                    for ax1_1_1 in T.vectorized(T.int64(8)):
                        with T.sblock("NT_matmul_rf_update"):
                            vax1_1 = T.axis.spatial(T.int64(8), ax1_1_0 * T.int64(8) + ax1_1_1)
                            v0 = T.axis.spatial(T.int64(32), ax0_0 * T.int64(16) + ax0_1)
                            vax1_0 = T.axis.reduce(T.int64(8), ax1_0)
                            T.reads(y_rf_local[T.int64(0), T.int64(0), v0, vax1_1],
                                    x[T.int64(0), T.int64(0), vax1_0 * T.int64(8) + vax1_1],
                                    w[v0, vax1_0 * T.int64(8) + vax1_1])
                            T.writes(y_rf_local[T.int64(0), T.int64(0), v0, vax1_1])
                            y_rf_local[T.int64(0), T.int64(0), v0, vax1_1] = (
                                y_rf_local[T.int64(0), T.int64(0), v0, vax1_1]
                                + x[T.int64(0), T.int64(0), vax1_0 * T.int64(8) + vax1_1]
                                * w[v0, vax1_0 * T.int64(8) + vax1_1])
            for ax0 in range(T.int64(8)):
                with T.sblock("NT_matmul"):
                    vax1_1 = T.axis.reduce(T.int64(8), ax0)
                    v0 = T.axis.spatial(T.int64(32), ax0_0 * T.int64(16) + ax0_1)
                    T.reads(y_rf_local[T.int64(0), T.int64(0), v0, vax1_1])
                    T.writes(y[T.int64(0), T.int64(0), v0])
                    with T.init():
                        y[T.int64(0), T.int64(0), v0] = T.float32(0.0)
                    y[T.int64(0), T.int64(0), v0] = y[T.int64(0), T.int64(0), v0] + y_rf_local[T.int64(0), T.int64(0), v0, vax1_1]


@T.prim_func(private=True, s_tir=True)
def add_before(a: T.Buffer((T.int64(32), T.int64(576)), "float32"), b: T.Buffer((T.int64(32), T.int64(576)), "float32"),
               c: T.Buffer((T.int64(32), T.int64(576)), "float32")):
    T.func_attr({"op_pattern": 0, "tirx.noalias": True})
    for i, j in T.grid(T.int64(32), T.int64(576)):
        with T.sblock("add"):
            vi, vj = T.axis.remap("SS", [i, j])
            T.reads(a[vi, vj], b[vi, vj])
            T.writes(c[vi, vj])
            c[vi, vj] = a[vi, vj] + b[vi, vj]


@T.prim_func(private=True, s_tir=True)
def add_expected(a: T.Buffer((T.int64(32), T.int64(576)), "float32"),
                 b: T.Buffer((T.int64(32), T.int64(576)), "float32"),
                 c: T.Buffer((T.int64(32), T.int64(576)), "float32")):
    """The inner axis in vectors of 8, every other loop fused over threads (18432 elements: worth a launch)."""
    T.func_attr({"op_pattern": 0, "tirx.noalias": True})
    for ax0_ax1_0_fused in T.parallel(T.int64(2304)):
        for ax1_1 in T.vectorized(T.int64(8)):
            with T.sblock("add"):
                v0 = T.axis.spatial(T.int64(32), ax0_ax1_0_fused // T.int64(72))
                v1 = T.axis.spatial(T.int64(576), ax0_ax1_0_fused % T.int64(72) * T.int64(8) + ax1_1)
                T.reads(a[v0, v1], b[v0, v1])
                T.writes(c[v0, v1])
                c[v0, v1] = a[v0, v1] + b[v0, v1]


def _scheduled(rule, func):
    with AVX2:
        sch = rule.apply(func, AVX2, False)
    return None if sch is None else sch.mod["main"]


def test_decode_gemv():
    tvm.ir.assert_structural_equal(_scheduled(DecodeGEMV(ISA), gemv_before), gemv_expected)


def test_elementwise():
    tvm.ir.assert_structural_equal(_scheduled(Elementwise(ISA), add_before), add_expected)


def test_each_rule_takes_only_its_kernels():
    """Negative controls: the GEMV is no elementwise or prefill kernel, the add no GEMV or reduction."""
    assert _scheduled(Elementwise(ISA), gemv_before) is None and _scheduled(PrefillMatmul(ISA), gemv_before) is None
    assert _scheduled(DecodeGEMV(ISA), add_before) is None and _scheduled(RowReduction(), add_before) is None
    assert not tvm_ffi.structural_equal(_scheduled(DecodeGEMV(ISA), gemv_before), gemv_before)
