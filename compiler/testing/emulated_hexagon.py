"""An emulated Hexagon DSP: freestanding static Hexagon programs built by Debian's clang and run by qemu-hexagon.

A program includes native/hexagon/hexagon_sys.h (its `_start`, raw system calls, memory functions; no libc exists
for Hexagon here), defines `int main(void)`, reads its input from stdin and writes its output to stdout.
`build()` compiles and links it for `CPU` with 128-byte HVX; `run()` executes it under qemu-hexagon with the bytes
given and returns what it wrote. `Device` keeps one kernel server (native/hexagon/device_server.c, linked with the
kernels it serves) running, with a region of memory shared with this process through a mapped file: numpy arrays
allocated there are the kernels' buffers, and a launch sends only the kernel's index and its 32-bit arguments. scripts/fetch_qemu_hexagon.sh (run by scripts/setup.sh) puts QEMU 10's
qemu-hexagon in build/hexagon-qemu/ (Debian 12's QEMU 7.2 knows CPU models up to v67 only); a missing piece
raises MobilecError naming it.

What QEMU 10.0 emulates of HVX, tried one instruction at a time on v69 (tests/kernels/test_hvx_gemv.py keeps the
check for qf32 and IEEE sf): the integer instructions (vrmpy in its vector and scalar forms, vmpy/vmpyo, vasr,
vshuff, vand, vsplat ...), and none of the float ones. Every HVX float instruction aborts QEMU while decoding
("decode_insns: code should not be reached"): the qfloat forms (vmpy(Vu.sf,Vv.sf) to qf32, the qf32 -> sf
conversion) and the IEEE forms of v68's hvx-ieee-fp alike (Vd.sf = vadd / vsub / vmpy / vmax of sf vectors,
Vd.hf = vcvt(Vu.h), Vdd.sf = vcvt(Vu.hf), vmpy(Vu.hf,Vv.hf) to sf, vdmpy to sf, vcmp.gt of sf). So kernels that
must run here use integer HVX (fixed point) and scalar float only (native/hexagon/hvx_norms.c: float vector code
built with one lane, `build_device`'s float_lanes). An artifact's NPU kernels are built for
emulation by `emulation_spec`: its target with LLVM's HVX float features off (`EMULATION_MATTR`), so LLVM keeps
float in scalar registers where, for v73, it vectorizes float16 conversions and adds into qf32/hf HVX (3 of a
tiny Llama's 19 NPU kernels; -hvx-qfloat alone removed them all, -hvx-ieee-fp is off too since QEMU runs neither);
the shipped artifact keeps them. Programs are built for v69, the newest CPU
clang-15 (Debian 12's) knows (`hexagonv73`, the target file's CPU, is unknown to it; Debian 13 has clang-19 and
no clang-15: the newest installed clang, lld and llvm of `LLVM_VERSIONS` are used); qemu runs a program on the
model its ELF flags name.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ..data_files import data_dir
from ..errors import MobilecError
from ..target.targets import TargetSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
NATIVE_DIR = data_dir("native") / "hexagon"  # a checkout's, or the installed copy's (pyproject's data-files)
# The kernel server and the kernels it links (its KERNELS table names them).
DEVICE_SOURCES = ("device_server.c", "hvx_gemv.c", "hvx_norms.c")
ALIGNMENT = 128  # an HVX vector
MAX_ARGS = 12
KEPT_QEMU = REPO_ROOT / "build" / "hexagon-qemu" / "qemu-hexagon"
CPU = "v69"
SETUP_HINT = "run `bash scripts/fetch_qemu_hexagon.sh` (or scripts/setup.sh)"
# LLVM's Hexagon features for HVX float (qf32/qf16 and v68's IEEE sf/hf), which QEMU cannot run
EMULATION_MATTR = ("-hvx-qfloat", "-hvx-ieee-fp")
# EMULATION_MATTR as clang's -mno-hvx-* (v69 turns qfloat on, and LLVM vectorizes float into qf32 by default)
CFLAGS = ("--target=hexagon-unknown-linux-musl", f"-mcpu=hexagon{CPU}", "-mhvx", "-mhvx-length=128b", "-O2",
          *(f"-mno-{feature[1:]}" for feature in EMULATION_MATTR),
          "-ffreestanding", "-nostdlib", "-static", "-fuse-ld=lld")
LLVM_VERSIONS = (19, 18, 17, 16, 15)  # Debian 13's and Debian 12's, newest first
LLVM_TOOLS = ("clang", "ld.lld", "llvm-objdump", "llvm-nm")


def llvm_version() -> int | None:
    """The newest of LLVM_VERSIONS with all of LLVM_TOOLS installed."""
    return next((v for v in LLVM_VERSIONS if all(shutil.which(f"{tool}-{v}") for tool in LLVM_TOOLS)), None)


def llvm_tool(name: str) -> str:
    """`name` (one of LLVM_TOOLS) of llvm_version(), e.g. clang-15."""
    version = llvm_version()
    if version is None:
        raise MobilecError(f"no Debian clang, lld and llvm of version {' or '.join(map(str, LLVM_VERSIONS))}, which "
                           f"build emulated Hexagon programs; {SETUP_HINT}")
    return f"{name}-{version}"


def qemu() -> Path:
    """The qemu-hexagon that knows CPU `CPU`: the one the fetch script kept, else one on PATH (Debian 13's
    qemu-user or qemu-user-static)."""
    for candidate in (KEPT_QEMU, shutil.which("qemu-hexagon"), shutil.which("qemu-hexagon-static")):
        if candidate and Path(candidate).is_file():
            models = subprocess.run([str(candidate), "-cpu", "help"], capture_output=True, text=True, check=False)
            if CPU in models.stdout.split():
                return Path(candidate)
    raise MobilecError(f"no qemu-hexagon with CPU model {CPU} (QEMU 8 or later) in {KEPT_QEMU.parent} or on PATH; "
                       f"{SETUP_HINT}")


def ready() -> bool:
    """Whether programs can be built and run here (tests skip otherwise)."""
    try:
        qemu()
    except MobilecError:
        return False
    return llvm_version() is not None


def build(sources: list[Path], output: Path, defines: dict[str, str] | None = None,
          flags: list[str] | None = None) -> Path:
    """Compile and link `sources` (C, with native/hexagon/ on the include path) into the static program `output`,
    with `defines` and any further clang `flags`."""
    clang = llvm_tool("clang")
    macros = [f"-D{name}={value}" for name, value in (defines or {}).items()]
    includes = [f"-I{NATIVE_DIR}", f"-I{_tvm_ffi_include()}"]
    linker_dir = f"-B/usr/lib/llvm-{llvm_version()}/bin"  # its ld.lld
    command = [clang, *CFLAGS, linker_dir, *(flags or []), *includes, *macros, *map(str, sources), "-o", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise MobilecError(f"{clang} could not build {output.name} for Hexagon: {done.stderr.strip()}")
    return output


def run(program: Path, stdin: bytes = b"", timeout: float = 120) -> bytes:
    """Run `program` under qemu-hexagon with `stdin`; its stdout, or MobilecError naming how it failed."""
    done = subprocess.run([str(qemu()), "-cpu", CPU, str(program)], input=stdin, capture_output=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        last = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise MobilecError(f"{program.name} failed under qemu-hexagon (exit {done.returncode}): {last[0]}")
    return done.stdout


def _tvm_ffi_include() -> Path:
    """tvm_ffi's C headers (TVMFFIAny, DLTensor), found without importing it."""
    return Path(importlib.util.find_spec("tvm_ffi").origin).parent / "include"


def emulation_spec(spec: TargetSpec) -> TargetSpec:
    """`spec` (a hexagon target) for kernels that run on the emulated DSP: no HVX float (EMULATION_MATTR)."""
    if spec.tvm_target_json.get("kind") != "hexagon":
        raise MobilecError(f"the emulated DSP runs hexagon targets' kernels, not {spec.name}'s; pass hexagon-npu")
    target = dict(spec.tvm_target_json)
    target["mattr"] = [*target.get("mattr", []), *EMULATION_MATTR]
    return dataclasses.replace(spec, tvm_target_json=target)


def build_device(folder: Path, tvm_objects: tuple[Path, ...] = (), float_lanes: int = 1) -> Path:
    """The kernel server with our kernels and the TVM-compiled ones of `tvm_objects` (an artifact's
    lib/hexagon/kernels.o), as the program `folder`/hexagon_device. `float_lanes`: hvx_norms.c's vector width
    (HVX_FLOAT_LANES); 1 builds in 0.2 s, 32 (a phone's HVX vector, scalarized here) in ~25 s."""
    nm = llvm_tool("llvm-nm")
    names = []
    for obj in tvm_objects:
        listing = subprocess.run([nm, "--defined-only", str(obj)], capture_output=True, text=True, check=True).stdout
        names += re.findall(r" T __tvm_ffi_(\w+)$", listing, flags=re.MULTILINE)
    declarations = "".join(f"int __tvm_ffi_{n}(void *, const TVMFFIAny *, int32_t, TVMFFIAny *);\n" for n in names)
    entries = ", ".join(f'{{"{n}", __tvm_ffi_{n}}}' for n in names) or "{0, 0}"
    table = folder / "tvm_kernel_table.c"
    table.write_text(f'#include "tvm_kernels.h"\n{declarations}const struct tvm_kernel TVM_KERNELS[] = {{{entries}}};\n'
                     f"const int32_t N_TVM_KERNELS = {len(names)};\n")
    return build([*(NATIVE_DIR / name for name in DEVICE_SOURCES), table, *tvm_objects], folder / "hexagon_device",
                 defines={"HVX_FLOAT_LANES": str(float_lanes)})


def program_cpu(program: Path) -> str:
    """The Hexagon version a program is built for (its ELF flags: 0x69 -> v69), which qemu must emulate."""
    return f"v{Path(program).read_bytes()[36]:x}"


class Device:
    """A kernel server running under qemu-hexagon, with `region_bytes` of memory shared with this process.

    `array()` hands out numpy arrays in the shared region (aligned to a vector; `reset()` frees them all) and
    `call(kernel, *args)` runs a kernel on them: arrays of the region go as their offsets, ints as int32, floats as
    float32. Use it as a context manager, or call close()."""

    def __init__(self, program: Path, region_bytes: int):
        shm = Path("/dev/shm")
        self._file = tempfile.NamedTemporaryFile(prefix="mobilec-hexagon-", dir=shm if shm.is_dir() else None)
        os.ftruncate(self._file.fileno(), region_bytes)
        self.region = np.memmap(self._file.name, np.uint8, "r+", shape=(region_bytes,))
        self._base = self.region.ctypes.data
        self._next = 0
        self._process = subprocess.Popen([str(qemu()), "-cpu", program_cpu(program), str(program)], stdin=subprocess.PIPE, bufsize=0,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        path = self._file.name.encode()
        self._send(struct.pack("<i", len(path)) + path + struct.pack("<i", region_bytes))
        self.kernels: dict[str, int] = {}  # name -> index
        self._tvm: set[str] = set()  # the TVM-compiled ones, called with tensors
        for index in range(self._word()):
            kind = self._word()
            name = self._receive(self._word()).decode()
            self.kernels[name] = index
            if kind == 1:
                self._tvm.add(name)

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def array(self, shape, dtype) -> np.ndarray:
        """A zeroed array of the shared region."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        start = -(-self._next // ALIGNMENT) * ALIGNMENT
        if start + nbytes > self.region.size:
            raise MobilecError(f"the emulated DSP's shared region ({self.region.size} bytes) is full; "
                               "start the Device with a larger region_bytes")
        self._next = start + nbytes
        out = self.region[start:start + nbytes].view(dtype).reshape(shape)
        out[...] = 0
        return out

    def reset(self) -> None:
        self._next = 0

    def call(self, kernel: str, *args) -> None:
        """Run `kernel` on `args`: arrays of the region (Device.array), ints and floats. Our C kernels take arrays as
        pointers and 32-bit numbers; TVM-compiled ones take arrays as tensors (DLTensor) and 64-bit numbers."""
        if kernel not in self.kernels:
            raise MobilecError(f"the emulated DSP has no kernel {kernel}; it serves {', '.join(self.kernels)}")
        if len(args) > MAX_ARGS:
            raise MobilecError(f"{kernel}: {len(args)} arguments, the server passes at most {MAX_ARGS}")
        tvm = kernel in self._tvm
        words = [struct.pack("<2i", self.kernels[kernel], len(args))]
        for i, arg in enumerate(args):
            if isinstance(arg, np.ndarray):
                offset = arg.ctypes.data - self._base
                if not 0 <= offset < self.region.size:
                    raise MobilecError(f"{kernel}: argument {i} is not an array of the Device's region (Device.array)")
                if not tvm:
                    words.append(struct.pack("<2I", 2, offset))
                    continue
                dtype = np.dtype(arg.dtype)
                code = {"i": 0, "u": 1, "f": 2}[dtype.kind]
                words.append(struct.pack(f"<4I{arg.ndim}i", 5, offset, arg.ndim, code | dtype.itemsize * 8 << 8 | 1 << 16,
                                         *arg.shape))
            elif isinstance(arg, (float, np.floating)):
                words.append(struct.pack("<Id", 4, arg) if tvm else struct.pack("<If", 1, arg))
            else:
                words.append(struct.pack("<Iq", 3, arg) if tvm else struct.pack("<Ii", 0, arg))
        self._send(b"".join(words))
        if self._word() != 0:
            raise MobilecError(f"{kernel} failed on the emulated DSP: {self._receive(self._word()).decode()}")

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._send(struct.pack("<i", -1))
                self._process.wait(timeout=30)
            except (MobilecError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()
        for pipe in (self._process.stdin, self._process.stdout, self._process.stderr):
            pipe.close()
        del self.region
        self._file.close()

    def _send(self, data: bytes) -> None:
        try:
            self._process.stdin.write(data)
            self._process.stdin.flush()
        except BrokenPipeError:
            self._failed()

    def _receive(self, n: int) -> bytes:
        data = self._process.stdout.read(n)
        if len(data) < n:
            self._failed()
        return data

    def _word(self) -> int:
        return struct.unpack("<i", self._receive(4))[0]

    def _failed(self):
        code = self._process.wait()
        last = self._process.stderr.read().decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise MobilecError(f"the emulated DSP's kernel server stopped (exit {code}): {last[0]}")
