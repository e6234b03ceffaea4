"""IntegerDotGEMM: which matmuls it rewrites (many rows, tagged dequantize, aarch64 with i8mm or dotprod, int8 decode
activations), the IR it leaves, and the instructions of the compiled libraries of the ARM target files (built and
disassembled here, never run; their numerics: tests/kernels/test_integer_dot_gemm.py on the emulated device)."""

import re
import shutil
import subprocess
import tarfile

import pytest

from compiler.codegen import pipeline
from compiler.kernels import integer_dot_gemm
from compiler.passes.fuse_transpose_matmul import FuseTransposeMatmul
from compiler.passes.integer_dot_gemm import IntegerDotGEMM
from compiler.passes.integer_dot_gemv import IntegerDotGEMV
from compiler.target.build_plan import resolve_plan
from compiler.target.targets import load_target
from tests.passes.test_integer_dot_gemv import _callees, _module

OBJDUMP = "llvm-objdump-15"


def _rewrite(target_name: str, code_order="neon_pairs"):
    """The pipeline's two integer-dot steps on the test module, its 4-bit codes in `code_order` (ARM targets store
    the neon_pairs one)."""
    plan = resolve_plan(target_name, decode_activations="int8")
    mod = IntegerDotGEMV(8, plan.gemv_family)(FuseTransposeMatmul()(_module(code_order=code_order)))
    return IntegerDotGEMM(plan.gemm_family)(mod)


@pytest.mark.parametrize("target,family", [("linux-arm64", "dotprod"), ("android-arm64", "i8mm")])
def test_prefill_matmul_becomes_row_quantize_plus_integer_gemm(target, family):
    mod = _rewrite(target)
    prefill = [c for c in _callees(mod["prefill"]) if not c.startswith("add")]
    assert prefill == ["quantize_rows_k128_sym4_" + family,
                       f"integer_dot_gemm_int4_g32_sym_float16_{family}_neonpairs_n48_k128"]
    # panels of 8 rows of the symbolic row count: int8 codes and one scale per lane
    script = mod["prefill"].script()
    assert 'R.Tensor(((seq_len + 8 - 1) // 8, 1024), dtype="int8")' in script, script
    gemm = next(f for gv, f in mod.functions_items() if gv.name_hint.startswith("integer_dot_gemm"))
    assert int(gemm.attrs["op_pattern"]) == 8 and gemm.attrs["tirx.is_scheduled"]
    # decode keeps its GEMV
    assert any(c.startswith("integer_dot_gemv") for c in _callees(mod["decode"]))
    # plain 4-bit codes (which ARM targets do not store) stay with the dequantize path
    assert "dequantize" in _callees(_rewrite(target, "plain")["prefill"])


def test_pipeline_has_the_step_only_with_int8_decode_activations():
    """Numerics change against the float prefill (int8 activations, llama.cpp's rounding), so the GEMM comes with
    `--decode-activations int8`, on aarch64 targets with i8mm or dotprod only; int8 is the ARM target files' default
    (device.decode_activations), not the others'; a target without integer decode GEMVs (a GPU) refuses int8
    (tests/test_build_plan.py)."""
    host = integer_dot_gemm.family(resolve_plan("host").isa) is not None
    for name, int8_step, default in (("linux-arm64", True, "int8"), ("android-arm64", True, "int8"),
                                     ("x86-64-v3", False, "int16"), ("android-adreno", False, "int16"),
                                     ("host", host, "int16")):
        assert load_target(name).decode_activations == default

        def steps(activations, target=name):
            return [s for s, _ in pipeline.steps(resolve_plan(target, decode_activations=activations))]

        if resolve_plan(name).integer_decode:
            assert ("integer-dot-gemm" in steps("int8")) == int8_step
        assert "integer-dot-gemm" not in steps("int16")
        assert ("integer-dot-gemm" in steps(None)) == (int8_step and default == "int8")


def _disassembly(target_name: str, decode_activations: str, folder) -> str:
    """The library the pipeline builds for `target_name`, as object files (no link), disassembled."""
    executable = pipeline.build(_module(code_order="neon_pairs"),
                                resolve_plan(target_name, decode_activations=decode_activations))
    path = folder / f"{target_name}-{decode_activations}.tar"
    executable.export_library(str(path))
    out = folder / path.stem
    with tarfile.open(path) as tar:
        tar.extractall(out, filter="data")
    return "\n".join(subprocess.run([OBJDUMP, "-d", "--no-show-raw-insn", "--mattr=+dotprod,+i8mm", str(obj)],
                                    capture_output=True, text=True, check=True).stdout for obj in out.rglob("*.o"))


@pytest.mark.skipif(shutil.which(OBJDUMP) is None, reason=f"{OBJDUMP} not installed (Debian: llvm-15)")
@pytest.mark.parametrize("target,instruction", [
    ("android-arm64", r"\bsmmla\s+v\d+\.4s, v\d+\.16b, v\d+\.16b"),
    ("linux-arm64", r"\bsdot\s+v\d+\.4s, v\d+\.16b, v\d+\.4b\[\d\]"),  # by element: the GEMV's sdots are not
])
def test_target_libraries_have_the_gemm_instruction(tmp_path, target, instruction):
    """android-arm64 (i8mm): the prefill GEMM is smmla; linux-arm64 (dotprod): sdot by element. Without int8
    activations the prefill stays float: neither instruction is in the library."""
    assert re.search(instruction, _disassembly(target, "int8", tmp_path))
    assert not re.search(instruction, _disassembly(target, "int16", tmp_path))
