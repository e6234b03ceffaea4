"""Cross-compiled aarch64 code runs on the emulated arm64 device (compiler/testing/emulated_arm.py) over RPC.

A TE vector add and a tiny Relax VM program are compiled for aarch64 with NEON, linked with Debian's cross
compiler, uploaded through the tracker, run on the device's CPU and compared with numpy. The device is shown to
be aarch64: it loads the aarch64 libraries and refuses an x86-64 one.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, te
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.support import cc

TARGET = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]})
CROSS_COMPILER = "aarch64-linux-gnu-g++"
ELF_MACHINE = {"x86-64": 62, "aarch64": 183}
# A session outlives a few slow steps under qemu (upload, dlopen, first call).
SESSION_TIMEOUT_S = 120


def _elf_machine(path) -> int:
    header = path.read_bytes()[:20]
    assert header[:4] == b"\x7fELF", f"{path} is not an ELF file"
    return int.from_bytes(header[18:20], "little")


def _vector_add(n: int):
    a = te.placeholder((n,), "float32", name="a")
    b = te.placeholder((n,), "float32", name="b")
    c = te.compute((n,), lambda i: a[i] + b[i], name="c")
    return te.create_prim_func([a, b, c])


@I.ir_module
class TinyRelax:
    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 3), "float32")) -> R.Tensor((4, 3), "float32"):
        with R.dataflow():
            y = R.nn.relu(R.matmul(x, w))
            R.output(y)
        return y


@pytest.fixture(scope="module")
def remote(emulated_arm_device):
    return emulated_arm_device.request(session_timeout=SESSION_TIMEOUT_S)


@pytest.fixture(scope="module")
def vector_add_so(tmp_path_factory):
    path = tmp_path_factory.mktemp("aarch64") / "vector_add.so"
    tvm.compile(_vector_add(1000), target=TARGET).export_library(str(path), fcompile=cc.cross_compiler(CROSS_COMPILER))
    return path


def test_vector_add_runs_on_device(remote, vector_add_so):
    assert _elf_machine(vector_add_so) == ELF_MACHINE["aarch64"]
    remote.upload(str(vector_add_so))
    func = remote.load_module(vector_add_so.name)["main"]
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(1000, "float32"), rng.standard_normal(1000, "float32")
    dev = remote.cpu()
    c = tvm.runtime.tensor(np.full(1000, np.nan, "float32"), dev)
    func(tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev), c)
    np.testing.assert_allclose(c.numpy(), a + b, rtol=1e-6)
    # Negative control: the comparison tells a wrong kernel from the right one.
    assert not np.allclose(c.numpy(), a - b)


def test_device_refuses_x86_64_library(remote, tmp_path):
    host_so = tmp_path / "vector_add_x86_64.so"
    tvm.compile(_vector_add(16), target={"kind": "llvm"}).export_library(str(host_so))
    assert _elf_machine(host_so) == ELF_MACHINE["x86-64"]
    remote.upload(str(host_so))
    assert remote.download(host_so.name) == host_so.read_bytes()  # the file is there, intact
    # An x86-64 process would load it; the device's dynamic loader (aarch64) does not.
    with pytest.raises(tvm.error.RPCError, match="Failed to load dynamic shared library"):
        remote.load_module(host_so.name)


def test_relax_vm_runs_on_device(remote, tmp_path):
    path = tmp_path / "tiny_relax.so"
    tvm.compile(TinyRelax, target=TARGET).export_library(str(path), fcompile=cc.cross_compiler(CROSS_COMPILER))
    assert _elf_machine(path) == ELF_MACHINE["aarch64"]
    remote.upload(str(path))
    dev = remote.cpu()
    vm = relax.VirtualMachine(remote.load_module(path.name), dev)
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((4, 8), "float32"), rng.standard_normal((8, 3), "float32")
    got = vm["main"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(w, dev)).numpy()
    want = np.maximum(x @ w, 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, x @ w)  # relu changed something: the check can fail
