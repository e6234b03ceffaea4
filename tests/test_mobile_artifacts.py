"""A tiny Llama (SmolLM2's shape in miniature) compiled for every mobile target, once per session: library kinds,
artifact contents, the ARM dot-product GEMVs, NPU coverage, OpenCL source. SmolLM2 itself is compiled for the GPU
targets in runtime/test_smollm2_gpu_artifacts.py and for linux-arm64 in targets/test_smollm2_on_emulated_arm.py."""

import json
import platform
import re
import shutil
import struct
import subprocess
import tarfile

import pytest

from compiler.artifacts.artifact import CONFIG_FILE, PARAMS_INDEX
from compiler.artifacts.tvm_runtime_libraries import tvm_libraries
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.commands.package import ANDROID_README, package
from compiler.errors import MobilecError
from compiler.target.targets import load_target
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

pytestmark = pytest.mark.slow  # six compiles

EM_AARCH64, EM_HEXAGON = 183, 164
# One build per mobile target (q4f16_g32, the default for all of them) plus one float build on a GPU target.
BUILDS = [("android-adreno", "q4f16_g32"), ("android-mali", "q4f16_g32"), ("android-arm64", "q4f16_g32"),
          ("linux-arm64", "q4f16_g32"), ("hexagon-npu", "q4f16_g32"), ("android-mali", "q0f16")]


MODEL = "llama_gqa"


@pytest.fixture(scope="module")
def mobile_artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mobile")
    model = build_model(MODEL)
    checkpoint = save_compilable_checkpoint(model, root / "hf")
    built = {"num_layers": model.config.num_hidden_layers}
    for target, quant in BUILDS:
        out = root / f"{target}-{quant}"
        built[target, quant] = (out, compile_model(CompileOptions(str(checkpoint), target, quant, str(out),
                                                                  context_window=128, progress=False)))
    return built


def _e_machine(data: bytes) -> int:
    assert data[:4] == b"\x7fELF"
    return struct.unpack("<H", data[18:20])[0]


def _tar_objects(path):
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".o")}


@pytest.mark.parametrize("target,quant", BUILDS)
def test_artifact_contents(mobile_artifacts, target, quant):
    out, summary = mobile_artifacts[target, quant]
    config = json.loads((out / CONFIG_FILE).read_text())
    spec = load_target(target)
    assert config["target"]["name"] == target and config["target"]["file_sha256"] == spec.sha256
    assert config["quantization"]["name"] == quant
    index = json.loads((out / PARAMS_INDEX).read_text())
    assert index["tensors"] and all((out / "params" / s["file"]).stat().st_size == s["nbytes"] for s in index["shards"])
    assert (out / "tokenizer").is_dir()
    assert (out / config["library"]).is_file() and summary["build_seconds"] > 0


@pytest.mark.parametrize("target", ["android-adreno", "android-mali", "android-arm64"])
def test_android_without_ndk_is_objects_and_how_to_link(mobile_artifacts, target, monkeypatch):
    out, summary = mobile_artifacts[target, "q4f16_g32"]
    config = json.loads((out / CONFIG_FILE).read_text())
    if config["library"].endswith(".so"):
        pytest.skip("an NDK was configured (TVM_NDK_CC / ANDROID_NDK)")
    assert config["library"] == "lib/model.tar"
    objects = _tar_objects(out / config["library"])
    assert objects and {_e_machine(o) for o in objects.values()} == {EM_AARCH64}
    assert "TVM_NDK_CC" in summary["note"] and "TVM_NDK_CC" in (out / "lib" / "README.txt").read_text()


def test_linux_arm64_library_is_aarch64(mobile_artifacts):
    out, _ = mobile_artifacts["linux-arm64", "q4f16_g32"]
    lib = out / "lib" / "model.so"
    assert _e_machine(lib.read_bytes()[:64]) == EM_AARCH64
    if shutil.which("file"):
        assert "ARM aarch64" in subprocess.run(["file", str(lib)], capture_output=True, text=True).stdout


def _aarch64_mnemonics(path) -> set[str]:
    """The instructions of an aarch64 library or object, by binutils' cross objdump (installed with the cross g++)."""
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump is None:
        pytest.skip("aarch64-linux-gnu-objdump not found (apt-get install g++-aarch64-linux-gnu)")
    text = subprocess.run([objdump, "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"^\s+[0-9a-f]+:\s+[0-9a-f]{8}\s+([a-z][a-z0-9.]*)", text, flags=re.MULTILINE))


@pytest.mark.parametrize("target", ["linux-arm64", "android-arm64"])
def test_arm64_decode_gemvs_use_the_dot_product(mobile_artifacts, target, tmp_path):
    """The ARM libraries' decode GEMVs are the integer kernels (kernels/integer_dot_gemv/arm.py, `sdot`); the float
    GEMV they replace widened every code with a scalar `ucvtf`."""
    out, summary = mobile_artifacts[target, "q4f16_g32"]
    library = out / json.loads((out / CONFIG_FILE).read_text())["library"]
    if library.suffix == ".tar":
        with tarfile.open(library) as tar:
            tar.extractall(tmp_path, filter="data")
        files = sorted(tmp_path.rglob("*.o"))
    else:
        files = [library]
    mnemonics = set().union(*(_aarch64_mnemonics(f) for f in files))
    assert {"sdot", "addp", "scvtf"} <= mnemonics
    symbols = b"".join(f.read_bytes() for f in files)
    # the ARM target files' default int8 activations (compiled without --decode-activations), which also take
    # prefill to the integer GEMM (smmla with i8mm); the shards hold the codes in the ARM kernels' order
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["decode_activations"] == summary["decode_activations"] == "int8"
    assert config["quantization"]["code_order"] == "neon_pairs"  # 4-bit rows in pairs, a nibble each
    assert re.search(rb"integer_dot_gemv_int4_g32_sym_float16_a8_\w+_neonpairs_n\d+", symbols)
    assert not re.search(rb"integer_dot_gemv_\w+_a16_", symbols)
    assert re.search(rb"integer_dot_gemm_\w+", symbols)
    assert ("smmla" in mnemonics) == (target == "android-arm64")


def test_hexagon_objects_and_coverage(mobile_artifacts):
    out, summary = mobile_artifacts["hexagon-npu", "q4f16_g32"]
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["library"] == "lib/hexagon/kernels.o"
    assert _e_machine((out / config["library"]).read_bytes()[:64]) == EM_HEXAGON
    coverage = config["npu_coverage"]
    # int8 activations, the target's default: the matmuls are the HVX GEMV (decode) and GEMM (prefill)
    assert any(k.startswith("hvx_decode_gemv") for k in coverage["npu_kernels"])
    assert any(k.startswith("hvx_prefill_gemm") for k in coverage["npu_kernels"])
    assert any("paged_kv" in k for k in coverage["cpu_kernels"])
    # at least into and out of attention in each layer
    assert coverage["decode_crossings"] >= 2 * mobile_artifacts["num_layers"]
    assert "HEXAGON_TOOLCHAIN" in summary["note"]


@pytest.mark.parametrize("target,quant", [("android-adreno", "q4f16_g32"), ("android-mali", "q0f16")])
def test_opencl_source_compiles(mobile_artifacts, target, quant):
    out, _ = mobile_artifacts[target, quant]
    source = out / "lib" / "kernels.cl"
    assert source.read_text().count("__kernel void") > 10
    if shutil.which("clang") is None:
        pytest.skip("clang not installed (apt-get install clang)")
    result = subprocess.run(["clang", "-x", "cl", "-fsyntax-only", str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_linux_arm64_package_is_aarch64_and_finds_its_libraries(mobile_artifacts, tmp_path):
    """`mobilec package` cross-builds the runner and C API with Debian's aarch64 g++ against TVM's aarch64 runtime
    (downloaded once), and ships that runtime; the runner finds its libraries in ../lib (run on the emulated device in
    targets/test_smollm2_on_emulated_arm.py)."""
    if shutil.which("aarch64-linux-gnu-g++") is None:
        pytest.skip("aarch64-linux-gnu-g++ not found (apt-get install g++-aarch64-linux-gnu)")
    out, _ = mobile_artifacts["linux-arm64", "q4f16_g32"]
    summary = package(out, tmp_path / "arm")
    root = tmp_path / "arm"
    assert summary["arch"] == "aarch64" and summary["runner"] == "bin/mobilec-run"
    binaries = [root / "bin" / "mobilec-run", *(root / "lib" / name for name in
                                                 ("libmobilec.so", "libtvm_runtime.so", "libtvm_ffi.so", "model.so"))]
    assert {_e_machine(path.read_bytes()[:64]) for path in binaries} == {EM_AARCH64}
    dynamic = subprocess.run(["aarch64-linux-gnu-readelf", "-d", str(binaries[0])], capture_output=True, text=True,
                             check=True).stdout
    assert "$ORIGIN/../lib" in dynamic and "libmobilec.so" in dynamic


def test_android_package_is_the_sources_and_how_to_build_them(mobile_artifacts, tmp_path):
    out, _ = mobile_artifacts["android-arm64", "q4f16_g32"]
    summary = package(out, tmp_path / "android")
    root = tmp_path / "android"
    assert summary["runner"] is None and ANDROID_README in summary["note"]
    assert not (root / "bin").exists()
    assert {"mobilec.h", "mobilec_api.cc", "bpe_tokenizer.cc", "chat_prompt.cc", "sha256.cc", "runner.cc"} <= {p.name for p in (root / "src").iterdir()}
    readme = (root / ANDROID_README).read_text()
    assert "aarch64-linux-android28-clang++" in readme and "android.toolchain.cmake" in readme
    # mobilec_api.cc stops with #error without the versions it checks the artifact against
    assert all(f"-D{name}=" in readme for name in ("MOBILEC_VERSION", "MOBILEC_TVM_VERSION", "MOBILEC_TVM_FFI_VERSION"))
    assert "--tvm-runtime" in readme
    assert (root / "include" / "mobilec.h").is_file() and (root / CONFIG_FILE).is_file()


@pytest.mark.parametrize("target,quant", [("android-adreno", "q4f16_g32"), ("hexagon-npu", "q4f16_g32")])
def test_package_refuses_gpu_and_npu_artifacts(mobile_artifacts, target, quant, tmp_path):
    out, _ = mobile_artifacts[target, quant]
    with pytest.raises(MobilecError, match=f"targets {target} .*CPU artifacts only"):
        package(out, tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()


def _fake_ndk(root):
    """An NDK layout whose API-28 clang++ is Debian's aarch64 g++: it compiles and links what the NDK's would, for
    glibc instead of bionic (no NDK can be installed here), which is enough to check what is built and shipped."""
    if shutil.which("aarch64-linux-gnu-g++") is None:
        pytest.skip("aarch64-linux-gnu-g++ not found (apt-get install g++-aarch64-linux-gnu)")
    bin_dir = root / "toolchains" / "llvm" / "prebuilt" / "linux-x86_64" / "bin"
    bin_dir.mkdir(parents=True)
    clang = bin_dir / "aarch64-linux-android28-clang++"
    clang.write_text('#!/bin/sh\nexec aarch64-linux-gnu-g++ "$@"\n')
    clang.chmod(0o755)
    return root


def _runtime_dir(libraries, root):
    root.mkdir()
    for path in (libraries.runtime_library, libraries.ffi_library):
        shutil.copy2(path, root / path.name)
    return root


def test_android_package_with_a_tvm_runtime_builds_the_runner(tmp_path, monkeypatch):
    """With the NDK and TVM's runtime built for Android (--tvm-runtime), `mobilec package` builds the runner and C
    API for android-arm64 as it does for linux-arm64, and ships the given runtime."""
    monkeypatch.setenv("ANDROID_NDK", str(_fake_ndk(tmp_path / "ndk")))
    monkeypatch.delenv("TVM_NDK_CC", raising=False)
    checkpoint = save_compilable_checkpoint(build_model(MODEL), tmp_path / "hf")
    artifact = tmp_path / "artifact"
    compile_model(CompileOptions(str(checkpoint), "android-arm64", "q4f16_g32", str(artifact), context_window=128,
                                 progress=False))
    runtime = _runtime_dir(tvm_libraries("aarch64"), tmp_path / "tvm-android")
    summary = package(artifact, tmp_path / "pkg", tvm_runtime=runtime)
    root = tmp_path / "pkg"
    assert summary["arch"] == "aarch64" and summary["runner"] == "bin/mobilec-run"
    assert not (root / ANDROID_README).exists() and not (root / "src").exists()
    binaries = [root / "bin" / "mobilec-run", *(root / "lib" / name for name in
                                                 ("libmobilec.so", "libtvm_runtime.so", "libtvm_ffi.so", "model.so"))]
    assert {_e_machine(path.read_bytes()[:64]) for path in binaries} == {EM_AARCH64}
    assert (root / "lib" / "libtvm_runtime.so").read_bytes() == (runtime / "libtvm_runtime.so").read_bytes()
    dynamic = subprocess.run(["aarch64-linux-gnu-readelf", "-d", str(binaries[0])], capture_output=True, text=True,
                             check=True).stdout
    assert "$ORIGIN/../lib" in dynamic and "libmobilec.so" in dynamic

    # the refusals, each before anything is written
    for bad, message in [(_runtime_dir(tvm_libraries(platform.machine()), tmp_path / "x86"), "is not a 64-bit aarch64"),
                         (tmp_path / "empty", "has no libtvm_runtime.so")]:
        bad.mkdir(exist_ok=True)
        with pytest.raises(MobilecError, match=message):
            package(artifact, tmp_path / "refused", tvm_runtime=bad)
        assert not (tmp_path / "refused").exists()
    monkeypatch.delenv("ANDROID_NDK")
    with pytest.raises(MobilecError, match="needs the NDK's clang.*TVM_NDK_CC"):
        package(artifact, tmp_path / "refused", tvm_runtime=runtime)
    assert not (tmp_path / "refused").exists()


def test_tvm_runtime_refused_where_it_does_not_apply(mobile_artifacts, tmp_path, monkeypatch):
    """--tvm-runtime with an Android artifact of unlinked objects (compiled without the NDK), and with a
    linux-arm64 artifact (whose runtime comes from PyPI), is refused in one line."""
    runtime = tmp_path / "tvm-android"
    runtime.mkdir()
    monkeypatch.setenv("ANDROID_NDK", str(_fake_ndk(tmp_path / "ndk")))
    monkeypatch.delenv("TVM_NDK_CC", raising=False)
    android, _ = mobile_artifacts["android-arm64", "q4f16_g32"]
    if json.loads((android / CONFIG_FILE).read_text())["library"] == "lib/model.tar":
        with pytest.raises(MobilecError, match="lib/model.tar, not linked for Android.*compile it again"):
            package(android, tmp_path / "pkg", tvm_runtime=runtime)
    linux, _ = mobile_artifacts["linux-arm64", "q4f16_g32"]
    with pytest.raises(MobilecError, match="--tvm-runtime is for Android targets.*drop --tvm-runtime"):
        package(linux, tmp_path / "pkg", tvm_runtime=runtime)
    assert not (tmp_path / "pkg").exists()
