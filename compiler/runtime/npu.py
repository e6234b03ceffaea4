"""A hexagon-npu artifact's NPU kernels, run on the emulated Hexagon DSP for its host library (built with
--host-target): one kernel server under qemu-hexagon per loaded artifact (testing/emulated_hexagon.py), linked
from the artifact's lib/hexagon/kernels.o, and for each NPU kernel the packed function the host library calls in
its place (codegen/hexagon.NPU_FUNCTION), registered before the VM resolves its functions. A call copies the
kernel's tensors into the memory the server shares with this process, launches the kernel there and copies back
the tensors it writes."""

from __future__ import annotations

import collections
import tempfile
import weakref
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi

from ..artifacts.artifact import LIBRARY_DIR, Artifact
from ..codegen.hexagon import NPU_FUNCTION
from ..errors import MobilecError
from ..testing import emulated_hexagon

# The memory shared with the DSP (a sparse file: only what calls touch is used); one call's tensors must fit.
REGION_BYTES = 1 << 30


class EmulatedNPU:
    """The kernel server of one loaded artifact and the packed functions that forward its NPU kernels there.
    `calls` counts the launches per kernel."""

    def __init__(self, artifact: Artifact):
        coverage = artifact.config["npu_coverage"]
        self._folder = tempfile.TemporaryDirectory(prefix="mobilec-npu-")
        obj = artifact.path / LIBRARY_DIR / coverage["library"]
        program = emulated_hexagon.build_device(Path(self._folder.name), (obj,))
        self.device = emulated_hexagon.Device(program, REGION_BYTES)
        weakref.finalize(self, _close, self.device, self._folder)
        missing = sorted(set(coverage["npu_writes"]) - set(self.device.kernels))
        if missing:
            raise MobilecError(f"{obj} lacks the NPU kernel {missing[0]} its host library calls; recompile the "
                               f"artifact")
        self.calls: collections.Counter[str] = collections.Counter()
        for name, writes in coverage["npu_writes"].items():
            tvm_ffi.register_global_func(NPU_FUNCTION + name, self._forwarder(name, writes), override=True)

    def _forwarder(self, name: str, writes: list[int]):
        def forward(*args):
            self.device.reset()
            placed = []
            for arg in args:
                if isinstance(arg, tvm.runtime.Tensor):
                    host = np.from_dlpack(arg)
                    on_dsp = self.device.array(host.shape, host.dtype)
                    on_dsp[...] = host
                    placed.append(on_dsp)
                else:
                    placed.append(arg)
            self.device.call(name, *placed)
            for index in writes:
                np.from_dlpack(args[index])[...] = placed[index]
            self.calls[name] += 1

        return forward


def _close(device: emulated_hexagon.Device, folder: tempfile.TemporaryDirectory) -> None:
    device.close()
    folder.cleanup()
