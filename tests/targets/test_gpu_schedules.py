"""GPU rules take their tiles from the target file: an Android Mali target gets Mali's, not Adreno's."""

import pytest
import tvm
from tvm import te, tirx
from tvm.s_tir import dlight

from compiler.schedules import gpu
from compiler.target.targets import load_target


def _nt_matmul(m):
    x = te.placeholder((1, m, 576), "float16", name="x")
    w = te.placeholder((1536, 576), "float16", name="w")
    k = te.reduce_axis((0, 576), name="k")
    out = te.compute((1, m, 1536), lambda b, i, j: te.sum(x[b, i, k] * w[j, k], axis=k), name="NT_matmul")
    return tvm.IRModule({"main": te.create_prim_func([x, w, out])})


def _scheduled(target_name, m):
    spec = load_target(target_name)
    with spec.tvm_target():
        mod = dlight.ApplyDefaultSchedule(*gpu.rules(spec.schedule))(_nt_matmul(m))
    assert mod["main"].attrs["tirx.is_scheduled"]
    return mod["main"].script()


@pytest.mark.parametrize("target,binding", [
    ("android-adreno", 'T.thread_binding(2, thread="threadIdx.x"'),  # ts = 2 rows on x
    ("android-mali", 'T.thread_binding(64, thread="threadIdx.x"'),  # tr = 64 along K on x, rows on y
])
def test_decode_gemv_tiles(target, binding):
    assert binding in _scheduled(target, 1)


@pytest.mark.parametrize("target,binding", [
    ("android-adreno", 'T.thread_binding(32, thread="threadIdx.x"'),
    ("android-mali", 'T.thread_binding(16, thread="threadIdx.x"'),
])
def test_prefill_matmul_tiles(target, binding):
    assert binding in _scheduled(target, tirx.Var("m", "int32"))
