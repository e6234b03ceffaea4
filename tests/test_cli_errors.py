"""Bad input: one line naming the problem, exit code 2, no traceback, no artifact left behind."""

import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from compiler.commands.cli import main
from compiler.target.targets import TARGETS_DIR
from tests.helpers.assertions import without_progress


def _run(args):
    result = CliRunner().invoke(main, args)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception  # a traceback reached the user: that is the bug
    return result


def _assert_one_line_error(result, *needles):
    assert result.exit_code == 2, result.output
    lines = without_progress(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("mobilec: error: ")
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def _compile(model, out, *extra):
    return _run(["compile", "--model", str(model), "--output", str(out), *extra])


def _assert_no_artifact(out):
    assert not out.exists()
    leftovers = [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")] if out.parent.exists() else []
    assert not leftovers


@pytest.fixture
def out(tmp_path):
    return tmp_path / "build" / "artifact"


def _hf_dir(tmp_path, config):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": np.ones(8, dtype="float32")}, str(d / "model.safetensors"))
    return d


def test_missing_path(tmp_path, out):
    _assert_one_line_error(_compile(tmp_path / "nope", out), "nope")
    _assert_no_artifact(out)


def test_directory_without_config(tmp_path, out):
    (tmp_path / "empty").mkdir()
    _assert_one_line_error(_compile(tmp_path / "empty", out), "config.json")
    _assert_no_artifact(out)


def test_unsupported_model_type_lists_supported(tmp_path, out):
    from compiler.models.registry import FAMILIES

    ckpt = _hf_dir(tmp_path, {"model_type": "qwen3_moe", "hidden_size": 8})
    supported = "gemma2, gemma3_text, llama, mistral, phi3, qwen2, qwen3"
    _assert_one_line_error(_compile(ckpt, out), "'qwen3_moe'", f"supported: {supported}")
    _assert_no_artifact(out)
    assert ", ".join(sorted(FAMILIES)) == supported


def test_compile_help_lists_the_supported_model_types():
    from click.testing import CliRunner

    from compiler.commands.cli import main
    from compiler.models.registry import FAMILIES

    text = " ".join(CliRunner().invoke(main, ["compile", "--help"]).output.split())
    assert "model_type is one of: llama (SmolLM2, TinyLlama, Llama 2, Llama 3.x); qwen2" in text
    assert all(f"{name} (" in text for name in FAMILIES)


def test_truncated_safetensors(tmp_path, out):
    ckpt = _hf_dir(tmp_path, {"model_type": "llama"})
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) - 10])
    _assert_one_line_error(_compile(ckpt, out), "model.safetensors")
    _assert_no_artifact(out)


def test_truncated_gguf(tmp_path, out):
    from compiler.loaders.default_model import default_model_path

    data = default_model_path().read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) // 2])
    _assert_one_line_error(_compile(bad, out), "cut.gguf")
    _assert_no_artifact(out)


@pytest.mark.parametrize("name", ["random.gguf", "random.bin"])
def test_random_bytes(tmp_path, out, name):
    bad = tmp_path / name
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _assert_one_line_error(_compile(bad, out), name)
    _assert_no_artifact(out)


def test_unknown_target_lists_valid_ones(tmp_path, out):
    _assert_one_line_error(_compile("default", out, "--target", "toaster"), "'toaster'", "host")
    _assert_no_artifact(out)


def test_unknown_quant_lists_valid_ones(tmp_path, out):
    _assert_one_line_error(_compile("default", out, "--quant", "q3f7"), "'q3f7'", "q0f32", "q0f16")
    _assert_no_artifact(out)


def test_int8_decode_activations_without_integer_gemvs_is_refused(tmp_path, out):
    """x86 (AVX2, AVX-512) and aarch64 (dotprod, i8mm) CPUs have integer decode GEMVs; a GPU target does not."""
    result = _compile("default", out, "--target", "android-adreno", "--decode-activations", "int8")
    _assert_one_line_error(result, "--decode-activations int8", "android-adreno", "aarch64", "drop the option")
    _assert_no_artifact(out)


def test_int8_default_of_a_target_without_integer_gemvs_is_refused(tmp_path, out):
    """A target file whose device.decode_activations asks for int8 on a GPU is refused by name: the option was not
    given, so the field is what to change."""
    path = tmp_path / "adreno-int8.toml"
    path.write_text((TARGETS_DIR / "android-adreno.toml").read_text().replace(
        'compute_dtype = "float16"\n', 'compute_dtype = "float16"\ndecode_activations = "int8"\n'))
    assert 'decode_activations = "int8"' in path.read_text()
    result = _compile("default", out, "--target", str(path))
    _assert_one_line_error(result, str(path), "device.decode_activations", "int8", "remove the field")
    _assert_no_artifact(out)


def test_generate_on_missing_artifact(tmp_path):
    _assert_one_line_error(_run(["generate", str(tmp_path / "none"), "--prompt", "hi"]), "does not exist")


def test_real_entry_point_prints_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "compiler", "compile", "--model", str(tmp_path / "x"), "--target", "host"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_corrupted_weight_shard_at_generate_time(tmp_path):
    from compiler.commands.compile_model import CompileOptions, compile_model
    from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

    save_compilable_checkpoint(build_model("llama_gqa"), tmp_path / "hf")
    art = tmp_path / "art"
    compile_model(CompileOptions(str(tmp_path / "hf"), "host", "q0f32", str(art), context_window=32, progress=False))
    ok = _run(["generate", str(art), "--prompt", "the cat", "--max-new-tokens", "2", "--json"])
    assert ok.exit_code == 0, ok.output
    shard = art / "params" / "shard_000.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    _assert_one_line_error(_run(["generate", str(art), "--prompt", "the cat"]), "shard_000.bin", "sha256")
