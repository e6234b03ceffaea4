"""Target files: every shipped one loads; a bad or incomplete one fails with one line naming the field."""

import json
import shutil
import tomllib

import pytest
from click.testing import CliRunner

from compiler.codegen import link
from compiler.commands.cli import main
from compiler.errors import MobilecError
from compiler.target import host
from compiler.target.isa import cpu_isa
from compiler.target.targets import TARGETS_DIR, available_targets, load_target

SHIPPED = ["android-adreno", "android-arm64", "android-mali", "hexagon-npu", "host", "linux-arm64",
           "x86-64-v3", "x86-64-v4"]


def test_every_target_loads():
    assert sorted(available_targets()) == SHIPPED
    for name in SHIPPED:
        spec = load_target(name)
        assert spec.name == name and len(spec.sha256) == 64


def test_targets_command_lists_each_file_with_its_defaults():
    """`mobilec targets` (text and --json): every shipped file with its default scheme and, where its CPU has integer
    decode GEMVs, the activations compile picks without --decode-activations (int8 on the ARM and Hexagon files, which say so;
    int16 on x86, whose files name none; none on a GPU)."""
    result = CliRunner().invoke(main, ["targets", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.output)["targets"]}
    assert sorted(rows) == SHIPPED
    assert {name: rows[name]["decode_activations"] for name in ("android-arm64", "linux-arm64", "x86-64-v3",
                                                                "x86-64-v4", "android-adreno", "hexagon-npu")} == {
        "android-arm64": "int8", "linux-arm64": "int8", "x86-64-v3": "int16", "x86-64-v4": "int16",
        "android-adreno": None, "hexagon-npu": "int8"}
    assert all(row["default_quant"] == load_target(name).device["default_quant"] for name, row in rows.items())
    # a GGUF file's own blocks where integer-dot kernels take them
    assert [name for name, row in rows.items() if row["default_quant_gguf"] == "gguf"] == [
        name for name, row in rows.items() if row["decode_activations"]]
    text = CliRunner().invoke(main, ["targets"]).output.splitlines()
    assert [line.split()[:5] for line in text if line.split()[0] in ("android-arm64", "android-mali")] == [
        ["android-arm64", "llvm", "q4f16_g32", "int8", "gguf"],
        ["android-mali", "opencl", "q4f16_g32", "-", "q4f16_g32"]]


def test_host_is_this_machine():
    """No pinned CPU: LLVM's name for this one, num-cores the usable cores, RAM and bandwidth of this machine."""
    spec = load_target("host")
    target = spec.tvm_target_json
    assert target["num-cores"] == host.usable_cores() and target == host.host_target_json()
    assert tomllib.loads((TARGETS_DIR / "host.toml").read_text())["tvm"]["target"] == "detect"
    assert spec.device["ram_gb"] == round(host.ram_gb(), 2) and spec.device["memory_bandwidth_gbs"] > 0.5
    # every feature the host target enables is one this CPU has (flags cut what the CPU name implies)
    isa = cpu_isa(spec.tvm_target())
    flags = host.cpu_flags()
    assert all(host.feature_flags(isa.arch)[f] in flags for f in isa.required_features)


def test_fixed_x86_levels():
    v3, v4 = (cpu_isa(load_target(name).tvm_target()) for name in ("x86-64-v3", "x86-64-v4"))
    assert (v3.vector_bits, v3.vector_registers, v3.int_dot) == (256, 16, "avx2") and "avx512f" not in v3.features
    assert (v4.vector_bits, v4.vector_registers, v4.int_dot) == (512, 32, "avx512bw")


@pytest.mark.parametrize("old,new,needle", [
    ('memory_bandwidth_gbs = "measure"', "memory_bandwidth_gbs = 0.0", "must be a positive number"),
    ('memory_bandwidth_gbs = "measure"', 'memory_bandwidth_gbs = "fast"', '"measure"'),
    ('ram_gb = "detect"', "ram_gb = -1.0", "must be a positive number"),
    ('target = "detect"', 'target = { kind = "llvm", mtriple = "x86_64-unknown-linux-gnu", mcpu = "not-a-cpu" }',
     "LLVM knows no CPU 'not-a-cpu'"),
])
def test_bad_host_values_are_named(tmp_path, old, new, needle):
    with pytest.raises(MobilecError) as err:
        load_target(_edited(tmp_path, "host", old, new))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_gpu_limits_become_tvm_attributes():
    target = load_target("android-adreno").tvm_target()
    assert int(target.attrs["max_function_args"]) == 128
    assert int(target.attrs["max_num_threads"]) == 1024
    assert "android" in str(target.host)
    assert load_target("android-adreno").device["max_alloc_gb"] == 1.0


def test_mali_has_its_own_tiles():
    adreno, mali = load_target("android-adreno").schedule, load_target("android-mali").schedule
    assert mali["gemv"] != adreno["gemv"] and mali["matmul"] != adreno["matmul"]


def _write(tmp_path, name, text):
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return str(path)


def _edited(tmp_path, source, old, new):
    text = (TARGETS_DIR / f"{source}.toml").read_text()
    assert old in text
    return _write(tmp_path, "edited", text.replace(old, new))


@pytest.mark.parametrize("old,new,needle", [
    ("max_kernel_args = 128\n", "", "device.max_kernel_args"),
    ("ts = 2\n", "", "schedule.gemv.ts"),
    ("ts = 2\n", "ts = \"two\"\n", "schedule.gemv.ts"),
    ("unroll = 8\n", "unroll = 8\nunrol = 8\n", "schedule.gemv.unrol"),
    ('method = "ndk"', 'method = "fax"', "link.method"),
    ("ndk_api = 28\n", "", "link.ndk_api"),
    ('row_threads = "threadIdx.x"', 'row_threads = "threadIdx.q"', "schedule.gemv.row_threads"),
    ("use_shared = false", "use_shared = 0", "schedule.matmul.use_shared"),
])
def test_bad_field_is_named(tmp_path, old, new, needle):
    with pytest.raises(MobilecError) as err:
        load_target(_edited(tmp_path, "android-adreno", old, new))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_not_toml(tmp_path):
    with pytest.raises(MobilecError, match="not valid TOML"):
        load_target(_write(tmp_path, "broken", "name = [\n"))


def test_unknown_target_lists_valid_ones():
    with pytest.raises(MobilecError) as err:
        load_target("android-toaster")
    for name in SHIPPED:
        assert name in str(err.value)


def test_a_new_target_is_just_a_file(tmp_path):
    path = _edited(tmp_path, "android-mali", 'name = "android-mali"', 'name = "my-phone"')
    spec = load_target(path)
    assert spec.name == "my-phone" and spec.tvm_target().kind.name == "opencl"
    assert tomllib.loads((TARGETS_DIR / "android-mali.toml").read_text())["schedule"] == spec.schedule


def test_missing_cross_compiler_says_how_to_install(tmp_path):
    path = _edited(tmp_path, "linux-arm64", 'compiler = "aarch64-linux-gnu-g++"', 'compiler = "no-such-g++"')
    with pytest.raises(MobilecError) as err:
        link.check_toolchain(load_target(path))
    assert "no-such-g++" in str(err.value) and "apt-get install g++-aarch64-linux-gnu" in str(err.value)


def test_android_ndk_without_compiler(tmp_path, monkeypatch):
    monkeypatch.delenv("TVM_NDK_CC", raising=False)
    monkeypatch.setenv("ANDROID_NDK", str(tmp_path))
    with pytest.raises(MobilecError, match="aarch64-linux-android28-clang\\+\\+"):
        link.check_toolchain(load_target("android-arm64"))


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None, reason="scripts/setup.sh installs it")
def test_cross_compiler_present():
    link.check_toolchain(load_target("linux-arm64"))


def test_cli_bad_target_file_is_one_line(tmp_path):
    from click.testing import CliRunner  # pylint: disable=import-outside-toplevel

    from compiler.commands.cli import main  # pylint: disable=import-outside-toplevel

    path = _edited(tmp_path, "linux-arm64", 'compiler = "aarch64-linux-gnu-g++"', 'compiler = "no-such-g++"')
    result = CliRunner().invoke(main, ["compile", "--target", path, "--output", str(tmp_path / "out")])
    assert result.exit_code == 2 and not (tmp_path / "out").exists()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "apt-get install g++-aarch64-linux-gnu" in lines[0]
