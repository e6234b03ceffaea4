"""The GPU decode GEMV and prefill matmul read packed weight codes as 128-bit loads (compiler/schedules/code_loads.py):
in the OpenCL source of SmolLM2-shaped dequantize + NT_matmul kernels for android-adreno and android-mali, every
read of the code buffer is a `vload16`; with the staging switched off (the schedule before it) the same check
fails. The kernels still match the CPU on PoCL (fp32; PoCL has no fp16)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import tvm
from tvm import te, tirx
from tvm.s_tir import dlight

from compiler.quantization.dequantize_te import dequantize_te
from compiler.quantization.schemes import get_scheme
from compiler.schedules import code_loads, gpu
from compiler.target.targets import load_target
from compiler.testing import pocl

TARGETS = ["android-adreno", "android-mali"]
# SmolLM2's gate_up projection (K=576 -> 1536) at 4 bits group 32, 8 bits group 128 and 4 bits group 128 (its
# qkv projection, 576 -> 960): 16, 128 and 64 code bytes per thread per GEMV step.
CASES = [("q4f16_g32", 1536, 576), ("q8f16_g128", 1536, 576), ("q4f16_g128", 960, 576)]
# K within one group (a tiny model's 64 < 128): the scales do not vary along K, and the GEMV's staging of the
# weights took the codes for them and staged those twice (an internal compiler error); too few code bytes per
# thread for 128-bit loads, so only the numerics are checked.
ONE_GROUP_K = ("q8f16_g128", 96, 64)
PREFILL = 7  # not a multiple of any tile: the padding paths run


def _dequantize_matmul(quant: str, n: int, k: int, dtype: str, seq_len) -> tirx.PrimFunc:
    """dequantize + NT_matmul as one PrimFunc, the shape FuseDequantizeMatmul gives the schedule rules."""
    layout = get_scheme(quant).layout
    layout = dataclasses.replace(layout, scale_dtype=dtype)
    stored = [te.placeholder([tirx.IntImm("int64", d) for d in shape], sdtype, name=name)
              for name, (shape, sdtype) in layout.shapes(n, k).items()]
    one, k64 = tirx.IntImm("int64", 1), tirx.IntImm("int64", k)  # int64 dimensions, as the model's
    weight = dequantize_te(layout, k64, dtype)(*stored)
    x = te.placeholder((one, seq_len, k64), dtype, name="x")
    r = te.reduce_axis((tirx.IntImm("int64", 0), k64), name="k")
    out = te.compute((one, seq_len, tirx.IntImm("int64", n)),
                     lambda b, i, j: te.sum(x[b, i, r] * weight[j, r], axis=r), name="NT_matmul")
    return te.create_prim_func([*stored, x, out])


def _scheduled(target_name: str, func: tirx.PrimFunc) -> tirx.PrimFunc:
    spec = load_target(target_name)
    with spec.tvm_target():
        mod = dlight.ApplyDefaultSchedule(*gpu.rules(spec.schedule))(tvm.IRModule({"main": func}))
    assert mod["main"].attrs["tirx.is_scheduled"]
    return mod["main"]


def _code_reads(source: str) -> tuple[int, int]:
    """(reads of the kernel's uchar code buffer, of which 128-bit vload16s) in the kernel body."""
    (codes,) = set(re.findall(r"__global uchar\* restrict (\w+)", source))
    body = source[source.index("{"):]
    return len(re.findall(rf"\b{codes}\b", body)), len(re.findall(rf"vload16\(0, {codes} \+", body))


def _seq_len(phase: str):
    return tirx.IntImm("int64", 1) if phase == "decode" else tirx.Var("seq_len", "int64")


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("quant,n,k", CASES)
@pytest.mark.parametrize("target_name", TARGETS)
def test_code_reads_are_128_bit(target_name, quant, n, k, phase):
    func = _scheduled(target_name, _dequantize_matmul(quant, n, k, "float16", _seq_len(phase)))
    source = pocl.build_opencl(func, load_target(target_name).tvm_target()).source
    reads, wide = _code_reads(source)
    assert reads > 0 and wide == reads, f"{reads} reads of the code buffer, {wide} of them vload16"


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("target_name", TARGETS)
def test_without_staging_code_reads_are_narrow(monkeypatch, target_name, phase):
    """Negative control: the schedule without the staging (as before) reads codes 1, 4 or 8 bytes at a time."""
    monkeypatch.setattr(code_loads, "stage_codes", lambda sch, block, loop: None)
    func = _scheduled(target_name, _dequantize_matmul("q4f16_g32", 1536, 576, "float16", _seq_len(phase)))
    reads, wide = _code_reads(pocl.build_opencl(func, load_target(target_name).tvm_target()).source)
    assert reads > 0 and wide == 0


def _pocl_available() -> bool:
    try:
        pocl._context()  # pylint: disable=protected-access
    except Exception:  # noqa: BLE001 - no pyopencl, no ICD, no platform: skip
        return False
    return True


@pytest.mark.skipif(not _pocl_available(), reason="PoCL missing: apt-get install pocl-opencl-icd")
@pytest.mark.parametrize("quant,n,k", [*CASES, ONE_GROUP_K])
@pytest.mark.parametrize("target_name", TARGETS)
def test_staged_kernels_match_cpu_on_pocl(target_name, quant, n, k):
    """fp32 (PoCL has no fp16): decode and a 7-token prefill against the unscheduled PrimFunc on llvm,
    within 1e-4 of the largest reference value."""
    rng = np.random.default_rng(0)
    target = load_target(target_name).tvm_target()
    for phase in ("decode", "prefill"):
        reference = _dequantize_matmul(quant, n, k, "float32", _seq_len(phase))
        scheduled = _scheduled(target_name, reference)
        bindings = {"seq_len": PREFILL}
        args = pocl.random_args(scheduled, bindings, rng)
        got = pocl.run_pocl(pocl.build_opencl(scheduled, target), args, bindings)
        err, scale = pocl.max_abs_error(got, pocl.reference_llvm(reference, args))
        assert err <= 1e-4 * scale + 1e-6, f"{phase}: max abs error {err:.3g} (max |ref| {scale:.3g})"
