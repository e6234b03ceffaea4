"""`mobilec package`: an artifact laid out with the native C API and runner for its target, runnable without Python.

    DIR/mobilec-config.json, lib/model.so, params/, tokenizer/   the artifact, as compiled
    DIR/bin/mobilec-run                                           the runner (finds its libraries in ../lib)
    DIR/lib/libmobilec.so, libtvm_runtime.so, libtvm_ffi.so      the C API and TVM's runtime for the target's CPU
    DIR/include/mobilec.h                                         the C API's one header
    DIR/mobilec-package.json                                      what was built, for which target, with which versions

`DIR/bin/mobilec-run DIR --prompt ...` then runs with a bare environment. The host is built with this machine's
C++ compiler, linux-arm64 with Debian's cross compiler against TVM's aarch64 runtime (tvm_runtime_libraries.py).
Android needs TVM's runtime built for Android (bionic), which the PyPI wheels do not hold: given one
(`tvm_runtime`, a directory with its two libraries) and the NDK (TVM_NDK_CC or ANDROID_NDK), the runner is built
with the NDK's clang++ as for linux-arm64; otherwise an Android package holds the artifact, the header, the native
sources and a README saying how to build them with the NDK.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from ..artifacts import native_runtime
from ..artifacts.artifact import CONFIG_FILE, file_manifest, foreign_files, installed_versions, load_artifact
from ..artifacts.export import atomic_directory
from ..artifacts.tvm_runtime_libraries import host_arch, libraries_in, tvm_libraries
from ..codegen import link
from ..errors import MobilecError
from ..target.targets import load_target

PACKAGE_FILE = "mobilec-package.json"
ANDROID_README = "README-android.md"
# target link method -> how the runner is built
BUILDABLE = ("native", "cross")


def owned_entries(root: Path) -> list[str] | None:
    """The output rule's test for a package: None when `root` is not one; else the files in it that are neither
    the artifact's nor the package's (a user's), which replacing it would delete."""
    artifact_foreign = foreign_files(root)
    try:
        listed = json.loads((root / PACKAGE_FILE).read_text(encoding="utf-8")).get("files")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    if artifact_foreign is None or not isinstance(listed, dict):
        return None
    return [name for name in artifact_foreign if name not in listed and name != PACKAGE_FILE]


def _arch(mtriple: str) -> str:
    return mtriple.split("-", 1)[0]


def _copy_artifact(source: Path, files: list[str], dest: Path) -> None:
    """The artifact's files, copied (hard links would let an edit of one change the other)."""
    for name in [CONFIG_FILE, *files]:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / name, target)


def _android_readme(spec) -> str:
    api = spec.link.get("ndk_api", 28)
    versions = installed_versions()
    defines = (f'-DMOBILEC_VERSION=\\"{versions["mobilec"]}\\" -DMOBILEC_TVM_VERSION=\\"{versions["apache-tvm"]}\\" '
               f'-DMOBILEC_TVM_FFI_VERSION=\\"{versions["apache-tvm-ffi"]}\\"')
    return f"""# Building the runner for Android ({spec.name})

PyPI has TVM's runtime only for glibc Linux, and Android's C library is bionic, so this package holds what the
build needs instead of binaries: the artifact (lib/model.so or lib/model.tar), include/mobilec.h and src/ (the C API,
the tokenizer and the runner). Not checked on a phone by mobilec's tests: no NDK is installed where they run.

1. TVM's runtime for arm64-v8a, from the TVM release the artifact was compiled with (mobilec-package.json,
   "versions"):

       git clone --recursive --branch v<apache-tvm version> https://github.com/apache/tvm && cd tvm
       cmake -S . -B build-android -DCMAKE_TOOLCHAIN_FILE=$ANDROID_NDK/build/cmake/android.toolchain.cmake \\
             -DANDROID_ABI=arm64-v8a -DANDROID_PLATFORM=android-{api} -DUSE_LLVM=OFF -DUSE_LIBBACKTRACE=OFF
       cmake --build build-android --target tvm_runtime -j

   gives libtvm_runtime.so and libtvm_ffi.so (under build-android/lib or build-android/ffi).
2. The C API and the runner, with the NDK's clang for API {api}. mobilec does it: with TVM_NDK_CC (or ANDROID_NDK)
   set, `mobilec package ARTIFACT -o DIR --tvm-runtime <the directory of step 1's two libraries>` builds DIR/bin
   and DIR/lib as for linux-arm64 (the artifact must hold lib/model.so: compile it with the NDK set too). By hand:

       CXX=$ANDROID_NDK/toolchains/llvm/prebuilt/linux-x86_64/bin/aarch64-linux-android{api}-clang++
       $CXX -std=c++17 -O2 -fPIC -fvisibility=hidden -shared -Isrc -I<tvm>/include -I<tvm>/ffi/include \\
            -I<tvm>/ffi/3rdparty/dlpack/include \\
            {defines} \\
            src/mobilec_api.cc src/bpe_tokenizer.cc src/chat_prompt.cc src/sha256.cc \\
            -L<libs> -ltvm_runtime -ltvm_ffi -o lib/libmobilec.so
       $CXX -std=c++17 -O2 -Isrc src/runner.cc -Llib -lmobilec -L<libs> -ltvm_runtime -ltvm_ffi \\
            -Wl,-rpath,'$ORIGIN/../lib' -o bin/mobilec-run

   and copy libtvm_runtime.so and libtvm_ffi.so into lib/. If lib/ holds model.tar instead of model.so, link it
   first: `mkdir o && tar -xf lib/model.tar -C o && $CXX -shared -fPIC -o lib/model.so o/*.o -lm`.
3. On the phone: `adb push` this directory to /data/local/tmp/mobilec, then
   `adb shell /data/local/tmp/mobilec/bin/mobilec-run /data/local/tmp/mobilec --prompt "Hello"`.
   In an app: load libmobilec.so from the APK's jniLibs/arm64-v8a (with libtvm_runtime.so and libtvm_ffi.so),
   copy the artifact's files to the app's files directory and open it with the C API (docs/deploying.md in mobilec, "Inside an app").
"""


def _build_plan(artifact, spec, method: str, arch: str, tvm_runtime) -> tuple[str, Any] | None:
    """The C++ compiler and TVM runtime the runner is built with, or None for an Android package of sources (no
    --tvm-runtime). Everything that would stop the build is refused here, before anything is written."""
    if method in BUILDABLE:
        compiler = "g++" if method == "native" else spec.link["compiler"]
        if shutil.which(compiler) is None:
            hint = spec.link.get("package", "g++") if spec is not None else "g++"
            raise MobilecError(f"C++ compiler {compiler} not found; install it with `apt-get install {hint}`")
        return compiler, tvm_libraries(arch)
    if tvm_runtime is None:
        return None
    compiler = link.ndk_compiler(spec)
    if compiler is None:
        raise MobilecError("building the runner for Android needs the NDK's clang++: set TVM_NDK_CC to it, or "
                           "ANDROID_NDK to the NDK (r23+)")
    if artifact.config["library"] != "lib/model.so":
        raise MobilecError(f"{artifact.path} holds {artifact.config['library']}, not linked for Android (compiled "
                           f"without the NDK): compile it again with TVM_NDK_CC or ANDROID_NDK set, then package it")
    return compiler, libraries_in(tvm_runtime, arch)


def package(artifact_path: str | Path, output: str | Path, target: str | None = None,
            overwrite: bool = False, tvm_runtime: str | Path | None = None) -> dict[str, Any]:
    """Build the package of `artifact_path` into `output`; returns what --json prints. `tvm_runtime`: a directory
    with TVM's runtime built for Android (android-arm64 only), which with the NDK builds the runner too."""
    started = time.perf_counter()
    artifact = load_artifact(artifact_path)
    config = artifact.config
    built_for = config["target"]["name"]
    if target is not None and target != built_for:
        raise MobilecError(f"{artifact.path} was compiled for target {built_for}, not {target}: package it with "
                           f"--target {built_for}, or compile it again with --target {target}")
    tvm_target = config["target"]["tvm_target"]
    if tvm_target.get("kind") != "llvm":
        raise MobilecError(f"{artifact.path} targets {built_for} ({tvm_target.get('kind')}); the native runner drives "
                           f"CPU artifacts only (host, linux-arm64, android-arm64): run it with `mobilec generate`, "
                           f"or compile for a CPU target")
    spec = load_target(built_for) if built_for != "host" else None
    method = spec.link["method"] if spec is not None else "native"
    arch = _arch(tvm_target.get("mtriple", host_arch()))
    if method == "native" and arch != host_arch():
        raise MobilecError(f"{artifact.path} was compiled for a {arch} host, and this machine is {host_arch()}: "
                           f"package it on that machine, or compile it here again")
    if method not in (*BUILDABLE, "ndk"):
        raise MobilecError(f"the native runner cannot be built for target {built_for} (link method {method}); "
                           f"CPU targets only: host, linux-arm64, android-arm64")
    if tvm_runtime is not None and method != "ndk":
        raise MobilecError(f"--tvm-runtime is for Android targets, whose TVM runtime PyPI does not carry; {built_for} "
                           f"uses the runtime of the pinned apache-tvm wheels: drop --tvm-runtime")
    build = _build_plan(artifact, spec, method, arch, tvm_runtime)
    artifact_files = sorted(config["files"])
    with atomic_directory(Path(output), overwrite, name="--output", owned=owned_entries,
                          what="a mobilec package") as tmp:
        _copy_artifact(artifact.path, artifact_files, tmp)
        if build is not None:
            built = native_runtime.build_runtime(tmp / ".runtime", *build)
            for sub in ("bin", "lib", "include"):  # beside the artifact's lib/model.so
                (tmp / sub).mkdir(exist_ok=True)
                for path in (built.root / sub).iterdir():
                    path.rename(tmp / sub / path.name)
            shutil.rmtree(built.root)
            note = None
        else:
            (tmp / "include").mkdir()
            shutil.copy2(native_runtime.SOURCE_DIR / native_runtime.PUBLIC_HEADER, tmp / "include")
            shutil.copytree(native_runtime.SOURCE_DIR, tmp / "src", ignore=shutil.ignore_patterns("*.py"))
            (tmp / ANDROID_README).write_text(_android_readme(spec))
            note = (f"no Android build of TVM's runtime exists on PyPI: {ANDROID_README} in the package says how to "
                    f"build it and the runner with the NDK (or pass --tvm-runtime DIR with it, and the NDK, to "
                    f"build the runner here)")
        package_files = sorted(set(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
                               - set(artifact_files) - {CONFIG_FILE})
        summary = {
            "package": str(Path(output).resolve()),
            "artifact": str(artifact.path),
            "target": built_for,
            "arch": arch,
            "runner": "bin/mobilec-run" if (tmp / "bin" / "mobilec-run").is_file() else None,
            "bytes": sum((tmp / n).stat().st_size for n in [CONFIG_FILE, *artifact_files, *package_files]),
            "versions": installed_versions(),
            "note": note,
        }
        (tmp / PACKAGE_FILE).write_text(json.dumps({**summary, "files": file_manifest(tmp, names=package_files)}, indent=1))
    summary["seconds"] = round(time.perf_counter() - started, 1)
    return summary
