"""SmolLM2's GPU kernels computing in float16, as the phones run them, on Intel's OpenCL CPU runtime (the platform
here with cl_khr_fp16) against the same PrimFuncs before scheduling built for this CPU, which rounds every
float16 operation too (LLVM computes each in float32 and rounds). GEMV and matmul of each scheme, RMSNorm, RoPE
and split, the KV append, embedding, SwiGLU: every kernel with a CPU form (the paged-attention kernels have none:
scheduled_kernels.NOT_RUN; test_float16_attention.py runs them against numpy). Decode (1 token) and one prefill
length (7). A negative control for each family: the same comparison fails with a wrong scale or order.

Tolerance: the two sum in different orders, each rounding to float16 (unit roundoff u = 2^-11) at every step; a
sum of K terms in two orders differs by at most ~2 K u max|partial sum| in the worst case and ~2 sqrt(K) u for
random signs. Allowed: 8 sqrt(K) u x max|reference| + 2 u (K the kernel's longest reduction, 1 for elementwise
kernels), which random-signed data stays under with room and a wrong scale or order does not.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym.analyzer import Analyzer

from compiler.testing import pocl
from tests.helpers.pocl_device import NEEDS_X86_FOR_FP16, fp16_platform_installed
from tests.helpers.scheduled_kernels import NOT_RUN, PREFILL, bindings, compare, kernels

pytestmark = [pytest.mark.slow, NEEDS_X86_FOR_FP16]

U16 = 2.0 ** -11
REDUCE = 2  # IterVar.CommReduce
CASES = [("android-adreno", "q4f16_g32"), ("android-mali", "q8f16_g128"), ("android-adreno", "q0f16")]


def _reduction_length(func: tirx.PrimFunc, values: dict[str, int]) -> int:
    """The longest reduction among the function's blocks: the product of a block's reduce axes' extents."""
    ana = Analyzer()
    for name, var in pocl.shape_vars(func).items():
        ana.bind(var, tirx.const(values[name], var.ty.dtype))
    lengths = [1]

    def visit(block: s_tir.SBlock):
        lengths.append(math.prod(int(ana.simplify(iv.dom.extent)) for iv in block.iter_vars
                                 if int(iv.iter_type) == REDUCE))

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, visit))
    return max(lengths)


def _tolerance(reduction: int, scale: float) -> float:
    return 8 * math.sqrt(reduction) * U16 * scale + 2 * U16


@pytest.mark.parametrize("target_name,quant", CASES)
def test_float16_kernels_match_cpu(target_name, quant):
    fp16_platform_installed()
    spec, pairs = kernels(target_name, quant, "float16")
    rng = np.random.default_rng(0)
    rows, failures = [], []
    for name, (scheduled, reference) in sorted(pairs.items()):
        if name in NOT_RUN:
            continue
        for seq_len in [1, PREFILL] if pocl.shape_vars(scheduled) else [1]:
            k = _reduction_length(reference, bindings(reference, seq_len))
            err, scale = compare(spec, scheduled, reference, seq_len, rng, platform=pocl.INTEL)
            tol = _tolerance(k, scale)
            rows.append(f"  {name:42s} len={seq_len:<2d} K={k:<5d} max_abs_err={err:.3g} tol={tol:.3g} "
                        f"(max |ref| {scale:.3g}){'' if err <= tol else '  FAIL'}")
            if err > tol:
                failures.append(rows[-1])
    print(f"\n{target_name} {quant} float16: {len(rows)} kernel runs on Intel's OpenCL vs llvm")
    print("\n".join(rows))
    assert not failures, "\n".join(failures)
    assert len(rows) >= 15


def _matmul(pairs: dict, dynamic: bool) -> str:
    """The smallest GEMV (decode: no symbolic dimension) or matmul (prefill) among the kernels."""
    names = [n for n, (f, _) in pairs.items() if "NT_matmul" in n and bool(pocl.shape_vars(f)) == dynamic]

    def weight_elements(name):
        return max(math.prod(int(d) for d in p.shape) for p in pairs[name][0].params
                   if pocl.is_buffer(p) and "weight" in p.name)

    return min(names, key=weight_elements)


# What each negative control gives a kernel in place of one input (found by a part of its name).
WRONG = {
    "shuffled": lambda x, rng: rng.permutation(x.reshape(-1)).reshape(x.shape),
    "rows permuted": lambda x, rng: x[rng.permutation(len(x))],
    "reversed": lambda x, rng: x[..., ::-1].copy(),
    "shifted by one": lambda x, rng: x + 1,
    "rolled": lambda x, rng: np.roll(x, 1),
    "halves swapped": lambda x, rng: np.concatenate(np.split(x, 2, axis=-1)[::-1], axis=-1),
}
ADRENO_Q4, MALI_Q8, ADRENO_Q0 = CASES
NEGATIVE_CONTROLS = [  # (target and scheme, kernel (GEMV / matmul: the smallest), token count, input, how it is wrong)
    (ADRENO_Q4, "GEMV", 1, "scale", "shuffled"),
    (ADRENO_Q4, "matmul", PREFILL, "scale", "shuffled"),
    (MALI_Q8, "GEMV", 1, "scale", "shuffled"),
    (MALI_Q8, "matmul", PREFILL, "scale", "shuffled"),
    (ADRENO_Q0, "GEMV", 1, "weight", "rows permuted"),
    (ADRENO_Q0, "matmul", PREFILL, "weight", "rows permuted"),
    (ADRENO_Q4, "rms_norm1", PREFILL, "weight", "reversed"),
    (ADRENO_Q4, "fused_rope", PREFILL, "position_map", "shifted by one"),
    (ADRENO_Q4, "tir_kv_cache_transpose_append", PREFILL, "position_map", "rolled"),
    (ADRENO_Q4, "take_dequantize", PREFILL, "scale", "shuffled"),
    (ADRENO_Q4, "swiglu1", PREFILL, "matmul", "halves swapped"),
]


@pytest.mark.parametrize("case,kernel,seq_len,param,wrong", NEGATIVE_CONTROLS,
                         ids=[f"{c[0][1]}-{c[1]}-{c[3]}-{c[4]}" for c in NEGATIVE_CONTROLS])
def test_a_kernel_fed_a_wrong_scale_or_order_fails(case, kernel, seq_len, param, wrong):
    """Negative controls, a kernel of each family: the comparison above passes on these inputs and fails with one
    of them wrong (the altered input itself left out of the comparison: the kernel's outputs must show it)."""
    fp16_platform_installed()
    spec, pairs = kernels(*case, "float16")
    name = _matmul(pairs, dynamic=kernel == "matmul") if kernel in ("GEMV", "matmul") else kernel
    scheduled, reference = pairs[name]
    index = next(i for i, p in enumerate(scheduled.params) if param in p.name)
    k = _reduction_length(reference, bindings(reference, seq_len))

    def altered(args):
        args[index] = WRONG[wrong](args[index], np.random.default_rng(2))
        return args

    err, scale = compare(spec, scheduled, reference, seq_len, np.random.default_rng(1), platform=pocl.INTEL)
    assert err <= _tolerance(k, scale), (name, err, scale)
    err, scale = compare(spec, scheduled, reference, seq_len, np.random.default_rng(1), platform=pocl.INTEL,
                         change_args=altered)
    print(f"\n  {name} len={seq_len} {param} {wrong}: max_abs_err={err:.3g} tol={_tolerance(k, scale):.3g}")
    assert err > _tolerance(k, scale), (name, err, scale)
