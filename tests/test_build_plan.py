"""BuildPlan: every target file resolves to the facts its kernels need, bad options are refused in one line, the
pipeline reads the plan instead of the target, and a compile derives each target fact once."""

import dataclasses
import sys

import pytest

from compiler.codegen import pipeline
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.kernels import integer_dot_gemm, integer_dot_gemv
from compiler.model_import import kv_cache_dtype
from compiler.model_import.importer import keeps_gguf_blocks
from compiler.target import isa
from compiler.target.build_plan import resolve_plan
from compiler.target.targets import available_targets, load_target
from tests.helpers.assertions import assert_mobilec_error
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint


@pytest.mark.parametrize("name", list(available_targets()))
def test_every_target_file_resolves(name):
    plan = resolve_plan(name)
    assert plan.spec.name == name and plan.scheme.name == plan.spec.device["default_quant"]
    assert plan.gpu == (plan.spec.schedule["rules"] == "gpu")
    # only an LLVM CPU target has kernels of its own instruction set; GPU and Hexagon code runs beside a host CPU
    assert (plan.isa is not None) == (plan.spec.tvm_target_json["kind"] == "llvm")
    assert plan.cpu is not None  # every shipped target builds CPU code (its own, or its host's)
    assert (plan.attention_lanes is None) == plan.gpu
    assert plan.decode_activations == plan.spec.decode_activations
    assert plan.gemm_family is None or (plan.gemv_family is not None and plan.decode_activations == "int8")
    assert not (plan.gemm_family and plan.gemv_prefill)  # one integer prefill path at most
    assert plan.kv_dtype in kv_cache_dtype.TVM_DTYPES.values()


def test_facts_of_the_x86_arm_gpu_and_npu_targets():
    v3 = resolve_plan("x86-64-v3")
    assert (v3.isa.arch, v3.isa.vector_bits, v3.gemv_family, v3.gemm_family) == ("x86_64", 256, "avx2", None)
    assert (v3.code_order, v3.decode_activations, v3.attention_lanes) == ("plain", "int16", 8)
    assert (v3.scheme.name, v3.compute_dtype, v3.kv_dtype) == ("q4f16_g32", "float32", "float16")
    assert resolve_plan("x86-64-v4").attention_lanes == 16
    # prefill in integers with int8 activations only; x86 has no integer GEMM, so its batched GEMV takes prefill
    assert not v3.gemv_prefill and resolve_plan("x86-64-v3", decode_activations="int8").gemv_prefill
    arm = resolve_plan("android-arm64")
    assert (arm.isa.arch, arm.gemv_family, arm.gemm_family, arm.code_order) == ("aarch64", "i8mm", "i8mm",
                                                                                 "neon_pairs")
    assert (arm.decode_activations, arm.attention_lanes, arm.gemv_prefill) == ("int8", 4, False)
    # int16 activations keep the float prefill: no integer GEMM
    assert resolve_plan("android-arm64", decode_activations="int16").gemm_family is None
    adreno = resolve_plan("android-adreno")
    assert adreno.gpu and adreno.isa is None and adreno.cpu.arch == "aarch64"  # the host's, for the config's "cpu"
    assert (adreno.gemv_family, adreno.gemm_family, adreno.attention_lanes) == (None, None, None)
    assert (adreno.code_order, adreno.compute_dtype, adreno.kv_dtype) == ("plain", "float16", "float16")
    assert not adreno.integer_decode
    npu = resolve_plan("hexagon-npu")
    assert not npu.gpu and npu.isa is None and npu.gemv_family is None
    assert npu.attention_lanes == 4  # the KV cache's kernels run on its ARM host


def test_options_resolve_with_the_target():
    pocl = resolve_plan("android-adreno", "q4f32_g32", host_target="host", compute_dtype="float32")
    assert pocl.spec.overrides == {"host_target": "host", "compute_dtype": "float32"}
    assert pocl.cpu == isa.code_cpu_isa(load_target("host").tvm_target())
    assert (pocl.compute_dtype, pocl.kv_dtype) == ("float32", "float32")
    assert resolve_plan("host", "q0f32").kv_dtype == "float32"  # the reference build rounds nothing
    assert resolve_plan("x86-64-v3", kv_dtype="int4").kv_dtype == "int4"
    spec = load_target("linux-arm64")
    assert resolve_plan(spec).spec is spec  # a loaded file is taken as it is
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolve_plan("host").kv_dtype = "float16"


@pytest.mark.parametrize("name", list(available_targets()))
def test_a_gguf_file_keeps_its_own_blocks_where_integer_dot_kernels_take_them(name):
    """Without --quant a GGUF input is `gguf` on targets with integer decode GEMVs (CPU integer-dot ones, hexagon-npu's
    HVX GEMV: the fast path, and no second rounding of weights already quantized); elsewhere, and for an HF
    directory, the target file's; --quant wins."""
    spec_default = load_target(name).device["default_quant"]
    gguf = resolve_plan(name, gguf_keepable=True)
    assert gguf.scheme.name == ("gguf" if gguf.integer_decode else spec_default)
    assert resolve_plan(name).scheme.name == spec_default
    assert resolve_plan(name, "q4f32_g32", gguf_keepable=True).scheme.name == "q4f32_g32"


def test_which_targets_default_to_a_ggufs_blocks():
    assert {name: resolve_plan(name, gguf_keepable=True).scheme.name for name in (
        "x86-64-v3", "android-arm64", "android-adreno", "hexagon-npu")} == {
        "x86-64-v3": "gguf", "android-arm64": "gguf", "android-adreno": "q4f16_g32", "hexagon-npu": "gguf"}


def test_a_gguf_with_a_type_gguf_cannot_keep_defaults_to_the_targets_scheme(tmp_path):
    """A GGUF holding a Q5_0 tensor (dequantized by the float schemes, refused by `gguf`) keeps the target file's
    default instead of failing for an option the user never gave; the SmolLM2 GGUF (Q4_1, Q8_0) is kept."""
    import numpy as np  # noqa: PLC0415
    from gguf import GGMLQuantizationType, GGUFWriter  # noqa: PLC0415

    assert keeps_gguf_blocks("default") and not keeps_gguf_blocks({"model_type": "llama"})
    path = tmp_path / "q5_0.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("w", np.zeros((1, 22), np.uint8), raw_dtype=GGMLQuantizationType.Q5_0)  # one 32-value block
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert not keeps_gguf_blocks(str(path)) and not keeps_gguf_blocks(str(tmp_path))


def test_the_commands_tell_the_plan_whether_the_model_is_a_gguf_file(tmp_path, monkeypatch):
    """compile, estimate, inspect and tune pass gguf_keepable from the model they are given (negative control: an HF
    directory); each stops at the spy, before any import."""
    from compiler.commands import compile_model as compile_command, estimate, inspect_ir, tune  # noqa: PLC0415

    hf = save_compilable_checkpoint(build_model("llama_gqa"), tmp_path / "hf")
    seen = []

    class Resolved(Exception):
        pass

    def spy(*_args, gguf_keepable=False, **_kwargs):
        seen.append(gguf_keepable)
        raise Resolved

    runs = {
        compile_command: lambda model: compile_model(CompileOptions(model, "host", output=str(tmp_path / "o"))),
        estimate: lambda model: estimate.estimate_memory(estimate.EstimateOptions(model)),
        inspect_ir: lambda model: inspect_ir.inspect_model(inspect_ir.InspectOptions(model)),
        tune: lambda model: tune.tune(tune.TuneOptions(model=model)),
    }
    for module, run in runs.items():
        monkeypatch.setattr(module, "resolve_plan", spy)
        for model, expected in (("default", True), (str(hf), False)):
            with pytest.raises(Resolved):
                run(model)
            assert seen.pop() is expected, (module.__name__, model)


@pytest.mark.parametrize("target,options,fragments", [
    ("mars", {}, ("unknown target 'mars'", "host")),
    ("host", {"quant": "q3"}, ("unknown quantization 'q3'", "q4f16_g32")),
    ("host", {"decode_activations": "int4"}, ("--decode-activations 'int4'", "int16, int8")),
    ("android-adreno", {"decode_activations": "int8"}, ("--decode-activations int8", "drop the option")),
    ("host", {"kv_dtype": "q4_0"}, ("--kv-dtype 'q4_0'", "f16")),
    ("hexagon-npu", {"kv_dtype": "int8"}, ("--kv-dtype int8 on hexagon-npu", "use f16")),
    ("android-adreno", {"kv_dtype": "f16", "compute_dtype": "float32"}, ("--kv-dtype f16", "use --kv-dtype f32")),
    ("host", {"host_target": "linux-arm64"}, ("--host-target applies to GPU and NPU targets", "drop the option")),
    ("host", {"compute_dtype": "bfloat16"}, ("--compute-dtype", "float16")),
])
def test_bad_options_are_refused_in_one_line(target, options, fragments):
    assert_mobilec_error(lambda: resolve_plan(target, **options), *fragments)


def test_a_target_files_decode_activations_need_integer_gemvs(tmp_path):
    text = load_target("android-adreno").path.read_text()
    (tmp_path / "gpu-int8.toml").write_text(text.replace("[device]\n", '[device]\ndecode_activations = "int8"\n'))
    assert_mobilec_error(lambda: resolve_plan(str(tmp_path / "gpu-int8.toml")),
                         "field 'device.decode_activations' = 'int8'", "remove the field")


def test_the_pipeline_reads_the_plan_not_the_target():
    """A plan edited against its target: the steps follow the plan (negative control for a re-derivation)."""
    plan = resolve_plan("x86-64-v3")
    names = [name for name, _ in pipeline.steps(plan)]
    assert "integer-dot-gemv" in names and "cpu-attention" in names
    edited = dataclasses.replace(plan, gemv_family=None, attention_lanes=None)
    names = [name for name, _ in pipeline.steps(edited)]
    assert "integer-dot-gemv" not in names and "cpu-attention" not in names
    assert "integer-dot-gemm" in [name for name, _ in pipeline.steps(dataclasses.replace(plan, gemm_family="i8mm"))]


def _counting(monkeypatch, owner, name: str) -> list:
    """Counts the calls of `owner.name` through every module of the package that holds it."""
    original, calls = getattr(owner, name), []

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    for module in [m for n, m in sys.modules.items() if n.startswith("compiler")]:
        if getattr(module, name, None) is original:
            monkeypatch.setattr(module, name, counted)
    return calls


def test_a_compile_resolves_each_target_fact_once(tmp_path, monkeypatch):
    checkpoint = save_compilable_checkpoint(build_model("llama_gqa"), tmp_path / "hf")
    isa_calls = _counting(monkeypatch, isa, "cpu_isa")
    kv_calls = _counting(monkeypatch, kv_cache_dtype, "resolve")
    gemv_calls = _counting(monkeypatch, integer_dot_gemv, "family")
    gemm_calls = _counting(monkeypatch, integer_dot_gemm, "family")
    summary = compile_model(CompileOptions(str(checkpoint), "x86-64-v3", "q4f16_g32", str(tmp_path / "art"),
                                           context_window=64, progress=False, decode_activations="int8"))
    assert summary["decode_activations"] == "int8"
    assert (len(isa_calls), len(kv_calls), len(gemv_calls)) == (1, 1, 1), (isa_calls, kv_calls, gemv_calls)
    assert len(gemm_calls) == 1  # int8 activations: the GEMM family is asked, once
