"""The native runtime (native/runtime), built once per test session with the system compiler into a packaged layout
(bin/, lib/, include/) by compiler/artifacts/native_runtime.py."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from compiler.artifacts.native_runtime import build_runtime

COMPILER = os.environ.get("CXX", "g++")


@pytest.fixture(scope="session")
def runner(tmp_path_factory) -> Path:
    """mobilec-run; its library and header are in ../lib and ../include."""
    if shutil.which(COMPILER) is None:
        pytest.skip(f"no C++ compiler ({COMPILER}) to build the native runtime")
    return build_runtime(tmp_path_factory.mktemp("native") / "runtime", compiler=COMPILER).runner


def c_client(runner: Path, source: str, folder: Path) -> Path:
    """A C program of `source` built against the runtime's mobilec.h and libmobilec (skips without a C compiler)."""
    c_compiler = shutil.which("cc") or shutil.which("gcc")
    if c_compiler is None:
        pytest.skip("no C compiler (cc) to build a C client")
    root = runner.parent.parent
    path, program = folder / "client.c", folder / "client"
    path.write_text(source)
    subprocess.run([c_compiler, "-std=c99", "-Wall", "-Werror", f"-I{root / 'include'}", str(path), "-o",
                    str(program), f"-L{root / 'lib'}", "-lmobilec", f"-Wl,-rpath,{root / 'lib'}"], check=True)
    return program
