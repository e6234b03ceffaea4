"""--kv-dtype: what `auto` picks per target and scheme, the refusals, the cache's dtype in the exported IR, the
estimate's KV bytes and longest context per KV dtype, and a tiny model decoding with a float16, an int8 and an int4
cache against transformers."""

import dataclasses
import functools
import json
from typing import NamedTuple

import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner
import tvm
from tvm import relax

from compiler.artifacts.artifact import CONFIG_FILE, load_artifact
from compiler.commands.cli import main
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.commands.estimate import GIB, EstimateOptions, estimate_memory
from compiler.kernels.cpu_attention import AttentionShape
from compiler.model_import import kv_cache_dtype
from compiler.model_import.importer import import_model, open_model
from compiler.model_import.kv_cache_dtype import KV_FORMAT_ATTR, bytes_per_token_layer, resolve
from compiler.models.llama import LlamaConfig
from compiler.passes.replace_cpu_attention import decode_shape
from compiler.quantization.schemes import get_scheme
from compiler.runtime.session import Session
from compiler.target.build_plan import resolve_plan
from compiler.target.targets import TARGETS_DIR, available_targets, load_target, with_overrides
from tests.helpers.assertions import assert_mobilec_error
from tests.helpers.assertions import without_progress
from tests.helpers.pocl_device import NEEDS_OPENCL, ON_POCL
from tests.helpers.reference import kv_fake_quantized, reference_greedy
from tests.helpers.tiny_models import build_model, random_model, save_compilable_checkpoint

PROMPT = [3, 7, 1, 4, 4, 9, 2, 5, 6, 8, 10]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "hf"
    save_compilable_checkpoint(build_model("llama_gqa"), d)
    return d


# ---------------------------------------------------------------- what auto picks, and what is refused


@pytest.mark.parametrize("target", sorted(available_targets()))
def test_auto_is_float16_for_quantized_models_on_every_target(target):
    assert resolve("auto", load_target(target), get_scheme("q4f16_g32")) == "float16"


def test_auto_keeps_float32_for_the_unquantized_reference_and_float32_gpus():
    host = load_target("host")
    assert resolve("auto", host, get_scheme("q0f32")) == "float32"
    assert resolve("f16", host, get_scheme("q0f32")) == "float16"  # asked for: given
    pocl = with_overrides(load_target("android-mali"), "host", "float32")
    assert resolve("auto", pocl, get_scheme("q4f16_g32")) == "float32"
    assert_mobilec_error(lambda: resolve("f16", pocl, get_scheme("q4f16_g32")), "--kv-dtype f16", "float32",
                         "--kv-dtype f32")


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("target", ["android-mali", "android-adreno"])
def test_quantized_caches_are_taken_by_gpu_targets_computing_in_float16_or_float32(target, name):
    """The phone GPUs' float16 default widens q/k/v to the float32 carrier (models/llama.py); PoCL's float32 too."""
    assert resolve(name, load_target(target), get_scheme("q4f16_g32")) == name
    float32 = with_overrides(load_target(target), compute_dtype="float32")
    assert resolve(name, float32, get_scheme("q4f16_g32")) == name
    assert resolve(name, load_target("host"), get_scheme("q4f16_g32")) == name


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_gpu_quantized_caches_refuse_carrier_rows_tvm_cannot_build(tmp_path, name):
    """llama_gqa's 16-channel heads: int8 rows of 4 floats, int4 of 2; TVM's GPU prefill kernels fail to build."""
    save_compilable_checkpoint(build_model("llama_gqa"), tmp_path / "hf")
    assert_mobilec_error(lambda: compile_model(CompileOptions(
        str(tmp_path / "hf"), "android-adreno", "q0f32", str(tmp_path / "out"), context_window=64, progress=False,
        kv_dtype=name, **ON_POCL)), f"--kv-dtype {name}", "16 channels",
        "--kv-dtype f16")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_caches_are_refused_where_no_kernel_of_ours_runs(name):
    """hexagon-npu: its attention is TVM's (on the host CPU)."""
    assert_mobilec_error(lambda: resolve(name, load_target("hexagon-npu"), get_scheme("q4f16_g32")),
                         f"--kv-dtype {name}", "not implemented there")


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_caches_take_float16_activations(name):
    """q/k/v widened to the float32 carrier (models/llama.py), on a CPU as on a GPU."""
    half = with_overrides(load_target("host"), compute_dtype="float16")
    assert resolve(name, half, get_scheme("q4f16_g32")) == name


def test_quantized_caches_need_whole_codes_per_carrier_cell():
    """A float32 cell holds 4 int8 or 8 int4 codes: head_dim 12 takes int8, not int4; head_dim 18 neither. compile
    refuses it in one line before anything is built."""
    hf = {**build_model("llama_gqa").config.to_dict(), "head_dim": 12}
    config = LlamaConfig.from_hf(hf)
    assert dataclasses.replace(config, kv_dtype="int8").kv_carrier.cell == 3
    assert_mobilec_error(lambda: dataclasses.replace(config, kv_dtype="int4").kv_carrier, "--kv-dtype int4",
                         "head_dim 12", "multiple of 8")
    assert dataclasses.replace(config, kv_dtype="float16").kv_carrier is None


def test_compile_refuses_a_head_dim_in_one_line(tmp_path):
    model = build_model("llama_odd")  # head_dim 18
    save_compilable_checkpoint(model, tmp_path / "hf")
    for name in ("int8", "int4"):
        out = tmp_path / name
        result = CliRunner().invoke(main, ["compile", "--model", str(tmp_path / "hf"), "--quant", "q0f32",
                                           "--kv-dtype", name, "-o", str(out)])
        assert result.exit_code == 2, result.output
        lines = without_progress(result.stderr)
        assert len(lines) == 1 and f"--kv-dtype {name}: head_dim 18" in lines[0], result.stderr
        assert not out.exists()


def test_a_target_file_sets_what_auto_picks(tmp_path):
    text = (TARGETS_DIR / "host.toml").read_text().replace('name = "host"', 'name = "f32-cache"')
    good = tmp_path / "f32-cache.toml"
    good.write_text(text.replace("[device]\n", '[device]\nkv_dtype = "f32"\n'))
    assert resolve("auto", load_target(str(good)), get_scheme("q4f16_g32")) == "float32"
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("[device]\n", '[device]\nkv_dtype = "q4_0"\n'))
    assert_mobilec_error(lambda: load_target(str(bad)), "device.kv_dtype", "'q4_0'", "int4")


# ---------------------------------------------------------------- the exported IR


def _kv_cache_dtype_and_casts(model_dir, kv_dtype: str) -> tuple[str, list[str]]:
    """The dtype the exported module creates its KV cache with, and the dtypes decode casts to."""
    with open_model(str(model_dir)) as ckpt:
        mod = import_model(ckpt, resolve_plan("host", "q4f16_g32", kv_dtype=kv_dtype), 64).mod
    zeros, casts = [], []

    def visit(expr, into):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            if expr.op.name == "relax.zeros":
                zeros.append(str(expr.attrs.dtype))
            elif expr.op.name == "relax.astype" and into is casts:
                casts.append(str(expr.attrs.dtype))

    relax.analysis.post_order_visit(mod["create_tir_paged_kv_cache"], lambda e: visit(e, zeros))
    relax.analysis.post_order_visit(mod["decode"], lambda e: visit(e, casts))
    assert len(zeros) == 1, zeros  # the value the runtime allocates pages like
    return zeros[0], casts


def test_a_float16_cache_is_created_and_fed_float16(tiny_hf):
    layers = build_model("llama_gqa").config.num_hidden_layers
    dtype, casts = _kv_cache_dtype_and_casts(tiny_hf, "f16")
    assert dtype == "float16"
    # per layer: q/k/v to float16 before attention, its output back to float32
    assert sorted(casts) == sorted(["float16", "float32"] * layers)
    dtype, casts = _kv_cache_dtype_and_casts(tiny_hf, "f32")  # negative control: no cast
    assert dtype == "float32" and casts == []


@pytest.mark.parametrize("name,declared", [("int8", (3, 26, 4)), ("int4", (4, 56, 2))])
def test_a_quantized_cache_is_declared_as_its_float32_carrier(tiny_hf, name, declared):
    """The runtime is given the carrier's float32 geometry (4 query heads, 2 KV heads of 16 -> int8: 26 and 2 + 1
    heads of 4 floats; int4: 56 and 2 + 2 heads of 2 floats), the module records the real one and the format for
    the kernels, and q/k/v are not cast."""
    dtype, casts = _kv_cache_dtype_and_casts(tiny_hf, name)
    assert dtype == "float32" and casts == []
    with open_model(str(tiny_hf)) as ckpt:
        mod = import_model(ckpt, resolve_plan("host", "q4f16_g32", kv_dtype=name), 64).mod
    kv_format = mod.attrs[KV_FORMAT_ATTR]
    assert (str(kv_format["format"]), int(kv_format["heads"]), int(kv_format["kv_heads"]),
            int(kv_format["head_dim"])) == (name, 4, 2, 16)
    kv_heads, heads, cell = declared
    assert decode_shape(mod["batch_decode_paged_kv_cpu"]) == AttentionShape(kv_heads, heads, cell, "float32", 16)


# ---------------------------------------------------------------- the estimate


def test_estimate_counts_kv_bytes_by_dtype(tiny_hf):
    f32, f16 = (estimate_memory(EstimateOptions(str(tiny_hf), "host", "q4f16_g32", 256, kv_dtype=name))
                for name in ("f32", "f16"))
    assert (f32.kv_dtype, f16.kv_dtype) == ("float32", "float16")
    assert f32.kv_cache_bytes == 2 * f16.kv_cache_bytes and f32.weights_bytes == f16.weights_bytes
    assert f32.bytes_per_token - f16.bytes_per_token == f16.kv_cache_bytes * 256 // (256 + 16)
    assert f32.to_json()["kv_dtype"] == "float32"
    # int8: counted as allocated, its float32 carrier (tiny model: 3 rows of 4 floats per token and layer, K and V)
    int8 = estimate_memory(EstimateOptions(str(tiny_hf), "host", "q4f16_g32", 256, kv_dtype="int8"))
    assert int8.kv_dtype == "int8" and int8.kv_cache_bytes * 256 == f32.kv_cache_bytes * (2 * 3 * 4 * 4)
    # int4: 2 code rows + 2 parameter rows of 2 cells (a cell per K group of 8 channels: 2 groups of 2 heads)
    int4 = estimate_memory(EstimateOptions(str(tiny_hf), "host", "q4f16_g32", 256, kv_dtype="int4"))
    assert int4.kv_dtype == "int4" and int4.kv_cache_bytes * 256 == f32.kv_cache_bytes * (2 * 4 * 2 * 4)
    assert int4.bytes_per_token < int8.bytes_per_token < f16.bytes_per_token
    # SmolLM2 (3 KV heads of 64), K and V of a token in a layer: f16 768 bytes; int8 3 code rows + 1 scale row of
    # 16 floats; int4 3 code rows + 3 rows of 8 cells for K's 24 groups of 8 channels (V's 12 groups of 16 fill
    # half of its plane's)
    assert [bytes_per_token_layer(dtype, 3, 64) for dtype in ("float16", "int8", "int4")] == [768, 512, 384]


@pytest.mark.parametrize("kv_dtype", ["f16", "f32"])
def test_estimate_names_the_longest_context_per_kv_dtype(kv_dtype, tmp_path):
    """The context it names for the estimated KV dtype fits and one page more does not; for the other dtype (whose
    activations are bounded, not planned) it fits and is within 5% of the exact one (bounded: the casts of a prefill chunk). A 64 MiB device, so that the
    model's window is not the limit."""
    config = {**build_model("llama_gqa").config.to_dict(), "max_position_embeddings": 1 << 22, "num_hidden_layers": 8,
              "num_key_value_heads": 4, "num_attention_heads": 4}
    text = (TARGETS_DIR / "host.toml").read_text().replace('name = "host"', 'name = "small"')
    for field in ("ram_gb", "max_alloc_gb"):
        text = text.replace(f'{field} = "detect"', f"{field} = 0.0625")
    target = tmp_path / "small.toml"
    target.write_text(text)

    @functools.cache  # an estimate runs the compile pipeline: ~10 s each
    def estimate(context, name):
        return estimate_memory(EstimateOptions(config, str(target), "q4f16_g32", context, kv_dtype=name))

    longest = estimate(4096, kv_dtype).context_by_kv_dtype
    assert set(longest) == {"f32", "f16", "int8", "int4"} and longest["f16"] > 1.9 * longest["f32"] > 4096
    # int8, head_dim 16, 4 KV heads: 4 code rows + 1 scale row of 4 floats, 80 bytes a token and layer for K,
    # against f16's 128; int4: 4 code rows + 4 parameter rows of 2 floats, 64 bytes
    assert longest["int4"] > 1.2 * longest["int8"] > 1.8 * longest["f16"]
    own = longest[kv_dtype]
    assert estimate(own, kv_dtype).fits and not estimate(own + 16, kv_dtype).fits
    other = "f32" if kv_dtype == "f16" else "f16"
    exact = estimate(longest[other], other).context_by_kv_dtype[other]
    assert estimate(longest[other], other).fits and exact * 0.95 <= longest[other] <= exact
    assert estimate(4096, kv_dtype).ram_bytes == GIB // 16


def test_estimate_lists_only_the_kv_dtypes_the_target_takes(tiny_hf):
    """A phone GPU computing in float16 takes all four; the same GPU computing in float32 (PoCL) no float16 cache;
    the host all four."""
    def listed(target, **overrides):
        spec = with_overrides(load_target(target), **overrides) if overrides else load_target(target)
        return sorted(kv_cache_dtype.names_taken(spec, get_scheme("q4f16_g32")))
    assert listed("android-adreno") == ["f16", "f32", "int4", "int8"]
    assert listed("android-adreno", **ON_POCL) == ["f32", "int4", "int8"]
    assert listed("host") == ["f16", "f32", "int4", "int8"]
    result = CliRunner().invoke(main, ["estimate", "--model", str(tiny_hf), "--target", "android-adreno", "--quant",
                                       "q4f16_g32", "--context-window", "64", "--json"])
    assert result.exit_code == 0, result.output
    assert sorted(json.loads(result.output)["context_by_kv_dtype"]) == ["f16", "f32", "int4", "int8"]


def test_estimate_cli_takes_kv_dtype(tiny_hf):
    result = CliRunner().invoke(main, ["estimate", "--model", str(tiny_hf), "--quant", "q4f16_g32",
                                       "--context-window", "64", "--kv-dtype", "f32", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["kv_dtype"] == "float32"
    table = CliRunner().invoke(main, ["estimate", "--model", str(tiny_hf), "--quant", "q4f16_g32"]).stdout
    assert "float16, pages of 16 tokens" in table and "with a f32 KV cache" in table, table


# ---------------------------------------------------------------- a float16 cache, compiled and run


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.slow  # two compiles of a tiny model and transformers: ~1 minute
def test_float16_cache_decodes_like_transformers(tmp_path_factory):
    model = build_model("llama_gqa")
    root = tmp_path_factory.mktemp("kv16")
    save_compilable_checkpoint(model, root / "hf")
    sessions = {}
    for name in ("f16", "f32"):
        compile_model(CompileOptions(str(root / "hf"), "host", "q0f32", str(root / name), context_window=64,
                                     progress=False, kv_dtype=name))
        assert json.loads((root / name / CONFIG_FILE).read_text())["kv_dtype"] == {"f16": "float16",
                                                                                   "f32": "float32"}[name]
        sessions[name] = Session(load_artifact(root / name))
    ref_tokens, ref_prefill, ref_decode = reference_greedy(model, PROMPT, 9)
    errors, logits = {}, {}
    for name, session in sessions.items():
        session.reset()
        logits[name] = [session.prefill_all_logits(PROMPT)]
        logits[name] += [session.decode(token) for token in ref_tokens[:-1]]
        errors[name] = [_rel_err(got, want) for got, want in zip(logits[name], [ref_prefill, *ref_decode])]
    assert max(errors["f32"]) < 1e-3 and max(errors["f16"]) < 5e-3, errors
    # negative control: the float16 cache is really used, its rounding of K and V shows in the logits
    assert max(_rel_err(a, b) for a, b in zip(logits["f16"], logits["f32"])) > 1e-5


# per quantized cache: the largest relative difference from the float model's logits, and how many of its 9 greedy
# tokens the cache must keep. int8 rounds each K/V value by up to max|row| / 254, int4 by (max - min) / 30 of its
# row; this random tiny model (head_dim 16, logits of order 1) shows 4e-2 with int8 (9 tokens kept) and 0.72 with
# int4 (4 kept), a trained model much less (SmolLM2's perplexity: docs/quantization.md)
TO_FLOAT = {"int8": (6e-2, 7), "int4": (1.0, 3)}


class Decoded(NamedTuple):
    logits: list[np.ndarray]  # the prefill's, each decode step's, the second prefill's
    to_quantized: list[float]  # relative errors to transformers with K/V quantized the same way
    to_float: list[float]  # to the float model
    to_controls: list[list[float]]  # to each of the `controls` models, K/V quantized the same way
    ref_tokens: list[int]  # the float model's greedy tokens


def decode_against_transformers(model, root, name: str, target: str = "host", controls=(), **options) -> Decoded:
    """Compile `model` for `target` with a `name` cache; prefill + 8 decode steps + a second prefill on the cached
    tokens (the paged prefill and merge kernels), compared with transformers on the same tokens (the float model's
    greedy ones, which the quantized one may not pick)."""
    save_compilable_checkpoint(model, root / "hf")
    compile_model(CompileOptions(str(root / "hf"), target, "q0f32", str(root / name), context_window=64,
                                 progress=False, kv_dtype=name, **options))
    assert json.loads((root / name / CONFIG_FILE).read_text())["kv_dtype"] == name
    session = Session(load_artifact(root / name))
    ref_tokens, _, _ = reference_greedy(model, PROMPT, 9)
    session.reset()
    logits = [session.prefill_all_logits(PROMPT)] + [session.decode(token) for token in ref_tokens[:-1]]
    more = [11, 2, 30, 5, 7]
    logits.append(session.prefill_all_logits(more))
    sequence = PROMPT + ref_tokens[:-1] + more
    steps = [slice(0, len(PROMPT))] + [len(PROMPT) + i for i in range(len(ref_tokens) - 1)] + [
        slice(len(sequence) - len(more), len(sequence))]

    def errors(reference) -> list[float]:
        with torch.inference_mode():
            want = reference(torch.tensor([sequence])).logits[0].numpy()
        return [_rel_err(got, want[step]) for got, step in zip(logits, steps)]

    return Decoded(logits, errors(kv_fake_quantized(model, name)), errors(model),
                   [errors(kv_fake_quantized(control, name)) for control in controls], ref_tokens)


@pytest.mark.slow  # a compile of a tiny model and transformers: ~1 minute each
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_cache_decodes_like_transformers(tmp_path_factory, name):
    """A quantized cache: within 1e-5 of transformers with K/V quantized the same way (so every kernel computes
    what it should), within TO_FLOAT of the float model, some of whose greedy tokens it keeps."""
    logits, to_quantized, to_float, _, ref_tokens = decode_against_transformers(
        build_model("llama_gqa"), tmp_path_factory.mktemp(f"kv-{name}"), name)
    most, kept = TO_FLOAT[name]
    assert max(to_quantized) < 1e-5, to_quantized
    assert max(to_float) < most, to_float
    assert min(to_float) > 1e-4  # negative control: the quantization shows, the cache is really used
    tokens = [int(np.argmax(logits[0][-1]))] + [int(np.argmax(step)) for step in logits[1:-1]]
    assert sum(a == b for a, b in zip(tokens, ref_tokens)) >= kept, (tokens, ref_tokens)


@pytest.mark.slow  # a compile of a tiny model and transformers: ~1 minute each
@NEEDS_OPENCL
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_cache_on_a_gpu_target_decodes_like_transformers(tmp_path_factory, name):
    """android-adreno on PoCL (--compute-dtype float32): mobilec's GPU kernels of the cache (split + RoPE +
    quantize, decode, ragged and paged prefill, merge) within 1e-5 of transformers with K/V quantized the same way;
    negative control: the quantization shows. Heads of 64 channels: TVM 0.27 cannot build its GPU prefill kernels
    for the carrier of llama_gqa's 16-channel heads (4 or 2 floats a cell; real models' geometries build), and the
    cache creates them before ours replace them."""
    shape = dict(vocab_size=256, hidden_size=256, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=256, rms_norm_eps=1e-5,
                 rope_theta=50000.0)
    model = random_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**shape))
    _, to_quantized, to_float, _, _ = decode_against_transformers(
        model, tmp_path_factory.mktemp(f"kv-gpu-{name}"), name, "android-adreno", **ON_POCL)
    assert max(to_quantized) < 1e-4, to_quantized  # PoCL's float32 sums and cos/sin: 1.3e-5 seen
    assert min(to_float) > 1e-3, to_float
