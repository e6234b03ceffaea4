"""Compile memory is bounded by a tensor, not the model: checkpoints read a tensor (or a slice of rows) at a time with
their pages given back, quantization in row chunks, and each compile step's peak resident memory reported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from compiler.commands.cli import main
from compiler.commands.estimate import (COMPILE_BASE_BYTES, EstimateOptions, calibrate_peak_bytes, compile_peak_bytes,
                               estimate_memory, format_budget)
from compiler.loaders import open_checkpoint
from compiler.model_import.importer import import_model, open_model
from compiler.quantization import awq, group
from compiler.quantization.group import output_layer_layout
from compiler.quantization.schemes import get_scheme
from compiler.target import host
from compiler.target.build_plan import resolve_plan
from tests.helpers.real_shapes import write_checkpoint, write_config
from tests.helpers.tiny_models import build_model, save_hf, state_dict

MB, GIB = 1 << 20, 1 << 30


@pytest.mark.parametrize("quant", ["q4f16_g32", "q4f16_g32_asym", "q8f16_g128"])
@pytest.mark.parametrize("order", ["plain", "neon", "neon_pairs"])
def test_quantizing_in_row_chunks_stores_the_same_bytes(monkeypatch, quant, order):
    """Rows are independent, so chunks (an even count of rows, the last one short) give the whole tensor's arrays;
    the 8-bit output layout too (its scale search is what made whole-tensor temporaries large)."""
    rng = np.random.default_rng(0)
    for layout in (get_scheme(quant).layout, output_layer_layout(get_scheme(quant).layout)):
        layout = layout.with_code_order(order, 70)
        w = rng.standard_normal((70, 96)).astype(np.float32)
        whole = group.quantize(w, layout)
        monkeypatch.setattr(group, "QUANTIZE_CHUNK_BYTES", 4 * 96 * 6)  # 6 rows a chunk: 12 chunks, the last of 4
        chunked = group.quantize(w, layout)
        monkeypatch.undo()
        assert whole.keys() == chunked.keys()
        for key, array in whole.items():
            assert chunked[key].dtype == array.dtype and np.array_equal(chunked[key], array), (layout, key)


def test_safetensors_rows_read_a_slice_and_the_whole(tmp_path):
    model = build_model("llama_gqa", dtype=torch.bfloat16)
    with open_checkpoint(save_hf(model, tmp_path, "safetensors")) as ckpt:
        for name, tensor in state_dict(model).items():
            rows, want = ckpt.rows(name), tensor.float().numpy()
            assert rows.shape == want.shape and np.array_equal(np.asarray(rows), want), name
            assert np.array_equal(rows[1:3], want[1:3]) and rows[1:3].dtype == np.float32, name


_READ_ALL = textwrap.dedent("""
    import json, sys
    from compiler.progress import peak_rss_bytes, rss_bytes
    path, how = sys.argv[1], sys.argv[2]
    if how == "mobilec":
        from compiler.loaders import open_checkpoint
        ckpt = open_checkpoint(__import__("pathlib").Path(path))
        names, read = ckpt.tensor_names(), ckpt.get
    else:  # the safetensors package, as mobilec read checkpoints before: every touched page stays resident
        import glob
        from safetensors import safe_open
        files = [safe_open(f, "pt") for f in sorted(glob.glob(path + "/*.safetensors"))]
        where = {n: f for f in files for n in f.keys()}
        names, read = list(where), lambda n: where[n].get_tensor(n).float().numpy()
    start = rss_bytes()
    for name in names:
        read(name)
    print(json.dumps({"growth": peak_rss_bytes() - start}))
""")


def test_reading_a_checkpoint_keeps_about_one_tensor_resident(tmp_path):
    """A 32-layer checkpoint of ~730 MB (bf16) read tensor by tensor: the process grows by its largest tensor as
    float32 (the embedding, 189 MB) and that tensor's pages, not by the checkpoint; the negative control, the
    safetensors package, grows by the whole file (its map keeps every page it touched)."""
    path = write_checkpoint("smollm2-360m", tmp_path / "ckpt", layers=32)
    largest = 4 * 49152 * 960

    def growth(how: str) -> int:
        out = subprocess.run([sys.executable, "-c", _READ_ALL, str(path), how], capture_output=True, text=True,
                             check=True, timeout=300)
        return json.loads(out.stdout)["growth"]

    ours, package = growth("mobilec"), growth("safetensors")
    assert ours < 1.75 * largest, ours / MB
    assert package > ours + 400 * MB, (package / MB, ours / MB)


def test_compile_reports_each_steps_memory_and_weights_stay_within_a_tensor(tmp_path):
    """`compile --json` off a terminal: a line per step on stderr (and tensor counts), stdout one JSON object whose
    steps give each one's peak memory; writing the weights grows the process by less than twice its largest float32
    tensor (the embedding, 189 MB, quantized a slice of rows at a time; that the growth does not follow the
    checkpoint's size: test_reading_a_checkpoint_keeps_about_one_tensor_resident)."""
    path = write_checkpoint("smollm2-360m", tmp_path / "ckpt", layers=4)
    out = subprocess.run([sys.executable, "-m", "compiler", "compile", "--model", str(path), "--target", "host",
                          "--quant", "q4f16_g32", "-o", str(tmp_path / "art"), "--json"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert list(summary["steps"]) == ["import", "build", "weights", "write"]
    for n, step in enumerate(summary["steps"], 1):
        assert f"compile: [{n}/4] {step}" in out.stderr and f"compile: [{n}/4] {step} done in" in out.stderr
    assert "tensors 43/43 (100% of the bytes)" in out.stderr, out.stderr
    weights = summary["steps"]["weights"]
    assert weights["peak_rss_bytes"] - weights["start_rss_bytes"] < 2 * 4 * 49152 * 960, weights


def test_estimate_gives_the_compiles_own_memory_and_compile_refuses_a_machine_without_it(tmp_path, monkeypatch):
    """Llama-3-8B's compile holds, beside COMPILE_BASE_BYTES, its largest layer: the untied lm_head's int8 arrays
    (128256 x 4096 -> 0.5 GiB, read a slice at a time); estimate prints it; compile refuses in one line, after the
    import and before the build, where the machine has less available, and names --force."""
    plan = resolve_plan("android-adreno")
    with open_model(str(write_config("llama-3-8b", tmp_path / "8b")), weights_required=False) as ckpt:
        need = compile_peak_bytes(import_model(ckpt, plan, None, export=False))
    lm_head = 128256 * 4096 + 2 * 128256 * 4096 // 32
    assert COMPILE_BASE_BYTES + lm_head <= need < COMPILE_BASE_BYTES + lm_head + 300 * MB

    path = write_checkpoint("smollm2-360m", tmp_path / "ckpt", layers=1)
    assert "compile here" in format_budget(estimate_memory(EstimateOptions(str(path), "host", "q4f16_g32", 64)))
    monkeypatch.setattr(host, "available_bytes", lambda: 256 * MB)
    result = CliRunner().invoke(main, ["compile", "--model", str(path), "-o", str(tmp_path / "art")])
    assert result.exit_code != 0 and not (tmp_path / "art").exists()
    line = result.output.strip().splitlines()[-1]
    assert "needs about" in line and "256.0 MiB available" in line and "--force" in line, result.output


def test_estimate_counts_calibrations_peak_and_compile_refuses_before_calibrating(tmp_path, monkeypatch):
    """--calibrate awq holds a decoder layer's float32 weights twice and GPTQ's k x k matrices of its widest input:
    for Llama-3-8B (down_proj, k = 14336) 6.28 GiB measured on a 4-layer checkpoint of its shape
    (bench/compile_memory.py --layers 4), 6.45 GiB counted; estimate's 'compile here' counts it, and compile refuses
    before the calibration's run where the machine has less available."""
    plan = resolve_plan("host", "q4f16_g32")
    with open_model(str(write_config("llama-3-8b", tmp_path / "8b")), weights_required=False) as ckpt:
        imported = import_model(ckpt, plan, None, export=False)
    calibrated = compile_peak_bytes(imported, "awq")
    assert calibrated == calibrate_peak_bytes(imported.cfg) > compile_peak_bytes(imported)
    assert 6.28 * GIB <= calibrated <= 6.28 * GIB * 1.1, calibrated / GIB

    path = write_checkpoint("smollm2-360m", tmp_path / "ckpt", layers=1)
    est = estimate_memory(EstimateOptions(str(path), "host", "q4f16_g32", 64, calibrate="awq"))
    assert "peak of `compile --calibrate awq` itself" in format_budget(est)
    plain = estimate_memory(EstimateOptions(str(path), "host", "q4f16_g32", 64)).compile_bytes
    assert est.compile_bytes > plain
    monkeypatch.setattr(host, "available_bytes", lambda: (plain + est.compile_bytes) // 2)
    monkeypatch.setattr(awq, "calibrate", lambda *_args: pytest.fail("calibrated before the memory check"))
    result = CliRunner().invoke(main, ["compile", "--model", str(path), "--quant", "q4f16_g32", "--calibrate", "awq",
                                       "-o", str(tmp_path / "art")])
    assert result.exit_code != 0 and not (tmp_path / "art").exists()
    line = result.output.strip().splitlines()[-1]
    assert "needs about" in line and "--force" in line, result.output


def test_gguf_rows_read_a_slice_and_the_whole(smollm2_gguf):
    """A GGUF tensor's Rows dequantize only the blocks of the rows asked (Q8_0 embedding, Q4_K/Q6_K matrices)."""
    with open_checkpoint(smollm2_gguf) as ckpt:
        for name in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight",
                     "model.layers.0.self_attn.o_proj.weight"):
            rows, want = ckpt.rows(name), ckpt.get(name)
            assert rows.shape == want.shape and np.array_equal(np.asarray(rows), want), name
            assert np.array_equal(rows[5:9], want[5:9]), name
