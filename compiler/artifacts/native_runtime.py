"""Builds the native runtime (native/runtime/): libmobilec.so, the C API of mobilec.h with its tokenizer, and the
mobilec-run command on it, against TVM's runtime libraries, into the layout a package ships:

    OUT/bin/mobilec-run                          finds its libraries in $ORIGIN/../lib (RUNPATH)
    OUT/lib/libmobilec.so                        finds TVM's beside it ($ORIGIN)
    OUT/lib/libtvm_runtime.so, libtvm_ffi.so     copied from the TVM build it was compiled against
    OUT/include/mobilec.h

For this machine with the system compiler and the venv's TVM (`build_runtime(out)`), or for a device with a cross
compiler and that device's TVM libraries (`build_runtime(out, "aarch64-linux-gnu-g++", TvmLibraries(...))`)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..data_files import data_dir
from ..errors import MobilecError
from ..user_cache import cache_path, keep_directory
from .artifact import installed_versions

SOURCE_DIR = data_dir("native") / "runtime"  # the checkout's, or the installed copy (pyproject data-files)
LIBRARY_SOURCES = ("mobilec_api.cc", "bpe_tokenizer.cc", "chat_prompt.cc", "sha256.cc")
RUNNER_SOURCES = ("runner.cc",)
PUBLIC_HEADER = "mobilec.h"
LIBRARY_NAME = "libmobilec.so"
RUNNER_NAME = "mobilec-run"
# The flags TVM's headers build with (scripts/build_opencl_runtime.sh); hidden visibility: the library exports
# only what mobilec.h marks MOBILEC_API.
CXX_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wno-unused-parameter")


@dataclasses.dataclass(frozen=True)
class TvmLibraries:
    """The TVM runtime a build links against: its headers, its two libraries, and the versions of the packages
    they come from (the runtime refuses artifacts compiled by other versions, as `mobilec generate` does)."""

    include_dirs: tuple[Path, ...]
    runtime_library: Path  # libtvm_runtime.so
    ffi_library: Path  # libtvm_ffi.so
    tvm_version: str  # apache-tvm's version, as artifacts record it
    tvm_ffi_version: str  # apache-tvm-ffi's


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # without importing it (tvm takes seconds)
    if spec is None or not spec.submodule_search_locations:
        raise MobilecError(f"the Python package {name} is not installed: run scripts/setup.sh first")
    return Path(list(spec.submodule_search_locations)[0])


def host_tvm_libraries() -> TvmLibraries:
    """The TVM runtime of this venv (apache-tvm and apache-tvm-ffi's wheels)."""
    tvm_dir, ffi_dir = _package_dir("tvm"), _package_dir("tvm_ffi")
    versions = installed_versions()
    return TvmLibraries(
        include_dirs=(tvm_dir / "include", ffi_dir / "include"),
        runtime_library=tvm_dir / "lib" / "libtvm_runtime.so",
        ffi_library=ffi_dir / "lib" / "libtvm_ffi.so",
        tvm_version=versions["apache-tvm"],
        tvm_ffi_version=versions["apache-tvm-ffi"],
    )


@dataclasses.dataclass(frozen=True)
class BuiltRuntime:
    root: Path
    runner: Path
    library: Path
    header: Path


def _run_compilers(commands: list[tuple[list[str], str]]) -> None:
    """Run the compiler commands side by side (one per source), each with what it builds; the first that fails,
    in the given order, is told in one line."""
    try:
        running = [(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), command,
                    what) for command, what in commands]
    except FileNotFoundError:
        raise MobilecError(f"the C++ compiler {commands[0][0][0]} is missing: install it (apt-get install g++, or the "
                           f"cross compiler for the device)") from None
    failures = []
    for process, command, what in running:
        stderr = process.communicate()[1]
        if process.returncode != 0:
            lines = stderr.splitlines()
            first = next((line for line in lines if "error" in line), lines[0] if lines else f"exit {process.returncode}")
            failures.append(f"{command[0]} failed {what}: {first.strip()}")
    if failures:
        raise MobilecError(failures[0])


def _cache_entry(compiler: str, flags: list[str], tvm_libs: TvmLibraries) -> Path | None:
    """Where a build with these inputs is kept (bin/, lib/libmobilec.so, include/): the compiler binary, the flags,
    every file of the runtime's sources and the TVM libraries linked against; None for a compiler not on PATH (the
    build then fails, naming it)."""
    binary = shutil.which(compiler)
    if binary is None:
        return None
    digest = hashlib.sha256()
    for path in (Path(binary).resolve(), tvm_libs.runtime_library, tvm_libs.ffi_library):
        stat = path.stat()
        digest.update(f"{path}|{stat.st_size}|{stat.st_mtime_ns}\0".encode())
    digest.update("\0".join([*flags, *map(str, tvm_libs.include_dirs)]).encode())
    for source in sorted(p for p in SOURCE_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(source.relative_to(SOURCE_DIR).as_posix().encode() + b"\0" + source.read_bytes())
    return cache_path("native-runtime", digest.hexdigest()[:24])


def _compile_into(staging: Path, compiler: str, flags: list[str], lib_dir: Path) -> None:
    """bin/mobilec-run, lib/libmobilec.so and include/mobilec.h built in `staging` (TVM's libraries already in
    `lib_dir`)."""
    objects = {source: staging / "obj" / f"{Path(source).stem}.o" for source in LIBRARY_SOURCES + RUNNER_SOURCES}
    _run_compilers([([compiler, *flags, "-c", str(SOURCE_DIR / source), "-o", str(obj)], f"on {source}")
                    for source, obj in objects.items()])
    _run_compilers([([compiler, "-shared", *(str(objects[s]) for s in LIBRARY_SOURCES), "-o",
                      str(lib_dir / LIBRARY_NAME), f"-Wl,-soname,{LIBRARY_NAME}", "-Wl,-rpath,$ORIGIN",
                      f"-L{lib_dir}", "-ltvm_runtime", "-ltvm_ffi"], f"linking {LIBRARY_NAME}")])
    _run_compilers([([compiler, *(str(objects[s]) for s in RUNNER_SOURCES), "-o", str(staging / "bin" / RUNNER_NAME),
                      "-Wl,-rpath,$ORIGIN/../lib", f"-L{lib_dir}", "-lmobilec"], f"linking {RUNNER_NAME}")])
    shutil.copy2(SOURCE_DIR / PUBLIC_HEADER, staging / "include" / PUBLIC_HEADER)


def build_runtime(out_dir: str | Path, compiler: str = "g++", tvm_libs: TvmLibraries | None = None,
                  extra_flags: tuple[str, ...] = ()) -> BuiltRuntime:
    """Compile the native runtime into `out_dir` (replaced if it holds an earlier build). Everything is written to
    a temporary directory beside it and renamed into place at the end: a failed build leaves no half-written
    output. A build is kept in mobilec's cache (_cache_entry) and copied from there when nothing it was built from
    changed: packaging again takes a second instead of half a minute per compiler."""
    tvm_libs = tvm_libs or host_tvm_libraries()
    for path in (tvm_libs.runtime_library, tvm_libs.ffi_library, *tvm_libs.include_dirs):
        if not path.exists():
            raise MobilecError(f"{path} is missing: the TVM runtime to build against is incomplete")
    out = Path(out_dir)
    if out.exists() and not (out / "bin" / RUNNER_NAME).is_file():
        raise MobilecError(f"{out} exists and is not a native runtime build; pick a new path")
    out.parent.mkdir(parents=True, exist_ok=True)
    versions = {"MOBILEC_VERSION": installed_versions()["mobilec"], "MOBILEC_TVM_VERSION": tvm_libs.tvm_version,
                "MOBILEC_TVM_FFI_VERSION": tvm_libs.tvm_ffi_version}
    flags = [*CXX_FLAGS, *extra_flags, *(f"-I{d}" for d in tvm_libs.include_dirs),
             *(f'-D{name}="{value}"' for name, value in versions.items())]
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would keep other users from running the build
    try:
        lib_dir = staging / "lib"
        for sub in ("bin", "lib", "include", "obj"):
            (staging / sub).mkdir()
        for tvm_library in (tvm_libs.runtime_library, tvm_libs.ffi_library):
            shutil.copy2(tvm_library, lib_dir / tvm_library.name)
        entry = _cache_entry(compiler, flags, tvm_libs)
        if entry is not None and entry.is_dir():
            shutil.copytree(entry, staging, dirs_exist_ok=True)
        else:
            _compile_into(staging, compiler, flags, lib_dir)
            if entry is not None:
                kept = Path(tempfile.mkdtemp(prefix=".kept.", dir=staging))
                for name in (f"bin/{RUNNER_NAME}", f"lib/{LIBRARY_NAME}", f"include/{PUBLIC_HEADER}"):
                    (kept / name).parent.mkdir(exist_ok=True)
                    shutil.copy2(staging / name, kept / name)
                keep_directory(kept, entry)
                shutil.rmtree(kept)
        shutil.rmtree(staging / "obj")
        if out.exists():
            previous = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            out.rename(previous / "build")
            staging.rename(out)
            shutil.rmtree(previous)
        else:
            staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return BuiltRuntime(out, out / "bin" / RUNNER_NAME, out / "lib" / LIBRARY_NAME, out / "include" / PUBLIC_HEADER)
