"""The llama.cpp that the reference tests compare against (tests/helpers/reference.py) is installed by
scripts/setup.sh, so those tests run instead of skipping: llama-cpp-python at the `bench` extra's version, built
for the baseline of the machines CI runs on (x86-64-v3: AVX2 and no AVX-512 or AMX, never -march=native), so the
same cached wheel runs on every machine of the kind."""

from __future__ import annotations

import platform
import re
import tomllib

import pytest

from compiler.data_files import CHECKOUT

# What an x86 build for machines without AVX-512 may not use (ggml reports its compile-time features).
BEYOND_THE_BASELINE = re.compile(r"^(AVX512\w*|AMX\w*|AVX_VNNI)$")


def _pinned_version() -> str:
    bench = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    (pin,) = [req for req in bench if req.startswith("llama-cpp-python==")]
    return pin.split("==")[1]


def built_features(system_info: str) -> set[str]:
    """The CPU features a llama.cpp build was compiled with, from llama_print_system_info ("AVX2 = 1 | ...")."""
    return {name for name, value in re.findall(r"(\w+) = (\w+)", system_info) if value == "1"}


def test_llama_cpp_is_installed_at_the_bench_extras_version():
    import llama_cpp  # an ImportError here is the failure: the reference tests would skip

    assert llama_cpp.__version__ == _pinned_version()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86 baseline")
def test_llama_cpp_is_built_for_avx2_without_avx512():
    import llama_cpp

    features = built_features(llama_cpp.llama_print_system_info().decode())
    assert {"AVX", "AVX2", "FMA", "F16C"} <= features, features
    assert not {name for name in features if BEYOND_THE_BASELINE.match(name)}, features
    # Negative control: a GGML_NATIVE build on an AVX-512 machine reports its AVX-512 features.
    native = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | AVX512_VNNI = 1 | "
    assert {name for name in built_features(native) if BEYOND_THE_BASELINE.match(name)} == {"AVX512", "AVX512_VNNI"}
