"""VerifyAlignment: a compiled model passes, and at run time every tensor its kernels get is 64-byte aligned;
a buffer declaring data_alignment=4 and a tensor placed at byte offset 32 are caught, naming what and where."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import tirx as T

from compiler.artifacts.artifact import load_artifact
from compiler.codegen import pipeline
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.errors import MobilecError
from compiler.passes.verify_alignment import VerifyAlignment
from compiler.runtime.session import Session
from compiler.target.build_plan import resolve_plan
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint


def _kernel_module(align: int) -> tvm.IRModule:
    @T.prim_func(s_tir=True)
    def add_one(a: T.Buffer((16,), "float32", align=align), b: T.Buffer((16,), "float32")):
        for i in range(16):
            with T.sblock("add_one"):
                vi = T.axis.remap("S", [i])
                b[vi] = a[vi] + T.float32(1)

    return tvm.IRModule({"add_one": add_one})


def _placement_module(offset: int) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    with bb.function("main", []):
        storage = bb.emit(relax.op.memory.alloc_storage(relax.ShapeExpr([256]), 0, "global", "uint8"))
        out = bb.emit(relax.op.memory.alloc_tensor(storage, relax.prim_value(offset), relax.ShapeExpr([16]), "float32"))
        bb.emit_func_output(out)
    return bb.get()


def test_aligned_kernel_and_placement_pass():
    for mod in (_kernel_module(64), _placement_module(64)):
        assert VerifyAlignment()(mod).same_as(mod)


def test_misaligned_buffer_is_named():
    with pytest.raises(MobilecError, match=r"buffer a of kernel add_one declares data_alignment=4"):
        VerifyAlignment()(_kernel_module(4))


def test_misaligned_offset_is_named():
    with pytest.raises(MobilecError, match=r"relax.memory.alloc_tensor in function main .* byte offset 32"):
        VerifyAlignment()(_placement_module(32))


@pytest.mark.slow  # a compile and a run: ~25 s
def test_compiled_tiny_model_tensors_are_aligned_at_run_time(tmp_path):
    """The pipeline ends with VerifyAlignment; then every tensor a decode step hands a kernel is 64-byte aligned."""
    assert pipeline.steps(resolve_plan("host"))[-1][0] == "verify-alignment"
    save_compilable_checkpoint(build_model("llama_gqa"), tmp_path / "hf")
    compile_model(CompileOptions(str(tmp_path / "hf"), "host", "q4f16_g32", str(tmp_path / "art"), context_window=64,
                                 progress=False))
    session = Session(load_artifact(tmp_path / "art"))
    session.reset()
    session.prefill_all_logits([3, 7, 1, 4])
    addresses = []

    def record(_func, _name, before_run, _ret, *args):
        if before_run:
            # from_dlpack sees data + byte_offset, the address a kernel actually reads.
            addresses.extend(np.from_dlpack(a).ctypes.data for a in args if isinstance(a, tvm.runtime.Tensor))

    session.vm.set_instrument(record)
    session.decode(5)
    assert len(addresses) > 20 and all(addr % 64 == 0 for addr in addresses)
