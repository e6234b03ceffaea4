"""What a test that runs a phone GPU target's artifact on this machine's OpenCL (PoCL) needs."""

import pytest

from compiler.runtime import opencl_device

NEEDS_OPENCL = pytest.mark.skipif(not opencl_device.available(),
                                  reason="no OpenCL platform (apt-get install pocl-opencl-icd)")
# compile options that make a GPU target's artifact run here: host code for this CPU, float32 (PoCL has no fp16)
ON_POCL = {"host_target": "host", "compute_dtype": "float32"}
