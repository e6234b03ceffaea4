"""VerifyDeviceLimits: a kernel over a target's limits fails the compile naming the kernel and the limit."""

import pytest
import tvm
from tvm import relax, s_tir, te

from compiler.codegen import pipeline
from compiler.errors import MobilecError
from compiler.passes.verify_device_limits import VerifyDeviceLimits
from compiler.target.build_plan import resolve_plan
from compiler.target.targets import TARGETS_DIR


def _module(threads: int, n_inputs: int = 1):
    """A Relax function calling one GPU kernel with `threads` threads per group and `n_inputs` arguments."""
    inputs = [te.placeholder((4096,), "float32", name=f"x{i}") for i in range(n_inputs)]
    out = te.compute((4096,), lambda i: sum(x[i] for x in inputs), name="out")
    sch = s_tir.Schedule(te.create_prim_func([*inputs, out]).with_attr("global_symbol", "wide_kernel"))
    bx, tx = sch.split(sch.get_loops(sch.get_sblock("out"))[0], [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType((4096,), "float32")) for i in range(n_inputs)]
    with bb.function("main", params):
        gv = bb.add_func(sch.mod["main"].with_attr("tirx.is_scheduled", True), "wide_kernel")
        with bb.dataflow():
            y = bb.emit_output(relax.call_tir(gv, params, relax.TensorType((4096,), "float32")))
        bb.emit_func_output(y)
    return bb.get()


def _tiny(tmp_path, **limits):
    text = (TARGETS_DIR / "android-adreno.toml").read_text()
    for key, value in limits.items():
        text = text.replace(next(line for line in text.splitlines() if line.startswith(key)), f"{key} = {value}")
    path = tmp_path / "tiny.toml"
    path.write_text(text)
    return resolve_plan(str(path))


def test_within_limits_builds():
    pipeline.build(_module(256), resolve_plan("android-adreno"))


def test_too_many_threads(tmp_path):
    with pytest.raises(MobilecError, match="kernel wide_kernel_kernel uses 256 threads per work group.*allows 64"):
        pipeline.build(_module(256), _tiny(tmp_path, max_threads_per_group=64))


def test_too_many_arguments(tmp_path):
    with pytest.raises(MobilecError, match="wide_kernel_kernel uses 9 kernel arguments.*allows 8"):
        pipeline.build(_module(64, n_inputs=8), _tiny(tmp_path, max_kernel_args=8))


def test_too_much_local_memory(tmp_path):
    """A cross-thread reduction keeps its partial sums in local memory; 16 bytes is not enough for 64 floats."""
    x = te.placeholder((64, 256), "float32", name="x")
    k = te.reduce_axis((0, 256), name="k")
    out = te.compute((64,), lambda i: te.sum(x[i, k], axis=k), name="out")
    sch = s_tir.Schedule(te.create_prim_func([x, out]).with_attr("global_symbol", "row_sum"))
    i, k = sch.get_loops(sch.get_sblock("out"))
    _, ki = sch.split(k, [None, 64])
    sch.bind(i, "blockIdx.x")
    sch.bind(ki, "threadIdx.x")
    spec = _tiny(tmp_path, local_memory_bytes=16).spec
    mod = tvm.IRModule({"row_sum": sch.mod["main"]})
    with pytest.raises(MobilecError, match="row_sum_kernel uses .* bytes of local memory.*allows 16"):
        with tvm.transform.PassContext(instruments=[pipeline._CheckKernels(spec)]):  # pylint: disable=protected-access
            tvm.tirx.build(mod, target=spec.tvm_target())


def test_largest_single_buffer():
    """A 2 GiB parameter on a target whose largest allocation is 1 GiB."""
    x = relax.Var("w", relax.TensorType((1 << 29,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        bb.emit_func_output(x)
    with pytest.raises(MobilecError, match="parameter w takes 2.00 GiB.*max_alloc_gb = 1"):
        VerifyDeviceLimits(1.0)(bb.get())
