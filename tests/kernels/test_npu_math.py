"""The float math that passes/expand_npu_math.py gives the NPU kernels, run on the emulated Hexagon DSP against
float64 numpy over many inputs and the edges (denormals, 0, inf, NaN, overflow and underflow), with negative
controls: one Newton step fewer, or a shorter polynomial, must miss the tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import tirx
from tvm.script import tirx as T

from compiler.codegen import hexagon
from compiler.passes import expand_npu_math as npu_math
from compiler.target.targets import load_target
from compiler.testing import emulated_hexagon

pytestmark = pytest.mark.skipif(not emulated_hexagon.ready(), reason="scripts/fetch_qemu_hexagon.sh installs it")
N = 8192
TINY = 2.0 ** -126  # the smallest normal float32; relative errors are measured on results at least this large
EDGES = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, 1e-40, 1.4e-45, 1e-5, 100.0, -100.0, 88.7, 88.8,
                  -87.5, -103.9, -110.0, 3e38], np.float32)


@T.prim_func
def _exp_kernel(x: T.Buffer((N,), "float32"), y: T.Buffer((N,), "float32")):
    for i in range(N):
        y[i] = T.exp(x[i])


@T.prim_func
def _division_kernel(x: T.Buffer((N,), "float32"), y: T.Buffer((N,), "float32")):
    for i in range(N):
        y[i] = x[i] / T.float32(576.0)


def _elementwise(name: str, expand) -> tirx.PrimFunc:
    """y[i] = expand(x[i]), the exp of _exp_kernel replaced by `expand`'s expression."""
    def replaced(call):
        return expand(call.args[0]) if isinstance(call.op, tvm.ir.Op) and call.op.name == "tirx.exp" else call

    return tvm_ffi.structural_map(_exp_kernel, [(tvm.ir.expr.Call, replaced)]).with_attr("global_symbol", name)


# name -> (expansion, float64 reference)
KERNELS = {
    "rsqrt": (npu_math.rsqrt, lambda x: 1 / np.sqrt(x)),
    "rsqrt_fewer_steps": (lambda x: npu_math.rsqrt(x, npu_math.RSQRT_NEWTON_STEPS - 1), lambda x: 1 / np.sqrt(x)),
    "sqrt": (npu_math.sqrt, np.sqrt),
    "exp": (npu_math.exp, np.exp),
    "exp_shorter_polynomial": (lambda x: npu_math.exp(x, len(npu_math.EXP_POLYNOMIAL) - 2), np.exp),
    "sigmoid": (npu_math.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
    "reciprocal": (npu_math.reciprocal_1_to_2, lambda x: 1 / x),
    "reciprocal_fewer_steps": (lambda x: npu_math.reciprocal_1_to_2(x, npu_math.RECIPROCAL_NEWTON_STEPS - 1),
                               lambda x: 1 / x),
}


@pytest.fixture(scope="module")
def dsp(tmp_path_factory):
    """The kernel server with KERNELS and `division` (_division_kernel through expand_float_math) built for the
    emulated DSP the way an artifact's NPU kernels are (hexagon.build_object)."""
    root = tmp_path_factory.mktemp("npu-math")
    funcs = {name: _elementwise(name, expand) for name, (expand, _) in KERNELS.items()}
    funcs["division"] = npu_math.expand_float_math(_division_kernel.with_attr("global_symbol", "division"))
    hexagon.build_object(funcs, emulated_hexagon.emulation_spec(load_target("hexagon-npu")), root, link=False)
    program = emulated_hexagon.build_device(root, (root / hexagon.OBJECT,))
    with emulated_hexagon.Device(program, 1 << 20) as device:
        yield device


def _run(device, name: str, x: np.ndarray) -> np.ndarray:
    device.reset()
    placed, out = device.array(N, "float32"), device.array(N, "float32")
    placed[: x.size] = x
    device.call(name, placed, out)
    return out[: x.size].copy()


def _max_relative_error(device, name: str, x: np.ndarray) -> float:
    got = _run(device, name, x).astype(np.float64)
    want = KERNELS[name][1](x.astype(np.float64))
    normal = np.abs(want) >= TINY
    return float((np.abs(got - want)[normal] / np.abs(want[normal])).max())


def _positive(rng) -> np.ndarray:
    """Over the whole float32 range, denormals included: e^-103 to e^88."""
    return np.exp(rng.uniform(-103, 88, N)).astype(np.float32)


@pytest.mark.parametrize("name,inputs,tolerance", [
    ("rsqrt", _positive, 2e-7),
    ("sqrt", _positive, 2e-7),
    ("exp", lambda rng: rng.uniform(-87.3, 88.7, N).astype(np.float32), 1e-6),
    ("exp", lambda rng: rng.uniform(-1, 1, N).astype(np.float32), 1e-6),
    ("sigmoid", lambda rng: rng.uniform(-87, 30, N).astype(np.float32), 1e-6),
    ("reciprocal", lambda rng: rng.uniform(1, 2, N).astype(np.float32), 2e-7),
])
def test_within_tolerance_of_numpy(dsp, name, inputs, tolerance):
    """Measured here: rsqrt 6.9e-8, sqrt 1.1e-7, exp 7.6e-8, sigmoid 1.7e-7, reciprocal 5.9e-8."""
    assert _max_relative_error(dsp, name, inputs(np.random.default_rng(43))) < tolerance


@pytest.mark.parametrize("name,inputs,tolerance", [
    ("rsqrt_fewer_steps", _positive, 2e-7),
    ("exp_shorter_polynomial", lambda rng: rng.uniform(-87.3, 88.7, N).astype(np.float32), 1e-6),
    ("reciprocal_fewer_steps", lambda rng: rng.uniform(1, 2, N).astype(np.float32), 2e-7),
])
def test_a_truncated_expansion_misses_the_tolerance(dsp, name, inputs, tolerance):
    """Negative controls: the same inputs and tolerances as above (4.6e-6, 3.3e-6, 1.2e-5 seen)."""
    assert _max_relative_error(dsp, name, inputs(np.random.default_rng(43))) > tolerance


@pytest.mark.parametrize("name", ["rsqrt", "sqrt", "exp", "sigmoid"])
def test_edges_are_ieee(dsp, name):
    """0, inf, NaN and negative inputs give what numpy's float32 gives (NaN where it does), exp overflows to inf and
    underflows through denormals to 0 (within two denormal steps), sigmoid saturates at 1 and 0 without NaN."""
    got = _run(dsp, name, EDGES)
    with np.errstate(all="ignore"):
        want = KERNELS[name][1](EDGES.astype(np.float64)).astype(np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    assert np.array_equal(np.isinf(got[finite]), np.isinf(want[finite]))
    assert np.array_equal(np.signbit(got[finite]), np.signbit(want[finite]))
    small = finite & (np.abs(want) < TINY)
    assert np.abs(got[small] - want[small]).max() <= 2 * 2.0 ** -149
    normal = finite & ~small & ~np.isinf(want)
    assert np.allclose(got[normal], want[normal], rtol=2e-7, atol=0)


def test_a_division_by_a_constant_is_a_multiplication_within_an_ulp(dsp):
    """x / 576 (an RMSNorm's mean over SmolLM2's width) as x * (1/576): no compiler-rt call, within one ulp of
    numpy's float32 division."""
    x = np.random.default_rng(43).standard_normal(N).astype(np.float32) * 1e3
    got, want = _run(dsp, "division", x), x / np.float32(576.0)
    assert np.abs(got.view(np.int32) - want.view(np.int32)).max() <= 1
