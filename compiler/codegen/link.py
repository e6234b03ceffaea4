"""Write a compiled executable into the artifact's lib/ the way the target file's [link] table says."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import tvm
from tvm.support import cc

from ..errors import MobilecError
from ..target.targets import TargetSpec

NDK_HOST = "linux-x86_64"


def ndk_compiler(spec: TargetSpec) -> str | None:
    """TVM_NDK_CC, or the API-level clang++ under ANDROID_NDK; None when neither is set."""
    if os.environ.get("TVM_NDK_CC"):
        return os.environ["TVM_NDK_CC"]
    ndk = os.environ.get("ANDROID_NDK")
    if not ndk:
        return None
    triple = spec.tvm_target().host or spec.tvm_target()
    name = f"{triple.attrs['mtriple']}{spec.link['ndk_api']}-clang++"
    path = Path(ndk) / "toolchains" / "llvm" / "prebuilt" / NDK_HOST / "bin" / name
    if not path.is_file():
        raise MobilecError(f"ANDROID_NDK={ndk} has no {path.name} (looked in {path.parent}); "
                           f"point ANDROID_NDK at an NDK r23+ or set TVM_NDK_CC to its clang++")
    return str(path)


def check_toolchain(spec: TargetSpec) -> None:
    """Fail before the build, not after it, when the target's linker is missing."""
    method = spec.link["method"]
    if method == "cross" and shutil.which(spec.link["compiler"]) is None:
        raise MobilecError(f"cross compiler {spec.link['compiler']} for target {spec.name} is not installed; "
                           f"install it with `apt-get install {spec.link['package']}` (scripts/setup.sh does)")
    if method == "ndk":
        ndk_compiler(spec)


OPENCL_SOURCE = "kernels.cl"


def _write_opencl_source(executable: tvm.runtime.Executable, lib_dir: Path) -> None:
    """The OpenCL kernels as text beside the library: for reading, `clang -x cl` checks, and running them
    elsewhere (PoCL) without an Android device or a loadable library."""
    stack = list(executable.mod.imports)
    while stack:
        module = stack.pop()
        if module.kind == "opencl":
            (lib_dir / OPENCL_SOURCE).write_text(module.inspect_source())
        stack.extend(module.imports)


def export_library(executable: tvm.runtime.Executable, spec: TargetSpec, lib_dir: Path) -> tuple[str, str | None]:
    """Write the library into lib_dir; returns (its name, a note for the user or None)."""
    _write_opencl_source(executable, lib_dir)
    method = spec.link["method"]
    if method == "native":
        executable.export_library(str(lib_dir / "model.so"))
        return "model.so", None
    if method == "cross":
        executable.export_library(str(lib_dir / "model.so"), fcompile=cc.cross_compiler(spec.link["compiler"]))
        return "model.so", None
    compiler = ndk_compiler(spec)
    if compiler is not None:
        executable.export_library(str(lib_dir / "model.so"), fcompile=cc.cross_compiler(compiler))
        return "model.so", None
    # A .tar of objects (TVM's own format for unlinked libraries): linking needs only the NDK's clang.
    executable.export_library(str(lib_dir / "model.tar"))
    note = (f"no Android NDK (TVM_NDK_CC or ANDROID_NDK): lib/model.tar holds the unlinked objects; link them with "
            f"`mkdir o && tar -xf lib/model.tar -C o && $TVM_NDK_CC -shared -fPIC -o lib/model.so o/*.o -lm` "
            f"(TVM_NDK_CC: the NDK's toolchains/llvm/prebuilt/{NDK_HOST}/bin/"
            f"aarch64-linux-android{spec.link['ndk_api']}-clang++), or set TVM_NDK_CC and recompile")
    (lib_dir / "README.txt").write_text(note + "\n")
    return "model.tar", note
