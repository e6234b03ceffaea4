"""The OpenCL device for TVM's runtime: our C++ (native/opencl/), built by scripts/build_opencl_runtime.sh into
build/native/libmobilec_opencl.so, because the apache-tvm wheel's runtime has no OpenCL.

`load()` puts it into this process once: it registers "device_api.opencl" (so `tvm.opencl(0)` exists and tensors
live there) and "ffi.Module.load_from_bytes.opencl" (so `tvm.runtime.load_module` reads the OpenCL kernels a
compiled library embeds). Call it before loading an OpenCL artifact. `available()` says whether it can.

Which platform: MOBILEC_OPENCL_PLATFORM, a case-insensitive part of the platform's name, vendor or version
("intel": Intel's CPU runtime, the one here with cl_khr_fp16; "pocl"); unset, the first platform with a GPU, else
the first with any device. The platforms are those of the ICD files in OCL_ICD_VENDORS, or else of the folder
scripts/setup.sh writes (the system's ICD files and Intel's runtime from the venv).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import tvm

from ..errors import MobilecError

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "build" / "native" / "libmobilec_opencl.so"
SOURCES = ROOT / "native" / "opencl"
BUILD = "scripts/build_opencl_runtime.sh"
INSTALL = "apt-get install ocl-icd-opencl-dev pocl-opencl-icd (or the GPU's OpenCL driver)"
PLATFORM_VARIABLE = "MOBILEC_OPENCL_PLATFORM"  # read by native/opencl/opencl_device.cc
VENDORS = ROOT / "build" / "native" / "opencl-vendors"

_lock = threading.Lock()
_library: ctypes.CDLL | None = None


class NoOpenCLPlatform(MobilecError):
    """The library loads, but the OpenCL ICD loader finds no platform or no device."""


def library_path() -> Path:
    return LIBRARY


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _stale() -> bool:
    """Sources newer than the library (checked only where the sources are, i.e. in a checkout)."""
    if not SOURCES.is_dir():
        return False
    built = LIBRARY.stat().st_mtime
    return any(p.stat().st_mtime > built for p in SOURCES.iterdir() if p.suffix in (".cc", ".h"))


def use_installed_platforms() -> None:
    """Point this process's OpenCL ICD loaders (the system's, and pyopencl's own) at the platforms scripts/setup.sh
    registered, unless OCL_ICD_VENDORS says otherwise; before the first OpenCL call, which reads it once."""
    if "OCL_ICD_VENDORS" not in os.environ and VENDORS.is_dir():
        os.environ["OCL_ICD_VENDORS"] = str(VENDORS)


def describe(function=tvm.get_global_func) -> dict[str, str | bool] | None:
    """The OpenCL platform and device that kernels run on, from the device's runtime (`function`: a global
    function lookup, local or over RPC); None for a runtime that is not ours (a TVM with its own OpenCL)."""
    try:
        text = function("mobilec.opencl.describe")(0)
    except (AttributeError, ValueError):  # how a missing function shows over RPC, and locally
        return None
    platform, device, version, fp16 = str(text).split("\t")
    return {"platform": platform, "device": device, "version": version, "fp16": fp16 == "fp16"}


def load() -> None:
    """Load the OpenCL device into this process (once); MobilecError, naming the fix, where it cannot."""
    global _library
    use_installed_platforms()
    with _lock:
        if _library is None:
            if tvm.get_global_func("device_api.opencl", allow_missing=True) is not None:
                _library = ctypes.CDLL(None)  # this TVM has its own OpenCL runtime: use it
            else:
                if not LIBRARY.is_file():
                    raise MobilecError(f"the OpenCL runtime is not built ({_shown(LIBRARY)}): run {BUILD}")
                if _stale():
                    raise MobilecError(f"the OpenCL runtime is older than native/opencl/: run {BUILD}")
                try:
                    _library = ctypes.CDLL(str(LIBRARY), mode=ctypes.RTLD_GLOBAL)
                except OSError as exc:
                    detail = str(exc).splitlines()[0]
                    raise MobilecError(f"cannot load the OpenCL runtime ({detail}): {INSTALL}, then run {BUILD}") \
                        from None
    count = tvm.get_global_func("mobilec.opencl.num_devices", allow_missing=True)
    if count is not None and count() == 0:
        reason = tvm.get_global_func("mobilec.opencl.init_error")()
        fix = "unset it or name one of those" if reason.startswith(PLATFORM_VARIABLE) else INSTALL
        raise NoOpenCLPlatform(f"no OpenCL device: {reason}: {fix}")


def available() -> bool:
    """Whether OpenCL kernels can run in this process (loading the device if needed)."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why OpenCL kernels cannot run in this process (load's message, naming the fix), or None where they can."""
    try:
        load()
    except MobilecError as exc:
        return str(exc)
    return None if tvm.opencl(0).exist else "no OpenCL device 0 in this process"


def runnable(module):
    """The OpenCL kernels of a module that `tvm.compile` returned, made launchable in this process.

    In memory, `tvm.compile` leaves the codegen's OpenCL placeholder under the host module, which refuses to run
    (this TVM has no OpenCL runtime); each is replaced, in place, by this runtime's module built from the same
    bytes. Takes an Executable (or a runtime Module) and returns it. Artifacts saved with `export_library` and read
    with `tvm.runtime.load_module` need none of this: they load this runtime's module directly.
    """
    load()
    convert = tvm.get_global_func("mobilec.opencl.module_from", allow_missing=True)
    if convert is None:  # a TVM with its own OpenCL runtime: its modules launch already
        return module
    root = getattr(module, "mod", module)

    def visit(m):
        imports = list(m.imports)
        if any(i.kind == "opencl" for i in imports):
            m.clear_imports()
            for i in imports:
                m.import_module(convert(i) if i.kind == "opencl" else i)
        for i in m.imports:
            if i.kind != "opencl":
                visit(i)

    visit(root)
    return module
