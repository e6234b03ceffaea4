"""What a test that runs a phone GPU target's artifact on this machine's OpenCL needs: PoCL (float32 builds) or
Intel's CPU runtime (float16 builds: the one here with cl_khr_fp16; x86 only, installed by scripts/setup.sh)."""

import platform

import pytest

from compiler.runtime import opencl_device

NEEDS_OPENCL = pytest.mark.skipif(not opencl_device.available(), reason=str(opencl_device.unavailable_reason()))
# compile options that make a GPU target's artifact run here: host code for this CPU, float32 (PoCL has no fp16)
ON_POCL = {"host_target": "host", "compute_dtype": "float32"}
# a float16 GPU artifact runs here with host code for this CPU, on the platform MOBILEC_OPENCL_PLATFORM names
ON_FP16_OPENCL = {"host_target": "host"}
FP16_PLATFORM = {opencl_device.PLATFORM_VARIABLE: "intel"}
# Only where Intel's runtime cannot exist; on x86 a missing one fails (`fp16_platform_installed`) instead.
NEEDS_X86_FOR_FP16 = pytest.mark.skipif(platform.machine() != "x86_64",
                                        reason="Intel's OpenCL CPU runtime (cl_khr_fp16 here) exists for x86_64 only")


def fp16_platform_installed() -> None:
    """Fail, naming the fix, when scripts/setup.sh has not registered Intel's runtime."""
    if not (opencl_device.VENDORS / "intel-cpu.icd").is_file():
        pytest.fail(f"Intel's OpenCL runtime is not registered in {opencl_device.VENDORS}: run scripts/setup.sh "
                    "(it installs intel-opencl-rt into .venv)")
