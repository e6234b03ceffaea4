"""What a board needs to serve itself to mobilec, as a folder to copy there: the device server (device_server.py,
standard library and TVM only), the OpenCL device built for the board's CPU (scripts/build_opencl_runtime.sh) and
a requirements.txt with the TVM versions that library was linked against."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from pathlib import Path

from . import device_server
from .errors import MobilecError

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT / "scripts" / "build_opencl_runtime.sh"
# The OpenCL device each --arch builds (the script's outputs).
LIBRARIES = {"aarch64": ROOT / "build" / "native" / "aarch64" / device_server.OPENCL_LIBRARY,
             "host": ROOT / "build" / "native" / device_server.OPENCL_LIBRARY}
# What the server imports: TVM's runtime (the versions the library links) and the RPC server's dependencies.
PACKAGES = ("apache-tvm", "apache-tvm-ffi", "tornado", "cloudpickle", "psutil")


def build_opencl_library(arch: str) -> Path:
    """The OpenCL device for `arch`, built if it is not up to date."""
    if not BUILD_SCRIPT.is_file():
        raise MobilecError(f"{BUILD_SCRIPT} is missing: run mobilec board-folder from a mobilec checkout")
    built = subprocess.run(["bash", str(BUILD_SCRIPT), "--arch", arch], capture_output=True, text=True)
    if built.returncode != 0:
        lines = built.stderr.strip().splitlines() or [f"exit code {built.returncode}"]
        raise MobilecError(f"building the OpenCL device for {arch} failed: {lines[-1]}")
    return LIBRARIES[arch]


def requirements() -> str:
    """requirements.txt: this machine's versions of PACKAGES (the board's TVM must be the one the library links)."""
    pins = []
    for name in PACKAGES:
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            raise MobilecError(f"{name} is not installed here: run scripts/setup.sh") from None
    return "\n".join(pins) + "\n"


def write_board_folder(directory: Path, arch: str) -> dict[str, str]:
    """Write (or update) the folder; return its files by role and the command that serves the board."""
    if arch not in LIBRARIES:
        raise MobilecError(f"--arch {arch} is not supported; use one of {', '.join(LIBRARIES)}")
    if directory.exists() and not directory.is_dir():
        raise MobilecError(f"{directory} is a file; give a folder to write the device server into")
    library = build_opencl_library(arch)
    directory.mkdir(parents=True, exist_ok=True)
    server = directory / Path(device_server.__file__).name
    shutil.copyfile(device_server.__file__, server)
    shutil.copyfile(library, directory / device_server.OPENCL_LIBRARY)
    (directory / device_server.REQUIREMENTS).write_text(requirements())
    return {"folder": str(directory), "server": str(server), "opencl_library": str(directory / library.name),
            "requirements": str(directory / device_server.REQUIREMENTS),
            "install": f"python3 -m pip install -r {directory.name}/{device_server.REQUIREMENTS}",
            "serve": f"python3 {directory.name}/{server.name} --tracker HOST:9190 --key KEY"}
