"""TVM's runtime libraries (libtvm_runtime.so, libtvm_ffi.so) and headers for a CPU architecture: a native runner
links against them and ships them. This machine's come from the installed packages; another architecture's from
the PyPI wheels of the same versions for it, downloaded once (only the two libraries are kept, in mobilec's cache:
the aarch64 apache-tvm wheel is ~100 MB, its runtime 3 MB)."""

from __future__ import annotations

import platform
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import MobilecError
from ..user_cache import cache_path
from .artifact import installed_versions
from .native_runtime import TvmLibraries, host_tvm_libraries

# architecture -> the wheel platform tags of its Linux builds (the newest first)
WHEEL_PLATFORMS = {"aarch64": ("manylinux_2_28_aarch64", "manylinux2014_aarch64")}
# (distribution, path of the library inside its wheel)
LIBRARIES = (("apache-tvm", "tvm/lib/libtvm_runtime.so"), ("apache-tvm-ffi", "tvm_ffi/lib/libtvm_ffi.so"))
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


def host_arch() -> str:
    return platform.machine()


def tvm_libraries(arch: str) -> TvmLibraries:
    """TVM's runtime for `arch` ("x86_64", "aarch64"): this venv's for this machine, else the wheels' for `arch`,
    downloaded once."""
    if arch == host_arch():
        return host_tvm_libraries()
    if arch not in WHEEL_PLATFORMS:
        raise MobilecError(f"no TVM runtime wheels are known for the {arch} architecture (known: "
                           f"{', '.join([host_arch(), *WHEEL_PLATFORMS])})")
    pins = {name: installed_versions()[name] for name, _ in LIBRARIES}
    entry = cache_path("tvm-runtime", f"{arch}-" + "-".join(f"{n}{v}" for n, v in sorted(pins.items())))
    runtime, ffi = (entry / Path(path).name for _, path in LIBRARIES)
    if not (runtime.is_file() and ffi.is_file()):
        _download(arch, pins, entry)
    host = host_tvm_libraries()  # the headers are the same for every architecture
    return TvmLibraries(host.include_dirs, runtime, ffi, pins["apache-tvm"], pins["apache-tvm-ffi"])


def _download(arch: str, pins: dict[str, str], entry: Path) -> None:
    """pip download of the wheels for `arch`; the two libraries extracted into `entry` (complete or absent)."""
    print(f"downloading TVM's {arch} runtime ({', '.join(f'{n}=={v}' for n, v in pins.items())}) from PyPI, once",
          file=sys.stderr)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=entry.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--quiet", "--no-deps",
                   "--only-binary=:all:", "--implementation", "cp", "--python-version", PYTHON_VERSION,
                   *(f"--platform={tag}" for tag in WHEEL_PLATFORMS[arch]), "-d", tmp,
                   *(f"{name}=={version}" for name, version in pins.items())]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise MobilecError(f"could not download TVM's {arch} runtime wheels from PyPI ({last}); check the "
                               f"network or pip's index settings")
        out = Path(tmp) / "libs"
        out.mkdir()
        for name, member in LIBRARIES:
            wheel = next(Path(tmp).glob(f"{name.replace('-', '_')}-*.whl"), None)
            if wheel is None:
                raise MobilecError(f"pip downloaded no {name} wheel for {arch}")
            with zipfile.ZipFile(wheel) as archive:
                (out / Path(member).name).write_bytes(archive.read(member))
        try:
            out.rename(entry)
        except OSError:  # another process kept them first
            if not entry.is_dir():
                raise


# ELF e_machine of the architectures a runtime directory may hold libraries for
ELF_MACHINES = {"aarch64": 183, "x86_64": 62}


def _elf_machine(path: Path) -> int | None:
    """The e_machine of a little-endian 64-bit ELF file, or None for anything else."""
    try:
        with path.open("rb") as file:
            header = file.read(20)
    except OSError:
        return None
    if len(header) < 20 or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
        return None
    return int.from_bytes(header[18:20], "little")


def libraries_in(directory: str | Path, arch: str) -> TvmLibraries:
    """TVM's runtime built by the user for a platform PyPI has no wheel for (Android): libtvm_runtime.so and
    libtvm_ffi.so in `directory`, for `arch`, of the installed apache-tvm version (the headers are this venv's)."""
    root = Path(directory)
    paths = [root / Path(path).name for _, path in LIBRARIES]
    for path in paths:
        if not path.is_file():
            raise MobilecError(f"--tvm-runtime {root} has no {path.name}: point it at the directory holding "
                               f"libtvm_runtime.so and libtvm_ffi.so built for the device")
        if _elf_machine(path) != ELF_MACHINES[arch]:
            raise MobilecError(f"{path} is not a 64-bit {arch} shared library: build TVM's runtime for the device "
                               f"(README-android.md in a package made without --tvm-runtime says how)")
    pins = installed_versions()
    host = host_tvm_libraries()
    return TvmLibraries(host.include_dirs, paths[0], paths[1], pins["apache-tvm"], pins["apache-tvm-ffi"])
