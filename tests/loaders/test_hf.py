"""HF directory loader: formats agree, dtypes convert, config is normalized, bad inputs give one-line errors."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from compiler.loaders import open_checkpoint
from tests.helpers.assertions import assert_mobilec_error
from tests.helpers.tiny_models import SPECS, build_model, save_hf, state_dict


def _all_tensors(path) -> dict[str, np.ndarray]:
    with open_checkpoint(path) as ckpt:
        return {name: ckpt.get(name) for name in ckpt.tensor_names()}


@pytest.mark.parametrize("name", list(SPECS))
def test_safetensors_equals_model_weights(tiny, name):
    expected = {k: v.numpy() for k, v in state_dict(tiny.model(name)).items()}
    got = _all_tensors(tiny.path(name, "safetensors"))
    assert list(got) and set(got) == set(expected)
    for k, v in expected.items():
        assert got[k].dtype == np.float32 and got[k].shape == v.shape, k
        np.testing.assert_array_equal(got[k], v, err_msg=k)


@pytest.mark.parametrize("fmt", ["safetensors_sharded", "bin", "bin_sharded"])
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias"])
def test_other_formats_equal_single_safetensors(tiny, name, fmt):
    reference = _all_tensors(tiny.path(name, "safetensors"))
    got = _all_tensors(tiny.path(name, fmt))
    assert set(got) == set(reference)
    for k, v in reference.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_converted_to_float32(tmp_path, fmt, dtype):
    model = build_model("llama_gqa", dtype=dtype)
    with open_checkpoint(save_hf(model, tmp_path, fmt)) as ckpt:
        for k, v in state_dict(model).items():
            got = ckpt.get(k)
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, v.float().numpy(), err_msg=k)


def test_hf_config_is_normalized(tiny):
    with open_checkpoint(tiny.path("qwen2_bias", "safetensors")) as ckpt:
        cfg = ckpt.hf_config
        assert cfg["model_type"] == "qwen2"
        assert cfg["rope_theta"] == 50000.0  # transformers 5 saved it only under rope_parameters
        assert cfg["head_dim"] == 16 and cfg["attention_bias"] is True
        assert cfg["tie_word_embeddings"] is False
        assert ckpt.description == "HF safetensors (model.safetensors)"
    with open_checkpoint(tiny.path("llama_gqa", "bin_sharded")) as ckpt:
        assert ckpt.hf_config["tie_word_embeddings"] is True
        assert "lm_head.weight" not in ckpt.tensor_names()
        assert ckpt.description == "HF bin_sharded (2 bin shards)"


def test_arrays_outlive_close(tiny):
    ckpt = open_checkpoint(tiny.path("llama_gqa", "bin"))
    w = ckpt.get("model.embed_tokens.weight")
    ckpt.close()
    w += 1  # owned, writable memory, not a view of the closed mapping
    assert np.isfinite(w).all()


def test_missing_tensor_and_gguf_blocks(tiny):
    with open_checkpoint(tiny.path("llama_gqa", "safetensors")) as ckpt:
        assert_mobilec_error(lambda: ckpt.get("model.layers.9.mlp.up_proj.weight"), "model.layers.9.mlp.up_proj.weight")
        assert_mobilec_error(lambda: ckpt.get_gguf_blocks("model.embed_tokens.weight"), "not a GGUF")


def test_save_tokenizer_copies_a_working_tokenizer(tiny, tmp_path, smollm2_tokenizer_dir):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny.path("llama_gqa", "safetensors"), model_dir)
    with open_checkpoint(model_dir) as ckpt:
        assert_mobilec_error(lambda: ckpt.save_tokenizer(tmp_path / "none"), "no tokenizer files")
    for f in smollm2_tokenizer_dir.iterdir():
        shutil.copy(f, model_dir)
    with open_checkpoint(model_dir) as ckpt:
        ckpt.save_tokenizer(tmp_path / "out")
    saved = AutoTokenizer.from_pretrained(tmp_path / "out")
    original = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    assert saved("Hello, world")["input_ids"] == original("Hello, world")["input_ids"]
    assert saved.chat_template == original.chat_template is not None


# --- bad input: one line naming the problem ---


def test_missing_path(tmp_path):
    assert_mobilec_error(lambda: open_checkpoint(tmp_path / "nope"), "does not exist", "nope")


def test_directory_without_config(tmp_path):
    assert_mobilec_error(lambda: open_checkpoint(tmp_path), "no config.json")


def test_invalid_json_config(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    assert_mobilec_error(lambda: open_checkpoint(tmp_path), "config", "not valid JSON")


def test_config_without_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert_mobilec_error(lambda: open_checkpoint(tmp_path), "no model_type")


def test_directory_without_weights(tiny, tmp_path):
    shutil.copy(tiny.path("llama_gqa", "safetensors") / "config.json", tmp_path)
    assert_mobilec_error(lambda: open_checkpoint(tmp_path), "no weight files")


@pytest.mark.parametrize("fmt,file", [("safetensors", "model.safetensors"), ("bin", "pytorch_model.bin")])
@pytest.mark.parametrize("keep", [0.5, 0.999, 10])
def test_truncated_weights(tiny, tmp_path, fmt, file, keep):
    shutil.copytree(tiny.path("llama_gqa", fmt), tmp_path, dirs_exist_ok=True)
    weights = tmp_path / file
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    assert_mobilec_error(lambda: open_checkpoint(tmp_path), "truncated", file)


def test_index_naming_a_missing_shard(tiny, tmp_path):
    shutil.copytree(tiny.path("llama_gqa", "safetensors_sharded"), tmp_path, dirs_exist_ok=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    os.remove(tmp_path / shard)
    assert_mobilec_error(lambda: open_checkpoint(tmp_path), "missing", shard)


@pytest.mark.parametrize("suffix", ["", ".gguf", ".safetensors", ".bin", ".json"])
def test_random_bytes_file(tmp_path, suffix):
    path = tmp_path / f"random{suffix}"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    assert_mobilec_error(lambda: open_checkpoint(path), "random", "not a GGUF")


def test_weight_file_instead_of_its_directory(tiny):
    weights = tiny.path("llama_gqa", "safetensors") / "model.safetensors"
    assert_mobilec_error(lambda: open_checkpoint(weights), "pass the directory")
