"""Every NPU kernel of a `hexagon-npu` artifact, executed on the emulated DSP: the artifact's lib/hexagon/kernels.o,
built for emulation, linked into the kernel server (compiler/testing/emulated_hexagon.py) and called with random
inputs, against the same kernel built for this machine's CPU by TVM, and a decode GEMV against numpy. The artifact
has int16 decode activations, so its matmuls are TVM's kernels too (with int8, the target's default, they are
call_externs into native/hexagon/hvx_gemv.c, which no x86 build links: tests/kernels/test_hvx_gemv.py checks those).
Its residual norms and SwiGLU (float32) are call_externs into native/hexagon/hvx_norms.c, which no x86 build links
either: tests/kernels/test_hvx_norms.py checks those against numpy, and they are left out here.

QEMU runs no HVX float instruction, and for v73 LLVM vectorizes some float16 conversions and adds into qf32/hf HVX
(3 of the tiny Llama's 19 kernels); the emulation build (emulated_hexagon.emulation_spec) turns HVX float off, so
every kernel must run."""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
import tvm

from compiler.codegen import hexagon
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.errors import MobilecError
from compiler.quantization.group import GroupLayout, dequantize
from compiler.target.targets import load_target
from compiler.testing import emulated_hexagon
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

pytestmark = pytest.mark.skipif(not emulated_hexagon.ready(), reason="scripts/fetch_qemu_hexagon.sh installs it")
SEQ_LEN = 3  # the value of the kernels' symbolic sequence length
REGION_BYTES = 4 << 20
# HVX float in llvm-objdump's v69 listing: qf32 / qf16 values, sf / hf vectors, and what it cannot decode (v73's
# float conversions are among those)
HVX_FLOAT = re.compile(r"qf32|qf16|\.sf\b|\.hf\b|<unknown>")


@pytest.fixture(scope="module")
def npu(tmp_path_factory):
    """(the NPU kernels' TIR, the kernel server with the artifact's kernels.o built for emulation, its kernels with
    HVX float)."""
    root = tmp_path_factory.mktemp("npu")
    checkpoint = save_compilable_checkpoint(build_model("llama_gqa"), root / "hf")
    lowered = {}
    build_kernels = hexagon.build_kernels

    def keep_lowered(mod, spec, lib_dir):
        lowered["mod"] = mod
        return build_kernels(mod, emulated_hexagon.emulation_spec(spec), lib_dir)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hexagon, "build_kernels", keep_lowered)
        compile_model(CompileOptions(str(checkpoint), "hexagon-npu", "q4f16_g32", str(root / "out"),
                                     context_window=128, progress=False, decode_activations="int16"))
    kernels, _ = hexagon.partition(lowered["mod"])
    obj = root / "out" / "lib" / hexagon.OBJECT
    listing = subprocess.run([emulated_hexagon.llvm_tool("llvm-objdump"), "-d", "--no-show-raw-insn", "--mcpu=hexagonv69",
                              "--mattr=+hvxv69,+hvx-length128b,+hvx-qfloat,+hvx-ieee-fp", str(obj)],
                             capture_output=True, text=True, check=True).stdout
    with_float = {m.group(1).removesuffix("_compute_")
                  for m in re.finditer(r"^[0-9a-f]+ <([^>]+)>:\n((?:.+\n)*)", listing, flags=re.MULTILINE)
                  if HVX_FLOAT.search(m.group(2))}
    return kernels, emulated_hexagon.build_device(root, (obj,)), with_float


def _inputs(func: tvm.tirx.PrimFunc, rng) -> list[np.ndarray]:
    arrays = []
    for param in func.params:
        shape = [int(s) if isinstance(s, tvm.tirx.IntImm) else SEQ_LEN for s in param.shape]
        dtype = np.dtype(str(param.dtype))
        arrays.append(rng.standard_normal(shape).astype(dtype) if dtype.kind == "f"
                      else rng.integers(0, 256, shape).astype(dtype))  # codes; token ids below the vocabulary
    return arrays


def _on_device(program, name: str, arrays: list[np.ndarray]) -> list[np.ndarray]:
    with emulated_hexagon.Device(program, REGION_BYTES) as device:
        placed = [device.array(a.shape, a.dtype) for a in arrays]
        for dst, src in zip(placed, arrays):
            dst[...] = src
        device.call(name, *placed)
        return [p.copy() for p in placed]


def _on_host(func: tvm.tirx.PrimFunc, arrays: list[np.ndarray]) -> list[np.ndarray]:
    built = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    tensors = [tvm.runtime.tensor(a) for a in arrays]
    built["main"](*tensors)
    return [t.numpy() for t in tensors]


def test_every_npu_kernel_against_the_host_build(npu):
    kernels, program, with_float = npu
    assert not with_float, "the emulation build should hold no HVX float instruction, which QEMU cannot run"
    rng = np.random.default_rng(0)
    calls_c = {name for name, func in kernels.items() if "T.call_extern" in func.script()}
    assert {"hvx_add_rms_norm_kernel", "hvx_swiglu_kernel"} <= calls_c
    for name, func in sorted(kernels.items()):
        if name in calls_c:
            continue
        arrays = _inputs(func, rng)
        got = _on_device(program, name, arrays)
        expected = _on_host(func, arrays)
        np.testing.assert_allclose(got[-1].astype(np.float64), expected[-1].astype(np.float64), rtol=1e-5,
                                   atol=1e-5 * float(np.abs(expected[-1]).max()), err_msg=name)
    assert len(kernels) >= 19 and any("NT_matmul" in name for name in kernels)


def test_decode_gemv_against_numpy(npu):
    """fused_dequantize_NT_matmul: the decode qkv GEMV, y = W x with W in q4f16_g32 codes; a wrong scale must show."""
    kernels, program, _ = npu
    func = kernels["fused_dequantize_NT_matmul"]
    codes, scales, x, _ = arrays = _inputs(func, np.random.default_rng(1))
    layout = GroupLayout(4, 32, True, "float16")
    k = x.shape[-1]
    w = dequantize({"q_weight": codes, "q_scale": scales}, layout, k).astype(np.float64)
    expected = w @ x.reshape(k).astype(np.float64)
    got = _on_device(program, "fused_dequantize_NT_matmul", arrays)[-1].reshape(-1)
    scale = np.abs(w) @ np.abs(x.reshape(k))
    assert np.max(np.abs(got - expected) / scale) < 1e-5
    wrong = scales.copy()
    wrong[3, 1] *= np.float16(1.5)
    bad = _on_device(program, "fused_dequantize_NT_matmul", [codes, wrong, x, arrays[3]])[-1].reshape(-1)
    assert np.max(np.abs(bad - expected) / scale) > 1e-3


def test_emulation_spec_changes_only_its_copy():
    """The emulation build turns HVX float off in a copy: the target file's spec (the shipped artifact's) keeps it."""
    spec = load_target("hexagon-npu")
    shipped = list(spec.tvm_target_json["mattr"])
    emulated = emulated_hexagon.emulation_spec(spec)
    assert emulated.tvm_target_json["mattr"] == [*shipped, *emulated_hexagon.EMULATION_MATTR]
    assert spec.tvm_target_json["mattr"] == shipped
    with pytest.raises(MobilecError, match="hexagon targets"):
        emulated_hexagon.emulation_spec(load_target("host"))
