"""The emulated Hexagon DSP (compiler/testing/emulated_hexagon.py): a missing piece is one line, which HVX
instructions QEMU 10 runs (its docstring lists them: integer yes, float no), and the kernel server's refusals
(tests/kernels/test_hvx_gemv.py runs kernels through it)."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.errors import MobilecError
from compiler.testing import emulated_hexagon


def test_missing_emulator_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(emulated_hexagon, "KEPT_QEMU", tmp_path / "qemu-hexagon")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MobilecError, match="fetch_qemu_hexagon.sh") as error:
        emulated_hexagon.qemu()
    assert "\n" not in str(error.value)


FLOAT_PROBE = r"""
#include "hexagon_sys.h"
#include <hexagon_types.h>
#include <hvx_hexagon_protos.h>
int main(void) {
    union { HVX_Vector v; float f[32]; } a, out;
    for (int i = 0; i < 32; i++) a.f[i] = 1.5f + i;
    out.v = PROBE(a.v);
    hx_write_all(out.f, sizeof out.f);
    return 0;
}
"""
# HVX float instructions of v68/v69, as written in the emulated_hexagon docstring: none runs under QEMU 10.
FLOAT_FORMS = {"ieee_sf_add": "Q6_Vsf_vadd_VsfVsf(v, v)", "ieee_sf_mpy": "Q6_Vsf_vmpy_VsfVsf(v, v)",
               "qf32_mpy": "Q6_Vsf_equals_Vqf32(Q6_Vqf32_vmpy_VsfVsf(v, v))"}


@pytest.mark.skipif(not emulated_hexagon.ready(), reason="scripts/fetch_qemu_hexagon.sh installs it")
@pytest.mark.parametrize("form", FLOAT_FORMS)
def test_qemu_runs_no_hvx_float(tmp_path, form):
    source = tmp_path / "probe.c"
    source.write_text(FLOAT_PROBE)
    program = emulated_hexagon.build([source], tmp_path / "probe", defines={"PROBE(v)": FLOAT_FORMS[form]},
                                     flags=["-mhvx-ieee-fp", "-mhvx-qfloat"])
    with pytest.raises(MobilecError, match="code should not be reached"):
        emulated_hexagon.run(program)
    control = emulated_hexagon.build([source], tmp_path / "control", defines={"PROBE(v)": "Q6_Vw_vadd_VwVw(v, v)"})
    doubled_bits = (np.arange(32, dtype=np.float32) + 1.5).view(np.int32) * 2  # wraps as vadd.w does
    np.testing.assert_array_equal(np.frombuffer(emulated_hexagon.run(control), np.int32), doubled_bits)


@pytest.mark.skipif(not emulated_hexagon.ready(), reason="scripts/fetch_qemu_hexagon.sh installs it")
def test_device_refusals(tmp_path):
    with emulated_hexagon.Device(emulated_hexagon.build_device(tmp_path), 1 << 16) as device:
        assert "hvx_gemv_4bit" in device.kernels
        with pytest.raises(MobilecError, match="no kernel nope"):
            device.call("nope")
        with pytest.raises(MobilecError, match="not an array of the Device's region"):
            device.call("hvx_gemv_4bit", np.zeros(4, np.float32))
        device.array((1 << 15) + 1, np.uint8)
        with pytest.raises(MobilecError, match="region .* is full"):
            device.array((1 << 15) + 1, np.uint8)
