"""`mobilec estimate` and compile's fit check: weights against compiled artifacts, Llama-2-7B's published sizes,
the KV cache formula, refusal of a model too big for a target, and the CLI."""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from compiler.artifacts.artifact import CONFIG_FILE, load_artifact
from compiler.commands.cli import main
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.commands.estimate import GIB, EstimateOptions, estimate_memory, pipeline_activations, plan_activations
from compiler.loaders import ConfigCheckpoint
from compiler.model_import.importer import import_model
from compiler.models.sliding_layers import FULL, SLIDING
from compiler.target.build_plan import resolve_plan
from compiler.target.targets import TARGETS_DIR
from tests.helpers.assertions import assert_mobilec_error, without_progress
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

pytestmark = pytest.mark.slow  # compiles SmolLM2: ~6 minutes

LLAMA_7B_CONFIG = Path(__file__).parent / "data" / "llama-2-7b-config.json"
JSON_KEYS = {"weights_bytes", "kv_cache_bytes", "activation_bytes", "margin_bytes", "total_bytes", "ram_bytes", "fits",
             "largest_buffer_bytes", "largest_buffer_name", "max_alloc_bytes", "bytes_per_token", "decode_floor_ms",
             "memory_bandwidth_gbs", "context", "kv_dtype", "context_by_kv_dtype"}


def _run(args):
    result = CliRunner().invoke(main, args)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.fixture(scope="module")
def llama_7b_dir(tmp_path_factory) -> Path:
    """Llama-2-7B as a directory with its config.json and no weights."""
    d = tmp_path_factory.mktemp("llama-2-7b")
    shutil.copy(LLAMA_7B_CONFIG, d / "config.json")
    return d


def _estimate_json(*args) -> dict:
    result = _run(["estimate", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def llama_7b_adreno(llama_7b_dir) -> dict:
    return _estimate_json("--model", str(llama_7b_dir), "--target", "android-adreno", "--quant", "q4f16_g32",
                          "--context-window", "4096")


# ---------------------------------------------------------------- activations planned on the first layers


@pytest.mark.parametrize("name,changes,kept", [
    ("llama_gqa", {"num_hidden_layers": 5}, ()),
    ("gemma3", {"num_hidden_layers": 5, "layer_types": [SLIDING, SLIDING, SLIDING, FULL, SLIDING]},
     (SLIDING, SLIDING, SLIDING, FULL)),
    ("qwen3", {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3},
     (FULL, FULL, FULL, SLIDING)),
    ("qwen3", {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
     (SLIDING, SLIDING)),
])
def test_the_first_layers_keep_every_attention_kind(name, changes, kept):
    """LlamaConfig.first_layers(2): two layers, or as many as hold one of each attention kind, their kinds kept."""
    ckpt = ConfigCheckpoint(build_model(name, **changes).config.to_dict(), name)
    cut = import_model(ckpt, resolve_plan("host", "q0f32"), 64, export=False, first_layers=2).cfg
    assert cut.num_hidden_layers == max(2, len(kept)) and getattr(cut, "layer_types", ()) == kept


@pytest.mark.parametrize("name,changes,target", [
    ("llama_gqa", {"num_hidden_layers": 5}, "android-adreno"),
    ("gemma3", {"num_hidden_layers": 5, "layer_types": [SLIDING, SLIDING, SLIDING, FULL, SLIDING]}, "x86-64-v3"),
])
def test_the_first_layers_plan_the_whole_models_activations(name, changes, target):
    """plan_activations (the model cut to its first layers) gives the same storage and kernel scratch as the whole
    model's memory plan, on a GPU and a CPU target (integer-dot GEMVs and chained kernels)."""
    ckpt = ConfigCheckpoint(build_model(name, **changes).config.to_dict(), name)
    plan = resolve_plan(target, "q4f16_g32")
    whole = pipeline_activations(import_model(ckpt, plan, 64).mod, plan)
    assert str(plan_activations(ckpt, plan, 64, [])) == str(whole)


# ---------------------------------------------------------------- (a) weights as compile writes them


@pytest.fixture(scope="module")
def smollm2_q4f16_g32(tmp_path_factory, smollm2_gguf) -> Path:
    out = tmp_path_factory.mktemp("artifacts") / "smollm2-q4f16_g32"
    compile_model(CompileOptions(str(smollm2_gguf), "host", "q4f16_g32", str(out), context_window=512, progress=False))
    return out


@pytest.mark.parametrize("artifact_fixture,quant", [
    pytest.param("smollm2_q0f32", "q0f32", marks=pytest.mark.extended),
    pytest.param("smollm2_q4f16_g32", "q4f16_g32", marks=pytest.mark.extended),  # a SmolLM2 compile of its own
    ("smollm2_gguf_exact", "gguf")])
def test_smollm2_weights_match_the_compiled_params(request, smollm2_gguf, artifact_fixture, quant):
    artifact = load_artifact(request.getfixturevalue(artifact_fixture), verify_checksums=False)
    stored = sum(t["nbytes"] for t in artifact.index["tensors"])
    kv_dtype = {"float32": "f32", "float16": "f16"}[artifact.config["kv_dtype"]]
    est = estimate_memory(EstimateOptions(str(smollm2_gguf), "host", quant, 512, kv_dtype=kv_dtype))
    assert abs(est.weights_bytes - stored) <= 0.01 * stored
    # SmolLM2 ties its embeddings: the table is the output layer, read in full per token.
    kv_read = 30 * 2 * 3 * 64 * 512 * {"f32": 4, "f16": 2}[kv_dtype]
    assert est.bytes_per_token == est.weights_bytes + kv_read
    # compile checked and stored the same estimate, for `bench` to read
    assert artifact.config["memory_estimate"] == est.to_json()


# ---------------------------------------------------------------- (b) Llama-2-7B from its config.json alone


def test_llama_7b_int4_weights_in_the_published_range(llama_7b_adreno):
    assert 3.5e9 <= llama_7b_adreno["weights_bytes"] <= 4.0e9


def test_llama_7b_kv_cache_is_2_gib_at_4096_in_fp16(llama_7b_adreno):
    layers, kv_heads, head_dim, context, fp16 = 32, 32, 128, 4096, 2
    assert layers * 2 * kv_heads * head_dim * context * fp16 == 2 * GIB
    # TVM's paged cache holds one page (16 tokens) more than the context needs
    assert llama_7b_adreno["kv_cache_bytes"] == 2 * GIB * (context + 16) // context
    assert llama_7b_adreno["context"] == context and llama_7b_adreno["dtype"] == "float16"


def test_llama_7b_reads_one_embedding_row_per_token(llama_7b_adreno):
    row = 4096 + 4096 // 32 * 2  # int8 codes + float16 scales per group of 32
    table = 32000 * row
    assert llama_7b_adreno["bytes_per_token"] == llama_7b_adreno["weights_bytes"] - table + row + 2 * GIB
    assert llama_7b_adreno["decode_floor_ms"] == pytest.approx(llama_7b_adreno["bytes_per_token"] / 67e9 * 1e3)


def test_llama_7b_int4_fits_12_gb_phones(llama_7b_adreno, llama_7b_dir):
    assert llama_7b_adreno["fits"] and llama_7b_adreno["ram_bytes"] == 12 * GIB
    assert llama_7b_adreno["total_bytes"] == pytest.approx(1.2 * (llama_7b_adreno["weights_bytes"] +
                                                                  llama_7b_adreno["kv_cache_bytes"] +
                                                                  llama_7b_adreno["activation_bytes"]), abs=1)
    arm64 = _estimate_json("--model", str(llama_7b_dir), "--target", "android-arm64", "--quant", "q4f16_g32",
                           "--context-window", "4096", "--kv-dtype", "f32")
    # a float32 KV cache on the ARM CPU: twice the bytes, still within 12 GiB
    assert arm64["kv_cache_bytes"] == 2 * llama_7b_adreno["kv_cache_bytes"] and arm64["fits"]


def test_llama_7b_float32_does_not_fit_and_names_what_would():
    est = estimate_memory(EstimateOptions(json.loads(LLAMA_7B_CONFIG.read_text()), "android-adreno", "q0f32", 4096))
    assert not est.fits and est.total_bytes > est.ram_bytes
    assert est.fitting_quant == "q8f16_g128" and est.fitting_quant_total_bytes <= est.ram_bytes
    assert est.fitting_context is None  # the float32 weights alone are over 12 GiB


@pytest.mark.parametrize("kv_dtype,fitting", [("f32", 4096), ("f16", 8192)])
def test_llama_7b_long_context_names_a_shorter_one(llama_7b_dir, kv_dtype, fitting):
    est = estimate_memory(EstimateOptions(str(llama_7b_dir), "android-arm64", "q4f16_g32", 32768, kv_dtype=kv_dtype))
    assert not est.fits
    # 8192 tokens of float32 KV cache are 8 GiB on top of 3.6 GiB of weights; of float16, 4 GiB
    assert est.fitting_context == fitting


# ---------------------------------------------------------------- (c) compile refuses what does not fit


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny") / "hf"
    save_compilable_checkpoint(build_model("llama_gqa"), d)
    return d


def _target_with_ram(tmp_path: Path, ram_bytes: int) -> Path:
    text = (TARGETS_DIR / "host.toml").read_text().replace('name = "host"', 'name = "tiny-ram"')
    # host.toml reads RAM from this machine ("detect"); the largest allocation cannot exceed the RAM
    for field in ("ram_gb", "max_alloc_gb"):
        assert f'{field} = "detect"' in text
        text = text.replace(f'{field} = "detect"', f"{field} = {ram_bytes / GIB!r}")
    path = tmp_path / "tiny-ram.toml"
    path.write_text(text)
    return path


def test_compile_refuses_a_model_over_the_target_ram(tiny_hf, tmp_path):
    q0f32 = estimate_memory(EstimateOptions(str(tiny_hf), "host", "q0f32", 32))
    q4 = estimate_memory(EstimateOptions(str(tiny_hf), "host", "q4f16_g32", 32))
    target = _target_with_ram(tmp_path, (q0f32.total_bytes + q4.total_bytes) // 2)
    out = tmp_path / "build" / "tiny"
    args = ["compile", "--model", str(tiny_hf), "--target", str(target), "--quant", "q0f32", "--context-window", "32",
            "-o", str(out)]
    refused = _run(args)
    assert refused.exit_code == 2, refused.output
    lines = without_progress(refused.stderr)
    message = lines[0]
    assert len(lines) == 1 and message.startswith("mobilec: error: "), refused.stderr
    for needle in ("does not fit tiny-ram", "over the", " by ", "--quant q", "fits", "--force"):
        assert needle in message, message
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))

    forced = _run([*args, "--force"])
    assert forced.exit_code == 0, forced.output
    stored = json.loads((out / CONFIG_FILE).read_text())["memory_estimate"]
    assert stored["fits"] is False and stored["total_bytes"] == q0f32.total_bytes
    assert stored["bytes_per_token"] > 0


# ---------------------------------------------------------------- (d) the CLI


def test_estimate_json_has_the_documented_keys(tiny_hf):
    est = _estimate_json("--model", str(tiny_hf), "--quant", "q4f16_g32", "--context-window", "64")
    assert JSON_KEYS <= set(est)
    assert est["total_bytes"] == est["weights_bytes"] + est["kv_cache_bytes"] + est["activation_bytes"] + \
        est["margin_bytes"]


def test_estimate_prints_the_budget_table(tiny_hf):
    result = _run(["estimate", "--model", str(tiny_hf), "--quant", "q4f16_g32", "--context-window", "64"])
    assert result.exit_code == 0, result.output
    for row in ("weights", "KV cache @ 64", "activations", "margin 20%", "total", "largest buffer", "bytes/token",
                "ms/token", "tok/s"):
        assert row in result.stdout, result.stdout


def test_compile_still_needs_weights(llama_7b_dir, tmp_path):
    result = _run(["compile", "--model", str(llama_7b_dir), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "no weight files" in result.stderr


# ---------------------------------------------------------------- (e) negative controls


def test_estimate_grows_with_context():
    config = build_model("llama_gqa").config.to_dict()
    short, long = (estimate_memory(EstimateOptions(config, "host", "q4f16_g32", context)) for context in (64, 128))
    assert long.kv_cache_bytes > short.kv_cache_bytes and long.total_bytes > short.total_bytes
    assert long.bytes_per_token > short.bytes_per_token and long.weights_bytes == short.weights_bytes


def test_float32_weights_outweigh_int4():
    config = build_model("llama_gqa").config.to_dict()
    q0f32, q4 = (estimate_memory(EstimateOptions(config, "host", quant, 64)) for quant in ("q0f32", "q4f16_g32"))
    assert q0f32.weights_bytes > 2 * q4.weights_bytes and q0f32.decode_floor_ms > q4.decode_floor_ms


def test_unknown_target_is_one_line(tiny_hf):
    assert_mobilec_error(lambda: estimate_memory(EstimateOptions(str(tiny_hf), "toaster", "q0f32")), "toaster", "host")
