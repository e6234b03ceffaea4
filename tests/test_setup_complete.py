"""What scripts/setup.sh installs is in place where it ran: the tests that need an OpenCL device, llama.cpp, the
emulated Hexagon DSP or Intel's float16 OpenCL runtime skip without them, so a suite run by scripts/test.sh (CI) that
lost one would check nothing there and still pass. Here its absence fails, naming the reason."""

import platform
import sys
from pathlib import Path

import pytest

from compiler.runtime import opencl_device
from compiler.testing import emulated_hexagon
from tests.helpers.pocl_device import fp16_platform_installed

ROOT = Path(__file__).resolve().parents[1]
SETUP_STAMP = ROOT / ".venv" / ".mobilec-setup"  # scripts/setup.sh writes it once .venv is complete

pytestmark = pytest.mark.skipif(
    not SETUP_STAMP.is_file() or Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
    reason="checks the .venv scripts/setup.sh made; this interpreter is another")


def test_the_opencl_device_runs_kernels():
    assert opencl_device.unavailable_reason() is None, opencl_device.unavailable_reason()


def test_llama_cpp_python_imports():
    import llama_cpp  # noqa: F401, PLC0415  # pylint: disable=import-outside-toplevel,unused-import


def test_the_emulated_hexagon_dsp_is_ready():
    assert emulated_hexagon.ready(), "run scripts/fetch_qemu_hexagon.sh (scripts/setup.sh runs it)"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="Intel's OpenCL CPU runtime exists for x86_64 only")
def test_intels_float16_opencl_runtime_is_registered():
    fp16_platform_installed()
