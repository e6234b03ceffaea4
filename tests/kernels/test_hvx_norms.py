"""RMSNorm (with the residual add) and SwiGLU of native/hexagon/hvx_norms.c on the emulated Hexagon DSP against
float64 numpy, with negative controls; and that the same source becomes HVX IEEE float (no qfloat) for a phone's
v73 and no HVX float at all for the emulator."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from compiler.testing import emulated_hexagon

pytestmark = pytest.mark.skipif(not emulated_hexagon.ready(), reason="scripts/fetch_qemu_hexagon.sh installs it")
TINY = np.finfo(np.float32).tiny
EPS = 1e-5
# n: whole vectors (SmolLM2's hidden size), and a row ending inside a vector
NORM_SHAPES = [(1, 576), (3, 100)]
SWIGLU_SHAPES = [(1, 1536), (2, 40)]
TOLERANCE = 1e-6  # relative, per value: float32 rounding of a few operations
EMULATED_FLAGS = [flag for flag in emulated_hexagon.CFLAGS if flag.startswith("-mno-hvx")]


@pytest.fixture(scope="module")
def dsp(tmp_path_factory):
    with emulated_hexagon.Device(emulated_hexagon.build_device(tmp_path_factory.mktemp("norms")), 1 << 20) as device:
        yield device


def _on_device(device, values: np.ndarray) -> np.ndarray:
    out = device.array(values.shape, np.float32)
    out[...] = values
    return out


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    normal = np.abs(want) >= TINY
    return float((np.abs(got.astype(np.float64) - want)[normal] / np.abs(want[normal])).max())


def _rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * weight.astype(np.float64)


def _silu_times(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    gate = gate.astype(np.float64)
    return gate / (1.0 + np.exp(-gate)) * up.astype(np.float64)


def _add_rms_norm(dsp, x, residual, weight):
    dsp.reset()
    rows, n = x.shape
    total, out = dsp.array((rows, n), np.float32), dsp.array((rows, n), np.float32)
    dsp.call("hvx_add_rms_norm", _on_device(dsp, x), _on_device(dsp, residual), _on_device(dsp, weight), total, out,
             rows, n, EPS)
    return total.copy(), out.copy()


def _swiglu(dsp, gate_up):
    dsp.reset()
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = dsp.array((rows, n), np.float32)
    dsp.call("hvx_swiglu", _on_device(dsp, gate_up), out, rows, n)
    return out.copy()


@pytest.mark.parametrize("rows,n", NORM_SHAPES)
def test_add_rms_norm(dsp, rows, n):
    rng = np.random.default_rng(rows * n)
    x, residual = (rng.standard_normal((rows, n)) * 3).astype(np.float32), rng.standard_normal((rows, n)).astype(np.float32)
    weight = rng.uniform(0.5, 2, n).astype(np.float32)
    total, out = _add_rms_norm(dsp, x, residual, weight)
    np.testing.assert_array_equal(total, x + residual)
    assert _relative_error(out, _rms_norm(x + residual, weight)) < TOLERANCE
    dsp.reset()
    alone = dsp.array((rows, n), np.float32)
    dsp.call("hvx_rms_norm", _on_device(dsp, x), _on_device(dsp, weight), alone, rows, n, EPS)
    assert _relative_error(alone, _rms_norm(x, weight)) < TOLERANCE
    # no sum wanted (a null pointer): the norm adds x and the residual again, to the same values
    dsp.reset()
    without_sum = dsp.array((rows, n), np.float32)
    dsp.call("hvx_add_rms_norm", _on_device(dsp, x), _on_device(dsp, residual), _on_device(dsp, weight), 0,
             without_sum, rows, n, EPS)
    np.testing.assert_array_equal(without_sum, out)


@pytest.mark.parametrize("rows,n", SWIGLU_SHAPES)
def test_swiglu(dsp, rows, n):
    """Gates over [-87, 30] (sigmoid's range short of underflow) and a row of typical ones."""
    rng = np.random.default_rng(rows * n)
    gate = rng.uniform(-87, 30, (rows, n)).astype(np.float32)
    gate[0] = rng.standard_normal(n) * 4
    up = rng.standard_normal((rows, n)).astype(np.float32)
    assert _relative_error(_swiglu(dsp, np.concatenate([gate, up], axis=1)), _silu_times(gate, up)) < TOLERANCE


def test_negative_controls(dsp):
    """The weight one value along, the eps 10x, the SwiGLU's halves swapped: each misses the tolerance."""
    rng = np.random.default_rng(43)
    x, residual = rng.standard_normal((2, 64)).astype(np.float32), rng.standard_normal((2, 64)).astype(np.float32)
    weight = rng.uniform(0.5, 2, 64).astype(np.float32)
    _, out = _add_rms_norm(dsp, x, residual, np.roll(weight, 1))
    assert _relative_error(out, _rms_norm(x + residual, weight)) > TOLERANCE
    small = (x * 1e-3).astype(np.float32)
    dsp.reset()
    alone = dsp.array(x.shape, np.float32)
    dsp.call("hvx_rms_norm", _on_device(dsp, small), _on_device(dsp, weight), alone, 2, 64, EPS * 10)
    assert _relative_error(alone, _rms_norm(small, weight)) > TOLERANCE
    gate, up = rng.standard_normal((1, 64)).astype(np.float32) * 4, rng.standard_normal((1, 64)).astype(np.float32)
    assert _relative_error(_swiglu(dsp, np.concatenate([up, gate], axis=1)), _silu_times(gate, up)) > TOLERANCE


def _instructions(tmp_path, name: str, cpu: str, flags: list[str]) -> str:
    obj = tmp_path / f"{name}.o"
    subprocess.run([emulated_hexagon.llvm_tool("clang"), "--target=hexagon-unknown-linux-musl", f"-mcpu=hexagon{cpu}",
                    "-mhvx", "-mhvx-length=128b", "-O2", "-ffreestanding", *flags,
                    f"-I{emulated_hexagon.NATIVE_DIR}", "-c", str(emulated_hexagon.NATIVE_DIR / "hvx_norms.c"),
                    "-o", str(obj)], check=True)
    return subprocess.run([emulated_hexagon.llvm_tool("llvm-objdump"), "-d", str(obj)], capture_output=True,
                          text=True, check=True).stdout


def test_hvx_ieee_float_for_the_phone_none_for_the_emulator(tmp_path):
    phone = _instructions(tmp_path, "phone", "v73", ["-mhvx-ieee-fp", "-mno-hvx-qfloat"])
    assert ".sf = vmpy(v" in phone and ".sf = vadd(v" in phone and "qf32" not in phone
    emulated = _instructions(tmp_path, "emulated", emulated_hexagon.CPU, [*EMULATED_FLAGS, "-DHVX_FLOAT_LANES=1"])
    assert not any(form in emulated for form in (".sf", ".hf", "qf32", "qf16"))


@pytest.mark.extended
def test_the_phones_32_lanes_under_emulation(tmp_path):
    """The phone's code path (32 lanes, each vector operation scalarized by LLVM: ~25 s to build) on the emulator:
    as close to numpy as the 1-lane build the other tests run."""
    rng = np.random.default_rng(7)
    x, residual = rng.standard_normal((3, 100)).astype(np.float32), rng.standard_normal((3, 100)).astype(np.float32)
    weight = rng.uniform(0.5, 2, 100).astype(np.float32)
    gate = rng.uniform(-87, 30, (2, 1536)).astype(np.float32)
    up = rng.standard_normal((2, 1536)).astype(np.float32)
    program = emulated_hexagon.build_device(tmp_path, float_lanes=32)
    with emulated_hexagon.Device(program, 1 << 20) as wide:
        total, out = _add_rms_norm(wide, x, residual, weight)
        assert _relative_error(out, _rms_norm(x + residual, weight)) < TOLERANCE
        assert _relative_error(_swiglu(wide, np.concatenate([gate, up], axis=1)), _silu_times(gate, up)) < TOLERANCE
    listing = subprocess.run([emulated_hexagon.llvm_tool("llvm-objdump"), "-d", str(program)], capture_output=True,
                             text=True, check=True).stdout
    assert not any(form in listing for form in (".sf", ".hf", "qf32", "qf16"))
