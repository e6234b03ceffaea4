"""--calibrate awq: scale folding is exact in float, calibrated rounding beats plain rounding where activations
have outlier channels (and not where they don't), and bad option combinations are one-line errors."""

import json
import weakref

import numpy as np
import pytest
import torch

from compiler.artifacts.artifact import load_artifact
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.errors import MobilecError
from compiler.quantization import awq, group
from compiler.quantization.schemes import get_scheme
from compiler.runtime.session import Session
from tests.helpers.reference import reference_greedy
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint
from tests.helpers.tiny_tokenizer import WORDS

PROMPT = [3, 7, 1, 4, 4, 9, 2, 5, 6, 8, 10, 11, 2]
G32 = get_scheme("q4f32_g32").layout


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    model = build_model("llama_gqa")
    root = tmp_path_factory.mktemp("awq")
    save_compilable_checkpoint(model, root / "hf")
    calib = root / "calib.txt"
    rng = np.random.default_rng(0)
    calib.write_text(" ".join(rng.choice(WORDS[2:], 600)))
    return root / "hf", calib, model


@pytest.mark.slow  # a compile and a run: ~25 s
def test_folded_scales_leave_the_float_model_unchanged(gqa_model, tmp_path, monkeypatch):
    """Every layer kept in float (--quant-skip), scales folded: the compiled logits are transformers' logits."""
    hf_dir, calib, model = gqa_model
    monkeypatch.setattr(awq, "ALPHAS", np.array([1.0]))  # force s = mean|x|, far from 1, so folding is exercised
    out = tmp_path / "a"
    compile_model(CompileOptions(str(hf_dir), "host", "q4f32_g32", str(out), context_window=64, progress=False,
                                 kv_dtype="f32", quant_skip=["model", "lm_head"], calibrate="awq", calib_text=str(calib)))
    logits = Session(load_artifact(out)).prefill_all_logits(PROMPT)
    _, ref, _ = reference_greedy(model, PROMPT, 1)
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    quantization = json.loads((out / "mobilec-config.json").read_text())["quantization"]
    assert quantization["calibration"] == {"method": "awq", "text": str(calib), "tokens": 512}


def test_calibration_scales_every_layer_group(gqa_model, tmp_path, monkeypatch):
    """The scales really are folded (not all ones), with o_proj's shared by the query heads of one kv head."""
    hf_dir, calib, _ = gqa_model
    from compiler.loaders import open_checkpoint

    monkeypatch.setattr(awq, "ALPHAS", np.array([1.0]))
    with open_checkpoint(hf_dir) as ckpt:
        cal = awq.calibrate(ckpt, G32, str(calib), tmp_path)
    for layer in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        s = cal.columns[f"model.layers.1.{layer}.weight"]
        assert s.std() > 0.05 * s.mean()
    o = cal.columns["model.layers.0.self_attn.o_proj.weight"].reshape(2, 2, 16)  # (kv heads, q per kv, head dim)
    np.testing.assert_array_equal(o[:, 0], o[:, 1])
    assert set(cal.rows["model.layers.0.mlp.gate_up_proj.weight"][0][1].shape) == {96}  # up rows, by down's s
    assert "model.embed_tokens" in cal.rounded  # tied: the lm_head's input calibrates the shared table
    assert {f.name for f in tmp_path.iterdir()} == {f"{path}.npz" for path in cal.rounded}
    assert len(cal.rounded) == 4 * 2 + 1


class _CountingCheckpoint:
    """A checkpoint whose tensors, as `get` hands them out, are tracked until freed."""

    def __init__(self, ckpt):
        self._ckpt, self.alive, self.reads, self.most_layers_alive = ckpt, set(), [], 0

    def __getattr__(self, name):
        return getattr(self._ckpt, name)

    def get(self, name):
        array = self._ckpt.get(name)
        self.reads.append(name)
        self.alive.add(name)
        weakref.finalize(array, self.alive.discard, name)
        layers = {n.split(".")[2] for n in self.alive if n.startswith("model.layers.")}
        self.most_layers_alive = max(self.most_layers_alive, len(layers))
        return array


def test_calibration_holds_one_decoder_layer_at_a_time(gqa_model, tmp_path):
    """Each decoder layer's tensors are read once and freed before the next layer's are read (the float model
    whole would not fit with an 8B model's hessians in 8 GB), and each layer logs its line."""
    hf_dir, calib, _ = gqa_model
    from compiler.loaders import open_checkpoint

    lines = []
    with open_checkpoint(hf_dir) as real:
        ckpt = _CountingCheckpoint(real)
        awq.calibrate(ckpt, G32, str(calib), tmp_path, lines.append)
        names = real.tensor_names()
    assert ckpt.most_layers_alive == 1
    layer_reads = [n for n in ckpt.reads if n.startswith("model.layers.")]
    assert sorted(layer_reads) == sorted(n for n in names if n.startswith("model.layers."))
    assert ckpt.reads.count("model.embed_tokens.weight") == 2  # to embed the windows, and to round it (tied)
    assert [line.split(" done")[0] for line in lines[1:3]] == ["calibration: layer 1/2", "calibration: layer 2/2"]


def test_gptq_in_row_chunks_is_bit_identical(monkeypatch):
    """GPTQ rounds GPTQ_ROWS rows at a time (an 8B output layer has 128256): rows are independent given H."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((300, 200)).astype(np.float32)
    x = rng.standard_normal((1000, 200)).astype(np.float32)
    for layout in (G32, group.output_layer_layout(G32)):
        whole = awq.gptq_quantize(w, x.T @ x, layout)
        monkeypatch.setattr(awq, "GPTQ_ROWS", 128)
        chunked = awq.gptq_quantize(w, x.T @ x, layout)
        monkeypatch.undo()
        for key, value in whole.items():
            np.testing.assert_array_equal(chunked[key], value)


def test_stored_layers_take_the_targets_code_order(tmp_path):
    """A layer GPTQ rounded while calibrating is stored in the plain order and handed out in the layout's."""
    rng = np.random.default_rng(6)
    w, x = rng.standard_normal((64, 128)).astype(np.float32), rng.standard_normal((500, 128)).astype(np.float32)
    s = rng.uniform(0.5, 2.0, 128).astype(np.float32)
    cal = awq.Calibration({"fc.weight": s}, {}, tmp_path, set(), {})
    cal.round_layer("fc", w, x.T @ x, G32)
    hessian = x.T @ x / s[:, None] / s[None, :]  # of the scaled model's inputs x / s
    for order in group.CODE_ORDERS:
        layout = G32.with_code_order(order, 64)
        expected = awq.gptq_quantize(w * s, hessian, layout)
        got = cal.quantize("fc", lambda: pytest.fail("a rounded layer's weight is not read again"), layout)
        for key, value in expected.items():
            np.testing.assert_array_equal(got[key], value)


def _outlier_inputs(rng, outliers: bool, t: int = 1024, k: int = 256):
    x = rng.standard_normal((t, k)).astype(np.float32)
    if outliers:
        x[:, :8] *= 30.0  # a few channels carrying large activations, as LLM norm outputs do
    return x


def _output_error(w, x, w_hat):
    return float(((x @ (w_hat - w).T) ** 2).mean())


@pytest.mark.parametrize("outliers", [True, False])
def test_awq_scales_help_only_with_outlier_channels(outliers):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((128, 256)).astype(np.float32)
    x = _outlier_inputs(rng, outliers)
    plain = group.dequantize(group.quantize(w, G32), G32, 256)
    tw, tx = torch.from_numpy(w), torch.from_numpy(x)
    s = awq.search_scale(tw, tx[::8], tx.abs().mean(dim=0), G32).numpy()
    scaled = group.dequantize(group.quantize(w * s, G32), G32, 256) / s
    held_out = _outlier_inputs(rng, outliers)
    gain = _output_error(w, held_out, scaled) / _output_error(w, held_out, plain)
    if outliers:
        assert gain < 0.7
    else:  # negative control: nothing to protect, so scaling can't buy much
        assert gain > 0.9


def test_gptq_rounding_reduces_output_error_on_new_inputs():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 200)).astype(np.float32)  # K not a multiple of the group: padding path
    mix = rng.standard_normal((200, 200)).astype(np.float32) / 10 + np.eye(200, dtype=np.float32)
    x, held_out = (rng.standard_normal((2000, 200)).astype(np.float32) @ mix for _ in range(2))
    arrays = awq.gptq_quantize(w, x.T @ x, G32)
    assert {k: v.shape for k, v in arrays.items()} == {k: v.shape for k, v in group.quantize(w, G32).items()}
    plain = group.dequantize(group.quantize(w, G32), G32, 200)
    gptq = group.dequantize(arrays, G32, 200)
    assert _output_error(w, held_out, gptq) < 0.8 * _output_error(w, held_out, plain)


def test_gptq_with_uncorrelated_inputs_is_plain_rounding():
    """H = I: no column's error can be compensated by another, so GPTQ must store exactly group.quantize's arrays."""
    w = np.random.default_rng(4).standard_normal((32, 200)).astype(np.float32)
    for name in ("q4f16_g32", "q4f16_g128"):
        layout = get_scheme(name).layout
        expected = group.quantize(w, layout)
        for key, value in awq.gptq_quantize(w, np.eye(200, dtype=np.float32), layout).items():
            np.testing.assert_array_equal(value, expected[key])


def test_fake_quantize_matches_numpy():
    w = np.random.default_rng(3).standard_normal((16, 72)).astype(np.float32)
    for name in ("q4f16_g32", "q4f16_g128", "q4f32_g32"):
        layout = get_scheme(name).layout
        np.testing.assert_array_equal(awq.fake_quantize(torch.from_numpy(w), layout).numpy(),
                                      group.dequantize(group.quantize(w, layout), layout, 72))


@pytest.mark.parametrize("quant, calibrate, calib_text, needle", [
    ("q4f16_g32_asym", "awq", None, "symmetric int4"),
    ("q8f16_g128", "awq", None, "symmetric int4"),
    ("q0f32", "awq", None, "symmetric int4"),
    ("gguf", "awq", None, "symmetric int4"),
    ("q4f16_g32", "gptq", None, "unknown --calibrate"),
    ("q4f16_g32", None, "calib.txt", "--calib-text needs --calibrate awq"),
])
def test_bad_calibration_options(tmp_path, quant, calibrate, calib_text, needle):
    with pytest.raises(MobilecError, match=needle):
        compile_model(CompileOptions(str(tmp_path / "missing"), "host", quant, str(tmp_path / "out"),
                                     calibrate=calibrate,
                                     calib_text=calib_text, progress=False))
    assert not (tmp_path / "out").exists()
