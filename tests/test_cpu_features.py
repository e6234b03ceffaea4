"""An artifact records the CPU it needs (architecture, instruction-set features) and a CPU that lacks one refuses it
with one line, before its library is loaded: code using a missing instruction would die with SIGILL and take the
whole process with it. Nothing here executes AVX-512 code on a CPU without it: an x86-64-v4 artifact is only
compiled, and only run where this CPU has avx512f (in-process, refused by a check fed an AVX2 CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tvm
from click.testing import CliRunner
from tvm.target.codegen import llvm_get_cpu_features

from compiler.artifacts.artifact import CONFIG_FILE, load_artifact
from compiler.commands.cli import main
from compiler.errors import MobilecError
from compiler.runtime import remote
from compiler.runtime.session import Session
from compiler.target import host
from compiler.target.cpu_check import Cpu, check_cpu, cpu_entry, this_cpu
from compiler.target.isa import code_cpu_isa
from compiler.target.targets import load_target
from compiler.testing.local_rpc import LocalProcess, start_server
from tests.helpers.compiled_once import tiny_compiled_once
from tests.test_bench_rpc import (
    BENCH_ARGS,
    _assert_one_line_error,
    _bench_in_process,
    _device_files,
)

pytestmark = pytest.mark.slow  # compiles for several CPUs and runs subprocesses: ~1.5 minutes

HOST_HAS_AVX512 = "avx512f" in host.host_features()
X86 = "x86_64-unknown-linux-gnu"


def _features(target_json: dict) -> frozenset[str]:
    return frozenset(str(f) for f in llvm_get_cpu_features(tvm.target.Target(target_json)))


V3_CPU = _features({"kind": "llvm", "mtriple": X86, "mcpu": "x86-64-v3"})  # Haswell-class: AVX2, no AVX-512
V4_CPU = _features({"kind": "llvm", "mtriple": X86, "mcpu": "x86-64-v4"})


def _config(target: str) -> dict:
    """What `mobilec compile` writes for a target, as far as the CPU check reads it."""
    spec = load_target(target)
    return {"target": {"name": spec.name, "tvm_target": spec.tvm_target_json}, "cpu": cpu_entry(code_cpu_isa(spec.tvm_target()))}


def _refusal(config: dict, cpu: Cpu) -> str:
    with pytest.raises(MobilecError) as err:
        check_cpu("build/x", config, cpu)
    message = str(err.value)
    assert "\n" not in message
    return message


# The check, fed CPU descriptions


def test_avx512_artifact_is_refused_by_an_avx2_cpu_naming_the_missing_features():
    message = _refusal(_config("x86-64-v4"), Cpu("an AVX2 CPU", "x86_64", V3_CPU, local=True))
    assert message.startswith("build/x is built for a CPU with avx512bw, avx512cd, avx512dq, avx512f, avx512vl "
                              "(target x86-64-v4); an AVX2 CPU lacks them: ")
    assert message.endswith("recompile with --target host or --target x86-64-v3")  # not x86-64-v4 again


def test_avx2_artifact_is_accepted_by_an_avx512_cpu():
    done = check_cpu("build/x", _config("x86-64-v3"), Cpu("an AVX-512 CPU", "x86_64", V4_CPU))
    assert done["arch_checked"] and done["features_checked"]
    assert "avx2" in done["required"]["required_features"] and "avx512f" not in done["required"]["required_features"]


def test_one_missing_feature_is_named_alone():
    message = _refusal(_config("x86-64-v3"), Cpu("a CPU without FMA", "x86_64", V3_CPU - {"fma"}))
    assert "built for a CPU with fma (target x86-64-v3); a CPU without FMA lacks it: " in message
    # A remote CPU gets no `--target host`; no fixed x86 target fits a CPU without FMA.
    assert message.endswith("recompile with a --target for x86_64")


def test_aarch64_artifact_is_refused_on_x86():
    message = _refusal(_config("linux-arm64"), Cpu("an x86 CPU", "x86_64", V4_CPU, local=True))
    assert message.startswith("build/x is built for aarch64 (target linux-arm64) but an x86 CPU is x86_64: ")
    assert "--target x86-64-v3" in message and "--target x86-64-v4" in message  # both fit this CPU


def test_gpu_and_hexagon_artifacts_record_their_host_cpu():
    assert _config("android-adreno")["cpu"]["arch"] == "aarch64"
    assert _config("hexagon-npu")["cpu"]["arch"] == "aarch64"
    _refusal(_config("android-adreno"), Cpu("an x86 CPU", "x86_64", V4_CPU))


def test_artifact_without_a_cpu_entry_is_checked_by_its_tvm_target():
    config = _config("x86-64-v4")
    del config["cpu"]  # written before the entry existed
    assert "avx512f" in _refusal(config, Cpu("an AVX2 CPU", "x86_64", V3_CPU))


def test_unknown_features_check_the_arch_only():
    assert check_cpu("build/x", _config("x86-64-v4"), Cpu("a device", "x86_64", None)) == {
        "required": _config("x86-64-v4")["cpu"], "arch_checked": True, "features_checked": False}
    assert "is x86_64" in _refusal(_config("linux-arm64"), Cpu("a device", "x86_64", None))
    nothing = check_cpu("build/x", _config("x86-64-v4"), Cpu("a device", None, None))
    assert not nothing["arch_checked"] and not nothing["features_checked"]


def test_this_cpu_passes_its_own_host_target():
    cpu = this_cpu()
    assert cpu.local and cpu.arch == "x86_64" and cpu.name.startswith("this CPU (")
    done = check_cpu("build/x", _config("host"), cpu)
    assert done["features_checked"]
    assert ("avx512f" in done["required"]["required_features"]) == HOST_HAS_AVX512


# The host target: a CPU name that promises AVX-512 the flags do not list

AVX2_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC (a VM that hides AVX-512)
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht \
syscall nx lm pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c abm bmi1 avx2 bmi2 adx sha_ni
"""


@pytest.mark.parametrize("cpu", ["znver4", "icelake-server"])
def test_host_target_drops_avx512_that_the_cpu_name_implies_but_the_flags_lack(cpu):
    flags = host.cpu_flags(AVX2_CPUINFO)
    assert "avx2" in flags and "avx512f" not in flags
    target = host.target_json_for("x86_64", cpu, flags, 2)
    assert target["mcpu"] == cpu and "-avx512f" in target["mattr"]
    features = _features(target)
    assert {"avx2", "fma", "bmi2"} <= features
    assert not {f for f in features if f.startswith("avx512")}
    # Negative control: the same name with AVX-512 flags keeps AVX-512.
    avx512_flags = flags | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    assert {"avx512f", "avx512bw"} <= _features(host.target_json_for("x86_64", cpu, avx512_flags, 2))


# End to end: tiny models compiled for x86-64-v4 (never run here without AVX-512) and for this machine


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    return {target: tiny_compiled_once(tmp_path_factory, "llama_gqa", target, "q0f32", context_window=64)
            for target in ("x86-64-v4", "host")}


def _generate(artifact: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "compiler", "generate", str(artifact), "--prompt", "the cat",
                           "--max-new-tokens", "2", *args], check=False, capture_output=True, text=True, timeout=300)


def test_compile_records_the_cpu_in_the_config(artifacts):
    v4 = json.loads((artifacts["x86-64-v4"] / CONFIG_FILE).read_text())["cpu"]
    assert v4["arch"] == "x86_64" and {"avx512f", "avx512bw", "avx2", "fma"} <= set(v4["required_features"])
    assert v4["isa"].startswith("x86_64, 512-bit vectors")
    here = json.loads((artifacts["host"] / CONFIG_FILE).read_text())["cpu"]
    assert set(here["required_features"]) <= host.host_features()


@pytest.mark.skipif(HOST_HAS_AVX512, reason="this CPU runs AVX-512: the in-process test below covers it")
def test_generate_refuses_an_avx512_artifact_on_this_avx2_cpu(artifacts):
    result = _generate(artifacts["x86-64-v4"])
    assert result.returncode == 2, result.stdout + result.stderr  # not -SIGILL
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"mobilec: error: {artifacts['x86-64-v4']} is built for a CPU with avx512bw, "), lines
    assert "avx512f" in lines[0] and "(target x86-64-v4); this CPU (" in lines[0]
    assert lines[0].endswith("recompile with --target host or --target x86-64-v3")
    assert result.stdout == ""


@pytest.mark.skipif(not HOST_HAS_AVX512, reason="this CPU lacks AVX-512: the subprocess test above covers it")
def test_generate_refuses_an_avx512_artifact_on_an_avx2_description(artifacts, monkeypatch):
    monkeypatch.setattr(host, "host_features", lambda: V3_CPU)
    result = CliRunner().invoke(main, ["generate", str(artifacts["x86-64-v4"]), "--prompt", "the cat"])
    assert result.exit_code == 2 and "avx512f" in result.stderr and "(target x86-64-v4)" in result.stderr


def test_session_refuses_before_loading_the_library(artifacts, monkeypatch):
    """The check runs before load_module: a library that is not even there is never reached."""
    art = load_artifact(artifacts["x86-64-v4"])
    monkeypatch.setattr(host, "host_features", lambda: V3_CPU)  # whatever this CPU is
    monkeypatch.setattr(tvm.runtime, "load_module", lambda *_: pytest.fail("the library was loaded"))
    with pytest.raises(MobilecError, match="avx512f"):
        Session(art)


def test_negative_control_host_artifact_passes_and_generates(artifacts):
    check_cpu(artifacts["host"], load_artifact(artifacts["host"]).config, this_cpu())
    result = _generate(artifacts["host"], "--json")
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["token_ids"]) == 2


# Over RPC: a device whose TVM has LLVM reports its CPU's features; a runtime-only one cannot


def _server(tmp: Path, env: dict[str, str] | None = None) -> tuple[LocalProcess, str]:
    return start_server(tmp / "server.log", env={"TMPDIR": str(tmp), **(env or {})})


@pytest.mark.skipif(HOST_HAS_AVX512, reason="the loopback device is this CPU, which runs AVX-512")
def test_bench_over_rpc_refuses_an_avx512_artifact_before_upload(artifacts, tmp_path):
    server, address = _server(tmp_path)
    try:
        line = _assert_one_line_error(_bench_in_process(artifacts["x86-64-v4"], *BENCH_ARGS, "--rpc", address),
                                      "avx512f", f"the RPC server at {address} lacks them")
        assert line.endswith("recompile with --target x86-64-v3")  # a remote device: no `--target host`
        assert _device_files(tmp_path, artifacts["x86-64-v4"]) == {}
        device = remote.connect(address, None, None, 60)
        try:  # this CPU's own artifact passes, its features checked
            assert device.description["cpu_features_from"] == "LLVM's host CPU features on the device"
            done = remote.check_runs_on(load_artifact(artifacts["host"]), device)
            assert done["arch_checked"] and done["features_checked"] and done["note"] is None
        finally:
            device.close()
    finally:
        server.kill()


def test_runtime_only_rpc_device_says_its_features_were_not_checked(artifacts, tmp_path):
    server, address = _server(tmp_path, {"TVM_USE_RUNTIME_LIB": "1"})
    try:
        device = remote.connect(address, None, None, 60)
        try:
            assert device.cpu.features is None and device.description["cpu_features_from"] is None
            done = remote.check_runs_on(load_artifact(artifacts["x86-64-v4"]), device)
        finally:
            device.close()
    finally:
        server.kill()
    assert not done["features_checked"] and "CPU features were not checked" in done["note"]
    assert done["required_features"] and "avx512f" in done["required_features"]
