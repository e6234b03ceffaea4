"""SmolLM2's OpenCL kernels (android-adreno, android-mali) run on PoCL and match the same PrimFuncs on the CPU.

The model is imported and taken through compiler.codegen.pipeline up to and including the `schedule` step; every
PrimFunc our GPU rules scheduled is built for the target (OpenCL), its kernels run on PoCL (CPU OpenCL, see
compiler/testing/pocl.py) with random inputs, and the result is compared with the PrimFunc as it was before
scheduling, built for llvm and run on the same inputs. Dynamic dimensions are bound to concrete values: the
decode shape (seq_len = 1) and one prefill length (7: not a multiple of any tile, so padding paths run).

fp32 only: PoCL 3.1 has no cl_khr_fp16, so q0f32 and q4f32_g32 are used, and the targets' compute_dtype
(float16 in the target files) is overridden to float32 with a patched TargetSpec. Kernels, tile parameters and
the OpenCL target are otherwise the target files' own.

Tolerance: max abs error <= 1e-4 x the largest reference value (1e-4 relative), +1e-6 absolute.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pyopencl")
from compiler.testing import pocl  # noqa: E402
from tests.helpers.scheduled_kernels import NOT_RUN, PREFILL, compare, kernels  # noqa: E402

TARGETS = ["android-adreno", "android-mali"]
QUANTS = ["q0f32", "q4f32_g32"]
RTOL, ATOL = 1e-4, 1e-6


def _pocl_available() -> bool:
    try:
        pocl._context()  # pylint: disable=protected-access
    except Exception:  # noqa: BLE001 - no ICD, no platform: skip
        return False
    return True


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _pocl_available(), reason="PoCL missing: apt-get install pocl-opencl-icd"),
]


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("target_name", TARGETS)
def test_kernels_match_cpu(target_name, quant):
    spec, pairs = kernels(target_name, quant)
    rng = np.random.default_rng(0)
    rows, failures, not_run = [], [], {}
    for name, (scheduled, reference) in sorted(pairs.items()):
        if reference.attrs is not None and reference.attrs.get("tirx.is_scheduled"):
            not_run[name] = "GPU-only KV-cache TIR (no CPU form; needs the paged KV cache's runtime state)"
            continue
        lengths = [1, PREFILL] if pocl.shape_vars(scheduled) else [1]
        for seq_len in lengths:
            err, scale = compare(spec, scheduled, reference, seq_len, rng)
            ok = err <= RTOL * scale + ATOL
            rows.append(f"  {name:42s} len={seq_len:<2d} max_abs_err={err:.3g} (max |ref| {scale:.3g})"
                        f"{'' if ok else '  FAIL'}")
            if not ok:
                failures.append(rows[-1])
    print(f"\n{target_name} {quant}: {len(rows)} kernel runs on PoCL vs llvm (tolerance {RTOL:g} relative)")
    print("\n".join(rows))
    print("not run:\n" + "\n".join(f"  {n}: {why}" for n, why in sorted(not_run.items())))
    assert not failures, "\n".join(failures)
    assert set(not_run) == NOT_RUN
    assert len(rows) >= 20


def test_wrong_launch_size_fails():
    """Negative control: the decode GEMV launched with half its global size leaves outputs unwritten."""
    spec, pairs = kernels("android-adreno", "q4f32_g32")
    gemv = next(n for n, (f, _) in pairs.items()
                if n.startswith("fused_dequantize") and "NT_matmul" in n and not pocl.shape_vars(f))
    scheduled, reference = pairs[gemv]
    err, scale = compare(spec, scheduled, reference, 1, np.random.default_rng(1))
    assert err <= RTOL * scale + ATOL

    def halve(kernel, global_size, local_size):
        axis = max(range(3), key=lambda a: global_size[a] // local_size[a])  # the axis with the most groups
        global_size = list(global_size)
        global_size[axis] = max(local_size[axis], global_size[axis] // 2 // local_size[axis] * local_size[axis])
        return global_size, local_size

    err, scale = compare(spec, scheduled, reference, 1, np.random.default_rng(1), launch_hook=halve)
    print(f"\n{gemv} with half the global size: max_abs_err={err:.3g} (max |ref| {scale:.3g})")
    assert err > RTOL * scale + ATOL
